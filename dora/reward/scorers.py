"""The reward model and the LLM judge, loaded once and run on batches of reward service requests (torch).

- **The reward model** (task.reward_model): ``AutoModelForSequenceClassification`` with one label. It scores the
  request's prompt and completion as one text, the chat as the policy saw it (the prompt arrives rendered), with
  the reward model's own tokenizer; its logit is the component ``model``. A long text keeps its end (truncated on
  the left to the model's length), where the completion is.
- **The judge** (task.reward_judge): a causal LM answering task.judge_template, filled per sample
  (``dora.reward.judge``) and put in the judge's chat template as a user turn when it has one, greedily, with at
  most task.judge_max_tokens tokens; the first number of its answer, scaled, is the component ``judge``. An answer
  without a number is the sample's error, so the worker scores it 0 with that reason. It is served as the workers'
  engines serve the policy: by one of dora's step engines (``dora.rollout.engines``: the torch engine, or vLLM with
  task.judge_engine = "vllm"), given a batch's prompts at once and stepped until every answer is done, so the
  answers are batched continuously. A prompt longer than the model leaves for the answer loses its start; an answer
  ends at the judge's stop ids (``dora.hf.folder``: its EOS ids and its chat template's end of turn).

Both are loaded from their folders once and never change: the judge's engine holds its folder as version 0 and
loads no other weights, so it scores every step of a run at one version.
"""

from __future__ import annotations

import itertools
import pathlib
from typing import TYPE_CHECKING, Any

import structlog

from dora.config import ConfigError
from dora.config.run import TaskSection
from dora.hf.folder import facts, resolve
from dora.reward.judge import fill, parse_score

if TYPE_CHECKING:
    from dora.rollout.engines.base import StepEngine

log = structlog.get_logger()


def _max_length(tokenizer: Any, positions: int | None, room: int = 0) -> int:
    """The most tokens a text may take: the model's positions (else the tokenizer's limit) less ``room``."""
    limit = positions or min(int(tokenizer.model_max_length), 1 << 20)
    return max(1, int(limit) - room)


def _padded(tokenizer: Any, key: str) -> None:
    """A tokenizer without a pad token pads with its end of text (the attention mask keeps it out)."""
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ConfigError(f"{key}: the tokenizer has neither a pad token nor an end of text to pad with")
        tokenizer.pad_token = tokenizer.eos_token


class RewardModel:
    """A sequence-classification model with one label, scoring prompt + completion texts."""

    def __init__(self, name: str, device: str) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        folder = resolve(name, key="task.reward_model")
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        _padded(self.tokenizer, "task.reward_model")
        self.tokenizer.padding_side, self.tokenizer.truncation_side = "right", "left"
        dtype = torch.float32 if device == "cpu" else "auto"
        self.model = AutoModelForSequenceClassification.from_pretrained(str(folder), dtype=dtype).to(device).eval()
        if self.model.config.num_labels != 1:
            raise ConfigError(f"task.reward_model {name!r} has {self.model.config.num_labels} labels; a reward model "
                              "has one (num_labels = 1: its logit is the reward)")  # fmt: skip
        if self.model.config.pad_token_id is None:  # the model finds each text's last token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.device = device
        self.max_length = _max_length(self.tokenizer, getattr(self.model.config, "max_position_embeddings", None))

    def texts(self, requests: list[dict[str, Any]]) -> list[str]:
        """What is scored: each request's prompt (rendered, as the policy saw it) followed by its completion."""
        return [str(r.get("prompt") or "") + str(r["completion"]) for r in requests]

    def score(self, requests: list[dict[str, Any]]) -> list[float]:
        import torch

        batch = self.tokenizer(self.texts(requests), padding=True, truncation=True, max_length=self.max_length,
                               return_tensors="pt").to(self.device)  # fmt: skip
        with torch.inference_mode():
            logits = self.model(**batch).logits
        return [float(x) for x in logits[:, 0].float().cpu()]


