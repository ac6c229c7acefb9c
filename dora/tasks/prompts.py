"""A run's prompts and scoring: the task's items, rendered and encoded with the model's own tokenizer.

The items come from a built-in task (generated from the group id) or from the user's dataset
(``dora.tasks.datasets``: group id -> epoch and position). Each item's messages are rendered with the
model's chat template or as plain text (``dora.tasks.templates``) and encoded with ``tokenizers`` (no
torch), so the broker can encode prompts cheaply; every process rebuilds the same items from the same
config, so no prompt text travels with a group.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import pathlib
from collections.abc import Callable
from typing import Any

import numpy as np

from dora.config import ConfigError
from dora.config.run import RunConfig, TaskSection
from dora.sim.workload import Workload
from dora.tasks import combine, datasets, rewards, tasks
from dora.tasks.templates import Renderer, opening_ids


class TaskRun:
    def __init__(self, task: TaskSection, tokenizer_dir: str) -> None:
        from tokenizers import Tokenizer

        path = pathlib.Path(tokenizer_dir) / "tokenizer.json"
        if not path.is_file():
            raise ConfigError(f"no tokenizer.json in {tokenizer_dir}")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.section = task
        self.renderer = Renderer(tokenizer_dir, task.chat_template)
        self.system = ({"role": "system", "content": task.system_prompt},) if task.system_prompt else ()
        self.env: type | None = None
        """The environment class (task.env): items are episodes, their prompts its opening turns."""
        if task.env is not None:
            from dora import envs

            self.env = envs.resolve(task.env)
        self.agent: Callable[..., Any] | None = None
        """The agent (task.agent): items are episodes it drives; their prompt is the chat template's opening."""
        self.opening: list[int] = []
        """An agent task's prompt: the tokens every conversation opens with (``templates.opening_ids``)."""
        if task.agent is not None:
            self.agent = resolve_agent(task.agent)
            self.opening = opening_ids(self.renderer, self.encode)
            if self.encode(self.opening_text) != self.opening:
                raise ConfigError(f"task.agent: the chat template's opening {self.opening_text!r} does not encode back "
                                  "to its own tokens")  # fmt: skip
        spec = task.reward or rewards.DEFAULT.get(task.name)
        if spec is None and self.env is None and self.agent is None and not combine.weights(task):
            raise ConfigError(f"task {task.name!r} needs task.reward (a module:function scoring a completion)")
        self.reward = combine.resolve(task, spec)
        """task.reward (or the task's default), or the weighted sources of task.reward_weights (``combine``)."""
        self.timeout_s = task.reward_timeout_s
        self.about: dict[str, Any] = {"task": task.name}
        """What the task is, for the start report, the journal and the metrics."""
        self.rows: list[datasets.Row] = []
        self.epochs: datasets.Epochs | None = None
        if task.dataset is None:
            self.task = tasks.get(task.name, task.seed)
            self.item: Callable[[int], tasks.Item] = functools.lru_cache(maxsize=8192)(self._generated)
            return
        raw, columns = datasets.read_table(task.dataset, task.split)
        self.rows = datasets.check_rows(raw, columns, where=task.dataset, prompt_field=task.prompt_field,
                                        messages_field=task.messages_field, answer_field=task.answer_field,
                                        system_prompt=task.system_prompt)  # fmt: skip
        if self.env is not None:
            self.texts = [self._episode(self._row_source(r)).prompt for r in range(len(self.rows))]
        else:
            self.texts = [self.renderer.render(r.messages, f"{task.dataset} row {r.index}") for r in self.rows]
        lengths = [len(self.encode(t)) for t in self.texts]  # an agent's rows: as a plain chat would open
        if self.agent is not None:
            self.texts = [self.opening_text] * len(self.rows)
        kept, filtered = datasets.kept_rows(self.rows, lambda r: lengths[r.index], task.max_prompt_tokens)
        self.epochs = datasets.Epochs(kept, task.seed)
        digest = hashlib.sha256()
        for i in kept:
            digest.update(f"{self.texts[i]}\x00{self.rows[i].answer}\x00".encode())
        self.about.update(dataset=task.dataset, rows=len(self.rows), kept=len(kept), filtered=len(filtered),
                          filtered_rows=filtered[:20], max_prompt_tokens=task.max_prompt_tokens,
                          longest_prompt=max((lengths[i] for i in kept), default=0),
                          fingerprint=digest.hexdigest()[:16])  # fmt: skip
        self.item = self._from_dataset

    def _episode(self, item: tasks.Item) -> tasks.Item:
        """An episode's item: its prompt is the environment's opening turns, rendered. ``meta["source"]`` is the
        item ``reset`` was given, so a worker makes the same opening on its own instance. A reset that fails
        here leaves the plain prompt (the worker's reset fails the same way and ends the episode, scored 0)."""
        from dora import envs

        assert self.env is not None
        where = f"{item.task} item {item.index}"
        try:
            opening = envs.messages(self.env().reset(item), f"{self.env.__name__}.reset")
        except Exception:  # the environment is user code: its failure ends the episode, not the process
            opening = [*self.system, {"role": "user", "content": item.prompt}]
        meta = {**item.meta, "source": item, "messages": opening}
        return tasks.Item(task=item.task, index=item.index, prompt=self.renderer.render(opening, where),
                          answer=item.answer, meta=meta)  # fmt: skip

    @property
    def opening_text(self) -> str:
        """An agent task's prompt as text (encoding it gives ``opening`` back: checked when the task is made)."""
        return self.tokenizer.decode(self.opening, skip_special_tokens=False)

    def _agent_item(self, item: tasks.Item, chat: tuple[dict[str, str], ...] = ()) -> tasks.Item:
        """An agent's episode: its prompt is the template's opening; ``meta["source"]`` the item the agent is given,
        ``meta["messages"]`` its chat as a plain prompt would open (``chat``: a dataset row's turns)."""
        opening = list(chat) or [*self.system, {"role": "user", "content": item.prompt}]
        return tasks.Item(task=item.task, index=item.index, prompt=self.opening_text, answer=item.answer,
                          meta={**item.meta, "source": item, "messages": opening})  # fmt: skip

    def _row_source(self, row: int) -> tasks.Item:
        """Row ``row`` as an environment's item: its last user turn as the prompt, and its answer."""
        turns = self.rows[row].messages
        prompt = next((t["content"] for t in reversed(turns) if t["role"] == "user"), "")
        return tasks.Item(task="dataset", index=row, prompt=prompt, answer=self.rows[row].answer, meta={"row": row})

    def _generated(self, group: int) -> tasks.Item:
        item = self.task.item(group)
        if self.env is not None:
            return self._episode(item)
        if self.agent is not None:
            return self._agent_item(item)
        text = self.renderer.render((*self.system, {"role": "user", "content": item.prompt}), f"item {group}")
        return item if text == item.prompt else tasks.Item(task=item.task, index=item.index, prompt=text,
                                                           answer=item.answer, meta=item.meta)  # fmt: skip

    def _from_dataset(self, group: int) -> tasks.Item:
        assert self.epochs is not None
        item = self.row_item(self.epochs.row(group))
        item.meta["epoch"] = self.epochs.epoch_of(group)
        return item

    def row_item(self, row: int) -> tasks.Item:
        """Row ``row`` of the dataset as an item, outside any epoch order (evaluation reads rows in file order)."""
        if self.env is not None:
            return self._episode(self._row_source(row))
        if self.agent is not None:
            return self._agent_item(self._row_source(row), self.rows[row].messages)
        return tasks.Item(task="dataset", index=row, prompt=self.texts[row], answer=self.rows[row].answer,
                          meta={"row": row})  # fmt: skip

    def prompt_ids(self, group: int) -> np.ndarray:
        return np.array(self.encode(self.item(group).prompt), dtype=np.int32)

    def encode(self, text: str) -> list[int]:
        """A prompt's token ids. Rendered with the chat template, the text already holds every special token the
        model expects (its BOS among them): the tokenizer adds none, as transformers' ``apply_chat_template``
        and vLLM's chat path do not; plain text gets the tokenizer's own (a BOS where it adds one)."""
        return self.tokenizer.encode(text, add_special_tokens=not self.section.chat_template).ids

    def score(self, group: int, tokens: list[int]) -> rewards.Scored:
        return self._score(self.item(group), tokens)

    def score_many(self, pairs: list[tuple[int, list[int]]]) -> list[rewards.Scored]:
        """``score`` of every (group, tokens), in order, all submitted at once: a reward service scores them in
        shared batches (``rewards.score_many``); any other reward, one by one as ``score`` does."""
        if self.reward is None:
            raise ConfigError("an environment's task scores episodes, not completions (task.reward is unset)")
        texts = [(self.tokenizer.decode(list(tokens), skip_special_tokens=True), self.item(group))
                 for group, tokens in pairs]  # fmt: skip
        return rewards.score_many(self.reward, texts, timeout_s=self.timeout_s)

    def score_row(self, row: int, tokens: list[int]) -> rewards.Scored:
        """A completion of dataset row ``row`` (held-out evaluation reads rows in file order, outside epochs)."""
        return self._score(self.row_item(row), tokens)

    def _score(self, item: tasks.Item, tokens: list[int]) -> rewards.Scored:
        if self.reward is None:
            raise ConfigError("an environment's task scores episodes, not completions (task.reward is unset)")
        text = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        return rewards.score(self.reward, text, item, timeout_s=self.timeout_s)


