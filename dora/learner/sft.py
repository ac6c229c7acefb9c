"""Supervised warm start (`dora sft`): fine-tune a model folder on the task dataset's (prompt, answer) rows.

RL from a model that never answers right gets no signal, so `dora sft` first teaches the model the answer
format (and a little of the task) on the same dataset config RL uses:

1. The task is loaded with ``TaskRun`` (every row read, checked and rendered), so each prompt is exactly
   the text RL sends, encoded with the same ``tokenizer.json`` ids the broker uses. Rows filtered out by
   ``task.max_prompt_tokens`` are left out here too.
2. Each row is its prompt ids, then its answer encoded without special tokens, then EOS, cut to
   ``sft.max_answer_tokens``. Labels are -100 on the prompt: the loss is the mean negative log-likelihood
   of the batch's answer tokens only.
3. AdamW over ``sft.epochs`` shuffled passes (right-padded batches of ``sft.batch_size``; a linear warm-up,
   then a cosine to a tenth of ``sft.lr``; gradients clipped to norm 1), one progress line per epoch.
4. The result is written atomically (a temporary sibling folder, then a rename) as an ordinary HF folder:
   ``save_pretrained`` plus the start folder's tokenizer files, so it loads exactly like the start folder.
5. On ``sft.device`` (a GPU: bf16 compute, fp32 weights), over ``sft.ranks`` ranks sharded with FSDP2, each on its
   share of every batch: the steps, the loss and the folder are the one-rank run's (``dora.learner.sft_ranks``).
6. ``sft.lora``: adapters shaped as ``[learner.lora]`` train on the frozen start model (``dora.hf.lora``), and are
   merged into its weights before the folder is written (``merged``): the folder is a full model either way.
7. Episodes (``sft.trace_field``): an environment's recorded turns (``encode_episodes``), or an agent's recorded
   conversations in OpenAI form (``encode_conversations``), each encoded as a worker records the episode: the
   assistant turns trained on, everything else context.
"""

from __future__ import annotations

import math
import os
import pathlib
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dora.actor.cluster import ClusterInfo
from dora.config import ConfigError
from dora.config.models import LoraSection, SftSection
from dora.config.run import RunConfig
from dora.hf import lora as adapters
from dora.learner import sft_ranks
from dora.learner.setup import adapt, load_model, optimizer, trainable
from dora.learner.sft_ranks import ONE_CPU, Placement
from dora.tasks.prompts import TaskRun