class Judge:
    """A causal LM answering the judge template greedily on one of dora's step engines, at version 0 for good."""

    def __init__(self, task: TaskSection) -> None:
        from transformers import AutoTokenizer

        assert task.reward_judge is not None
        folder = resolve(task.reward_judge, key="task.reward_judge")
        self.tokenizer = AutoTokenizer.from_pretrained(str(folder))
        self.tokenizer.truncation_side = "left"
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        found = facts(folder, chat_template=self.chat)
        self.stops = found.stop_ids
        """Its EOS ids (config and generation config) and its chat template's end of turn."""
        self.template, self.max_tokens = task.judge_template, task.judge_max_tokens
        self.max_score = task.judge_max_score
        self.max_length = _max_length(self.tokenizer, found.max_positions, room=self.max_tokens)
        self.engine = judge_engine(task, folder)
        self._groups = itertools.count()
        """Each sample's own group id in the engine, never reused."""

    def prompt(self, request: dict[str, Any]) -> str:
        """The judge's prompt for one sample: the template filled, in the judge's chat template if it has one."""
        text = fill(self.template, request)
        if not self.chat:
            return text
        rendered: str = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                           add_generation_prompt=True)  # fmt: skip
        return rendered

    def encode(self, request: dict[str, Any]) -> list[int]:
        """The prompt's token ids, its start cut off when it is longer than the model leaves for the answer."""
        ids: list[int] = self.tokenizer(self.prompt(request), truncation=True, max_length=self.max_length,
                                        add_special_tokens=not self.chat)["input_ids"]  # fmt: skip
        return ids

    def answers(self, requests: list[dict[str, Any]]) -> list[str]:
        """The judge's greedy answers, decoded without special tokens: the batch submitted whole, the engine stepped
        until every answer is done (it batches them continuously)."""
        groups = [next(self._groups) for _ in requests]
        done = complete(self.engine, groups, [self.encode(r) for r in requests], max_tokens=self.max_tokens,
                        stops=self.stops)  # fmt: skip
        return [str(self.tokenizer.decode(tokens, skip_special_tokens=True)) for tokens in done]

    def score(self, requests: list[dict[str, Any]]) -> list[tuple[float | None, str]]:
        return [parse_score(a, self.max_score) for a in self.answers(requests)]


def judge_engine(task: TaskSection, folder: pathlib.Path) -> StepEngine[Any]:
    """The judge's engine (task.judge_engine) on its folder, loaded as version 0 and never given other weights, with
    room for a whole batch of the server's (task.reward_server_batch_size) at once. A model the engine cannot run
    is a ConfigError naming task.reward_judge."""
    from dora.rollout.engines.base import EngineError

    slots = task.reward_server_batch_size
    try:
        if task.judge_engine == "vllm":
            try:
                from dora.rollout.engines.vllm_engine import VllmEngine
            except ImportError:
                raise ConfigError("task.judge_engine = 'vllm' needs the vllm extra: pip install -e '.[vllm]'") from None
            return VllmEngine(folder, max_slots=slots, kv_cache_bytes=None, dtype="auto", enforce_eager="auto",
                              version=0)  # fmt: skip
        from dora.rollout.engines.torch.engine import TorchEngine

        dtype = "float32" if task.reward_device == "cpu" else "bfloat16"
        return TorchEngine(folder, max_slots=slots, device=task.reward_device, dtype=dtype, version=0)
    except EngineError as e:
        raise ConfigError(f"task.reward_judge = {task.reward_judge!r}: {e}") from None


def complete(engine: StepEngine[Any], groups: list[int], prompts: list[list[int]], *, max_tokens: int,
             stops: frozenset[int]) -> list[list[int]]:  # fmt: skip
    """Each prompt's greedy completion (its token ids), one sample of its own group each, submitted together and
    stepped until all are done. On a failure, what is left of them leaves the engine."""
    for group, prompt in zip(groups, prompts, strict=True):
        engine.submit(group_id=group, attempt=0, prompt=prompt, n=1, max_tokens=max_tokens, temperature=0.0,
                      stops=stops)  # fmt: skip
    done: dict[int, list[int]] = {}
    try:
        while len(done) < len(groups):
            if not len(engine):
                raise RuntimeError(f"the judge's engine holds no request, {len(groups) - len(done)} answers short")
            for seq in engine.step():
                done[seq.group_id] = list(seq.tokens)
    finally:
        for group in groups:
            if group not in done:
                engine.cancel(group, 0)
    return [done[g] for g in groups]


class Scorers:
    """The task's reward model and judge (either may be absent), as one ``Batcher`` scorer."""

    def __init__(self, task: TaskSection) -> None:
        self.model = RewardModel(task.reward_model, task.reward_device) if task.reward_model else None
        self.judge = Judge(task) if task.reward_judge else None
        log.info("reward_scorers_loaded", model=task.reward_model, judge=task.reward_judge, device=task.reward_device)

    def __call__(self, requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        components: list[dict[str, float]] = [{} for _ in requests]
        errors = [""] * len(requests)
        if self.model is not None:
            for c, logit in zip(components, self.model.score(requests), strict=True):
                c["model"] = logit
        if self.judge is not None:
            for i, (value, reason) in enumerate(self.judge.score(requests)):
                if value is None:
                    errors[i] = reason
                else:
                    components[i]["judge"] = value
        return [{"error": e} if e else {"components": c} for c, e in zip(components, errors, strict=True)]