def resolve_agent(spec: str) -> Callable[..., Any]:
    """The agent function of ``task.agent``: an ``async def agent(row, client)``; anything else is a ConfigError."""
    import inspect

    from dora.config import resolve_callable

    fn = resolve_callable(spec, "task.agent")
    if not inspect.iscoroutinefunction(fn):
        raise ConfigError(f"task.agent = {spec!r} must be an async function: async def agent(row, client)")
    return fn


def stop_ids(task: TaskRun, texts: tuple[str, ...]) -> list[int]:
    """The token ids of ``texts`` (task.turn_end); a text that is not one token of the vocabulary is a
    ConfigError. No texts: the chat template's end of turn (``dora.hf.folder``), if it writes one."""
    if not texts:
        from dora.hf.folder import template_turn_end

        end = template_turn_end(pathlib.Path(task.renderer.model_dir))
        return [] if end is None else [end]
    out = []
    for text in texts:
        token = task.tokenizer.token_to_id(text)
        if token is None:
            raise ConfigError(f"task.turn_end {text!r} is not a token of the model's vocabulary")
        out.append(token)
    return out


def prompt_source(cfg: RunConfig) -> tuple[Callable[[int], np.ndarray], dict[str, Any]]:
    """The broker's prompts for a run (the task's, or synthetic token arrays for the sim engine) and what the
    task is (``TaskRun.about``). A group's prompt depends on its id alone, so the latest are kept: a train batch
    asks again for the prompts of the groups it holds."""
    if cfg.task.name == "synthetic":
        from dora.tasks.synthetic import prompt_ids

        workload = Workload(cfg.workload, cfg.run.seed)
        return functools.lru_cache(maxsize=8192)(lambda g: prompt_ids(workload, g)), {"task": "synthetic"}
    t = cfg.task
    if not t.tokenizer:
        raise ConfigError(f"task {t.name!r} needs task.tokenizer (the model folder with tokenizer.json)")
    run = TaskRun(t, t.tokenizer)
    return functools.lru_cache(maxsize=8192)(run.prompt_ids), run.about


def eval_task(cfg: RunConfig, tokenizer_dir: str) -> TaskRun:
    """The held-out rows as a task: [eval]'s dataset in [task]'s layout, with [task]'s template and reward (no
    prompt is filtered out)."""
    if cfg.eval.dataset is None:
        raise ConfigError("no held-out rows: set eval.dataset (or pass --dataset)")
    section = dataclasses.replace(cfg.task, name="dataset", dataset=cfg.eval.dataset, split=cfg.eval.split,
                                  max_prompt_tokens=None)  # fmt: skip
    return TaskRun(section, tokenizer_dir)