IGNORE = -100
"""The label of a token outside the loss (the prompt, and padding)."""
WARMUP_STEPS = 10
"""Optimizer steps of linear learning-rate warm-up (capped at a tenth of all steps)."""
MAX_GRAD_NORM = 1.0
WEIGHTS = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
"""Files of the start folder not copied into the result (its weights: the result has its own)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Example:
    """One training row: prompt ids then answer ids; the loss covers ``ids[prompt_len:]``."""

    row: int
    ids: tuple[int, ...]
    prompt_len: int
    trained: tuple[bool, ...] | None = None
    """Per token after the prompt, whether the loss covers it (an episode: the assistant's turns, not the
    environment's); None: all of them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Examples:
    items: list[Example]
    truncated: int
    """Rows whose answer (+ EOS) was longer than sft.max_answer_tokens and was cut."""
    answer_tokens: int


def start_folder(cfg: RunConfig) -> pathlib.Path:
    """The folder `dora sft` starts from (``"dora:tiny"``'s, a folder, or a hub id's cached snapshot), checked."""
    from dora.hf.checks import check_model
    from dora.hf.preflight import model_folder, sft_start

    name, key = sft_start(cfg)
    folder = model_folder(name, key=key)
    check_model(folder, key=key, chat_template=cfg.task.chat_template)
    return folder


def answer_end(folder: pathlib.Path, chat_template: bool) -> int:
    """The token an answer ends with: with the chat template, the end of turn it writes after an assistant's
    content (what the model must learn to emit, and what the engines stop on); else the first EOS id."""
    from dora.hf.folder import facts

    found = facts(folder, chat_template=chat_template)
    end = found.answer_end if chat_template else (found.eos_ids[0] if found.eos_ids else None)
    if end is None:
        raise ConfigError(f"sft.model: {folder} names no eos_token_id (config.json or generation_config.json) and its "
                          "chat template no end of turn: no token ends an answer")  # fmt: skip
    return end


def encode(run: TaskRun, eos: int, max_answer_tokens: int) -> Examples:
    """The task's kept rows as examples: ``run.encode(run.texts[i])`` + answer ids + EOS."""
    if run.epochs is None:
        raise ConfigError("dora sft needs a dataset (task.dataset): the built-in tasks have no answers to imitate")
    items, truncated, answer_tokens = [], 0, 0
    for i in run.epochs.kept.tolist():
        prompt = run.encode(run.texts[i])
        answer = [*run.tokenizer.encode(run.rows[i].answer, add_special_tokens=False).ids, eos]
        if len(answer) > max_answer_tokens:
            truncated += 1
            answer = answer[:max_answer_tokens]
        answer_tokens += len(answer)
        items.append(Example(row=i, ids=(*prompt, *answer), prompt_len=len(prompt)))
    return Examples(items=items, truncated=truncated, answer_tokens=answer_tokens)


def collate(batch: Sequence[Example], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input ids, labels), both [B, T], right-padded; labels are -100 on prompts and padding."""
    width = max(len(e.ids) for e in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    labels = torch.full((len(batch), width), IGNORE, dtype=torch.long)
    for b, e in enumerate(batch):
        ids[b, : len(e.ids)] = torch.tensor(e.ids)
        labels[b, e.prompt_len : len(e.ids)] = ids[b, e.prompt_len : len(e.ids)]
        if e.trained is not None:
            labels[b, e.prompt_len : len(e.ids)][~torch.tensor(e.trained, dtype=torch.bool)] = IGNORE
    return ids, labels


def encode_episodes(run: TaskRun, field: str, max_answer_tokens: int) -> Examples:
    """An environment's task: each kept row's opening (the prompt RL sends), then its recorded episode (column
    ``field``: the chat turns after the opening). Assistant turns are trained on, each with the turn's end token;
    the environment's turns are context, rendered exactly as a worker renders them between turns."""
    from dora.tasks import datasets
    from dora.tasks.templates import observation_text

    assert run.env is not None and run.epochs is not None and run.section.dataset is not None
    stop, said = turn_end(run)
    raw, _ = datasets.read_table(run.section.dataset, run.section.split)
    items, truncated, answer_tokens = [], 0, 0
    for i in run.epochs.kept.tolist():
        trace = raw[i].get(field)
        if (
            not isinstance(trace, list)
            or not trace
            or any(not isinstance(t, dict) or not isinstance(t.get("content"), str) for t in trace)
        ):
            raise ConfigError(f"{run.section.dataset} row {i}: {field!r} must be a list of {{role, content}} turns")
        chat = list(run.row_item(i).meta["messages"])
        ids, trained = list(run.encode(run.texts[i])), list[bool]()
        prompt_len = len(ids)
        for k, turn in enumerate(trace):
            if turn.get("role") != "assistant":
                continue
            if chat[-1]["role"] == "assistant":  # the environment's turns since the last assistant turn
                before = next(j for j in range(k - 1, -1, -1) if trace[j].get("role") == "assistant")
                observation = [dict(t) for t in trace[before + 1 : k]]
                text = observation_text(run.renderer, chat[:-1], observation, said)
                env = run.tokenizer.encode(text, add_special_tokens=False).ids
                ids, trained = ids + env, trained + [False] * len(env)
                chat += observation
            model = [*run.tokenizer.encode(turn["content"], add_special_tokens=False).ids, stop[0]]
            ids, trained = ids + model, trained + [True] * len(model)
            chat.append({"role": "assistant", "content": turn["content"]})
        example, cut = bounded(i, ids, trained, prompt_len, max_answer_tokens)
        truncated += cut
        answer_tokens += sum(example.trained or ())
        items.append(example)
    return Examples(items=items, truncated=truncated, answer_tokens=answer_tokens)


def encode_conversations(run: TaskRun, field: str, max_answer_tokens: int) -> Examples:
    """An agent's task: each kept row's recorded conversation (column ``field``: ``{"tools": [...], "messages":
    [...]}``, the agent's messages from its first request's on, in OpenAI form, ending with its last answer) as an
    agent episode records it. The prompt is the chat template's opening (the group's prompt); the rest of the first
    request, rendered with its tools, is context; each assistant message is trained on as the template writes it
    (content and tool calls) with the turn's end token; the messages between answers (tool results) are context,
    rendered as the worker's endpoint renders a later request's new messages."""
    from dora.tasks import datasets
    from dora.tasks.templates import observation_text

    assert run.agent is not None and run.epochs is not None and run.section.dataset is not None
    stop, said = turn_end(run)
    raw, _ = datasets.read_table(run.section.dataset, run.section.split)
    items, truncated, answer_tokens = [], 0, 0
    for i in run.epochs.kept.tolist():
        where = f"{run.section.dataset} row {i}"
        tools, chat = conversation(raw[i].get(field), f"{where}: {field!r}")
        first = next(k for k, msg in enumerate(chat) if msg["role"] == "assistant")
        ids = run.encode(run.renderer.render(chat[:first], where, tools=tools))
        if ids[: len(run.opening)] != run.opening:
            raise ConfigError(f"{where}: the conversation does not render after the chat template's opening "
                              f"{run.opening_text!r}, the prompt of every agent episode")  # fmt: skip
        prompt_len = len(run.opening)
        trained = [False] * (len(ids) - prompt_len)
        answers = [k for k, msg in enumerate(chat) if msg["role"] == "assistant"]
        for k, after in zip(answers, [*answers[1:], len(chat)], strict=True):
            turn = [*run.encode(assistant_text(run, chat[:k], chat[k], tools, said, where)), stop[0]]
            between = run.encode(observation_text(run.renderer, chat[:k], chat[k + 1 : after], said, tools=tools)
                                 ) if after > k + 1 else []  # fmt: skip
            ids += turn + between
            trained += [True] * len(turn) + [False] * len(between)
        example, cut = bounded(i, ids, trained, prompt_len, max_answer_tokens)
        truncated += cut
        answer_tokens += sum(example.trained or ())
        items.append(example)
    return Examples(items=items, truncated=truncated, answer_tokens=answer_tokens)


def conversation(trace: object, where: str) -> tuple[list[dict[str, Any]] | None, list[dict[str, Any]]]:
    """A recorded agent conversation's tools and messages, checked: messages with roles, an assistant answer after
    the first request's, and an answer last (what follows the last answer is never sampled)."""
    shape = ('must be {"tools": [...], "messages": [...]}: the agent\'s messages from its first request on, ending '
             "with its last answer")  # fmt: skip
    if not isinstance(trace, dict) or not isinstance(trace.get("messages"), list):
        raise ConfigError(f"{where} {shape}")
    chat, tools = trace["messages"], trace.get("tools") or None
    if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
        raise ConfigError(f"{where}: tools must be a list of OpenAI function tools")
    if not all(isinstance(msg, dict) and isinstance(msg.get("role"), str) for msg in chat):
        raise ConfigError(f"{where}: every message needs a role")
    roles = [msg["role"] for msg in chat]
    if not roles or roles[-1] != "assistant" or roles[0] == "assistant":
        raise ConfigError(f"{where} {shape} (roles {roles})")
    return tools, [dict(msg) for msg in chat]


def assistant_text(run: TaskRun, chat: list[dict[str, Any]], message: dict[str, Any],
                   tools: list[dict[str, Any]] | None, said: str, where: str) -> str:  # fmt: skip
    """What the model writes for assistant ``message`` after ``chat``: the chat template's rendering with the message
    less its rendering with the generation prompt (where the model starts), up to the end of turn ``said``."""
    tokenizer = run.renderer.tokenizer
    assert tokenizer is not None  # task.agent needs task.chat_template
    before = run.renderer.render(chat, where, tools=tools)
    try:
        text = tokenizer.apply_chat_template([*chat, message], tools=tools, tokenize=False, add_generation_prompt=False)
    except Exception as e:  # a template is user code, as in Renderer.render
        raise ConfigError(f"{where}: the chat template failed on an answer: {type(e).__name__}: {e}") from None
    if not isinstance(text, str) or not text.startswith(before) or said not in text[len(before) :]:
        raise ConfigError(f"{where}: the chat template does not write an answer after its generation prompt, ended "
                          f"by {said!r}: its assistant turns cannot be imitated")  # fmt: skip
    turn = text[len(before) :]
    return turn[: turn.index(said)]


def bounded(row: int, ids: list[int], trained: list[bool], prompt_len: int, most: int) -> tuple[Example, bool]:
    """A recorded episode's example, cut after its ``most``-th trained token; and whether it was cut."""
    cut = sum(trained) > most
    if cut:
        keep = next(j for j in range(len(trained)) if sum(trained[: j + 1]) == most) + 1
        ids, trained = ids[: prompt_len + keep], trained[:keep]
    return Example(row=row, ids=tuple(ids), prompt_len=prompt_len, trained=tuple(trained)), cut


def turn_end(run: TaskRun) -> tuple[list[int], str]:
    """The token ids that end an assistant turn (task.turn_end, else the template's) and the first one's text."""
    from dora.tasks.prompts import stop_ids

    stop = stop_ids(run, run.section.turn_end)
    if not stop:
        raise ConfigError("sft.trace_field needs task.turn_end: the token that ends an assistant turn")
    return stop, run.tokenizer.decode([stop[0]], skip_special_tokens=False)


def answer_count(e: Example) -> int:
    """The tokens of ``e`` the loss covers (``answer_nll``'s count for it): its trained tokens after the prompt, less
    the first when there is no prompt (nothing predicts it)."""
    trained = e.trained if e.trained is not None else (True,) * (len(e.ids) - e.prompt_len)
    return sum(trained[1:] if e.prompt_len == 0 else trained)


def answer_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The mean negative log-likelihood of the labelled (answer) tokens under ``logits`` [B, T, V] (position t
    predicts token t + 1), and how many there are; positions labelled -100 add nothing, not even gradient."""
    logits, targets = logits[:, :-1].float(), labels[:, 1:]
    count = int((targets != IGNORE).sum())
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                            ignore_index=IGNORE, reduction="sum")  # fmt: skip
    return nll / max(count, 1), count


def answer_loss(model: torch.nn.Module, ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``answer_nll`` of the model on a right-padded batch.

    No attention mask: padding is on the right, so under the causal mask no real token sees a pad, and the
    logits of real tokens are the same as with one (SDPA keeps its fast causal path)."""
    return answer_nll(model(input_ids=ids).logits, labels)


def schedule(lr: float, total_steps: int) -> Callable[[int], float]:
    """Learning rate of step ``s``: linear warm-up, then a cosine from ``lr`` down to ``lr / 10``."""
    warmup = max(1, min(WARMUP_STEPS, total_steps // 10))

    def at(step: int) -> float:
        if step < warmup:
            return lr * (step + 1) / warmup
        done = (step - warmup) / max(1, total_steps - warmup)
        return lr * (0.1 + 0.45 * (1 + math.cos(math.pi * min(done, 1.0))))

    return at


@dataclass(frozen=True, slots=True, kw_only=True)
class EpochReport:
    epoch: int
    loss: float
    """Mean answer-token loss over the epoch."""
    tokens: int
    """Tokens (prompt and answer, no padding) trained on."""
    seconds: float


def train(model: torch.nn.Module, examples: Sequence[Example], sft: SftSection, pad_id: int,
          report: Callable[[EpochReport], None] = lambda r: None,
          where: Placement = ONE_CPU) -> list[EpochReport]:  # fmt: skip
    """``sft.epochs`` passes of AdamW over ``examples`` (each epoch a permutation seeded by (sft.seed, epoch)), the
    model on ``where``'s device (and sharded over its ranks: ``sft_ranks.shard``). Over several ranks every rank
    calls this with the same examples and takes every world-th row of each batch; the step is one rank's."""
    torch.manual_seed(sft.seed)
    model.train()
    params = trainable(model)  # with adapters (sft.lora): those alone
    opt = optimizer(params, lr=sft.lr)
    per_epoch = math.ceil(len(examples) / sft.batch_size)
    lr_at = schedule(sft.lr, per_epoch * sft.epochs)
    step, reports = 0, []
    for epoch in range(sft.epochs):
        started, nll, count, tokens = time.perf_counter(), 0.0, 0, 0
        order = np.random.default_rng([sft.seed, epoch]).permutation(len(examples))
        for start in range(0, len(order), sft.batch_size):
            batch = [examples[i] for i in order[start : start + sft.batch_size]]
            mine = batch[where.rank :: where.world]
            ids, labels = collate(mine or batch[:1], pad_id)  # no row here: one, weighted 0 (FSDP's calls pair up)
            for group in opt.param_groups:
                group["lr"] = lr_at(step)
            opt.zero_grad(set_to_none=True)
            with torch.autocast(where.device.type, dtype=torch.bfloat16, enabled=where.autocast):
                mean, n = answer_loss(model, ids.to(where.device), labels.to(where.device))
            n = n if mine else 0
            whole = n if where.world == 1 else sum(map(answer_count, batch))  # the batch's answer tokens
            # several ranks: this share of the batch's answer-token sum, times the world (FSDP averages over ranks)
            loss = mean if where.world == 1 else mean * (n / max(whole, 1) * where.world)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
            opt.step()
            step += 1
            nll, count, tokens = nll + float(mean.detach()) * n, count + whole, tokens + sum(len(e.ids) for e in batch)
        nll = sft_ranks.total([nll], where)[0]
        reports.append(EpochReport(epoch=epoch, loss=nll / max(count, 1), tokens=tokens,
                                   seconds=time.perf_counter() - started))  # fmt: skip
        report(reports[-1])
    model.eval()
    return reports


def merged(state: dict[str, torch.Tensor], spec: LoraSection) -> dict[str, torch.Tensor]:
    """A full state of a model with adapters (``dora.hf.lora.inject``), its adapters merged into the weights they
    wrap (W + alpha / rank x B A) and its names the model's own again, as the start folder names them."""
    scale = spec.alpha / spec.rank
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if adapters.is_adapter(name):
            continue
        if ".base_layer." not in name:
            out[name] = tensor
            continue
        module, _, leaf = name.partition(".base_layer.")
        if leaf == "weight":
            a, b = state[f"{module}.lora_A.{adapters.NAME}.weight"], state[f"{module}.lora_B.{adapters.NAME}.weight"]
            tensor = tensor + scale * (b.float() @ a.float()).to(tensor.dtype)
        out[f"{module}.{leaf}"] = tensor
    return out


def check_out(out: pathlib.Path) -> None:
    """``out`` may be written: absent, an empty folder, or a model folder (which is replaced)."""
    if out.exists() and not (out.is_dir() and ((out / "config.json").is_file() or not any(out.iterdir()))):
        raise ConfigError(f"sft.out: {out} exists and is not a model folder (not replacing it)")


def write(model: torch.nn.Module, start: pathlib.Path, out: pathlib.Path,
          state: dict[str, torch.Tensor] | None = None) -> pathlib.Path:  # fmt: skip
    """Write the model folder ``out`` atomically: ``save_pretrained`` into a temporary sibling, with the start
    folder's other files (tokenizer, chat template) beside it, then a rename. An existing model folder at
    ``out`` is replaced; anything else there is an error. ``state``: the weights to write (a sharded model's,
    gathered: ``sft_ranks.full_state``), else the model's own."""
    check_out(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        model.save_pretrained(str(tmp), state_dict=state)
        written = {p.name for p in tmp.iterdir()}
        for src in sorted(start.iterdir()):
            if src.is_file() and src.name not in written and not src.name.endswith(WEIGHTS):
                shutil.copy2(src, tmp / src.name)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            out.rename(old)
        try:
            tmp.rename(out)
        except OSError:
            if old.exists():
                old.rename(out)
            raise
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class Plan:
    """What `dora sft` trains on and writes, checked before any model is loaded."""

    start: pathlib.Path
    out: pathlib.Path
    task: TaskRun
    data: Examples


def plan(cfg: RunConfig) -> Plan:
    """The start folder, sft.out and the encoded rows; bad input is a ConfigError (or ValueError). `dora sft`
    checks this before it starts ranks, and every rank makes it again."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per epoch is the progress shown
    sft = cfg.sft
    if not sft.out:
        raise ConfigError("dora sft needs sft.out (the model folder to write)")
    out = pathlib.Path(sft.out)
    start = start_folder(cfg)
    if out.resolve() == start.resolve():
        raise ConfigError(f"sft.out must differ from the folder it starts from ({start})")
    check_out(out)
    task = TaskRun(cfg.task, cfg.task.tokenizer or str(start))
    if task.env is not None or task.agent is not None:
        if not sft.trace_field:
            raise ConfigError(f"dora sft on {'an environment' if task.env else 'an agent'}'s task needs "
                              "sft.trace_field (recorded episodes to imitate)")  # fmt: skip
        encoder = encode_episodes if task.env is not None else encode_conversations
        data = encoder(task, sft.trace_field, sft.max_answer_tokens)
    else:
        data = encode(task, answer_end(start, cfg.task.chat_template), sft.max_answer_tokens)
    return Plan(start=start, out=out, task=task, data=data)


def run(cfg: RunConfig, cluster: ClusterInfo) -> pathlib.Path | None:
    """`dora sft` on this rank: load, train and write; bad input is a ConfigError (or ValueError) before any
    training. Rank 0 writes sft.out and returns it; the other ranks return None."""
    sft, job = cfg.sft, plan(cfg)
    where = sft_ranks.place(sft, cluster)
    try:
        torch.set_num_threads(sft.threads or max(1, (os.cpu_count() or 1) // where.world))
        model = load_model(job.start)
        vocab = model.get_input_embeddings().num_embeddings
        if max(max(e.ids) for e in job.data.items) >= vocab:
            raise ConfigError(f"the tokenizer of {cfg.task.tokenizer or job.start} has ids past the model's {vocab} "
                              "embeddings")  # fmt: skip
        lead, data, about = where.rank == 0, job.data, job.task.about
        if lead:
            print(f"dora sft: {len(data.items)} rows of {about['dataset']} ({about['filtered']} filtered out), "
                  f"{data.answer_tokens} answer tokens, {data.truncated} answers cut at sft.max_answer_tokens = "
                  f"{sft.max_answer_tokens}; {sft.epochs} epochs from {job.start} on {where.describe()}",
                  file=sys.stderr)  # fmt: skip

        def progress(r: EpochReport) -> None:
            if lead:
                print(f"dora sft: epoch {r.epoch + 1}/{sft.epochs}  loss {r.loss:.4f}  "
                      f"{r.tokens / r.seconds:,.0f} tok/s  {r.seconds:.1f} s", file=sys.stderr)  # fmt: skip

        spec = (cfg.learner.lora or LoraSection()) if sft.lora else None
        copies = adapt(model, spec).copies  # named before sharding, as the learner's trainer does
        model = sft_ranks.shard(model, where)
        train(model, data.items, sft, pad_id=0, report=progress, where=where)  # padding is out of the loss: any id
        state = sft_ranks.full_state(model, copies, where)
        if spec is not None and lead:
            state = merged(state if state is not None else model.state_dict(), spec)
        return write(model, job.start, job.out, state=state) if lead else None
    finally:
        sft_ranks.leave(where)
