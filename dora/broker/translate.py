"""Between the wire's words and the core's: finished samples in as core events, core actions out as messages.

Pure functions, no sockets: the actor calls them and sends what they return. A prompt's token ids and
a sample's packed arrays are the payloads the core never looks at; they are attached here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import numpy as np

from dora.config.run import LiveRun
from dora.core import events as ev
from dora.ids import WorkerId
from dora.wire import codec, packed
from dora.wire import messages as m

Prompts = Callable[[int], np.ndarray]
"""group id -> the prompt's token ids."""


def samples_event(worker: WorkerId, msg: m.SamplesFinished, headers: Sequence[m.SampleHeader]) -> ev.ResultsReported:
    """One core event for finished samples (``headers`` of ``msg``): the headers themselves, no event per sample.
    Each sample's payload is its header and the message that carries its packed arrays, which the broker forwards
    to the learner unread."""
    return ev.ResultsReported(worker_id=worker, samples=headers, payloads=[(x, msg) for x in headers])


def result_acks(msgs: Sequence[m.SampleHeader], epoch: int, actions: Sequence[ev.Action]) -> tuple[m.ResultAck, ...]:
    """The answer to each sample of a message, in order: refused if it is of an older broker epoch (never fed
    to the core) or if the core refused it among ``actions``; a copy later in the message is the one refused."""
    if all(x.broker_epoch == epoch for x in msgs) and not any(isinstance(a, ev.Refused) for a in actions):
        return tuple(m.ResultAck(group_id=x.group_id, attempt=x.attempt, index=x.index, accepted=True) for x in msgs)
    refused: dict[tuple[int, int, int], list[str]] = {}
    for a in actions:
        if isinstance(a, ev.Refused) and a.index is not None and a.group_id is not None and a.attempt is not None:
            refused.setdefault((a.group_id, a.attempt, a.index), []).append(a.reason)
    left = Counter((x.group_id, x.attempt, x.index) for x in msgs if x.broker_epoch == epoch)
    acks = []
    for x in msgs:
        key = (x.group_id, x.attempt, x.index)
        if x.broker_epoch != epoch:
            reason: str | None = "old broker epoch"
        else:
            left[key] -= 1
            reasons = refused.get(key, [])
            reason = reasons[len(reasons) - 1 - left[key]] if left[key] < len(reasons) else None
        acks.append(m.ResultAck(group_id=x.group_id, attempt=x.attempt, index=x.index, accepted=reason is None,
                                reason=reason or ""))  # fmt: skip
    return tuple(acks)


def all_accepted(headers: Sequence[m.SampleHeader]) -> list[Any]:
    """The frames of ``ResultAcks`` accepting every sample of ``headers``, in order: the bytes of
    ``codec.encode(m.ResultAcks(acks=tuple(m.ResultAck(..., accepted=True) ...)))`` without building a dataclass
    per sample (the answer to nearly every message the broker receives)."""
    acks = [{"group_id": x.group_id, "attempt": x.attempt, "index": x.index, "accepted": True, "reason": ""}
            for x in headers]  # fmt: skip
    return codec.encode_plain(m.ResultAcks, {"acks": acks})


class Sampling(TypedDict):
    max_tokens: int
    temperature: float
    top_p: float
    seed: int


def sampling(run: LiveRun, attempt: int) -> Sampling:
    """How a leased group's samples are drawn, the same for its Generate and for a MigrateIn that continues it: the
    run's token limit, temperature and top_p, and a seed of the run's and the attempt's."""
    return Sampling(max_tokens=run.max_tokens, temperature=run.temperature, top_p=run.top_p,
                    seed=(run.seed << 32) ^ attempt)  # fmt: skip


def generate(a: ev.Lease, run: LiveRun, prompts: Prompts, epoch: int, seq: int = 0) -> m.Generate:
    return m.Generate(group_id=a.group_id, attempt=a.attempt, version=a.version, prompt_ids=prompts(a.group_id),
                      n_samples=a.n_samples, broker_epoch=epoch, seq=seq, **sampling(run, a.attempt))  # fmt: skip


def migrate_in(a: ev.ImportGroup, run: LiveRun, prompts: Prompts) -> m.MigrateIn:
    """The target's command: the group's running requests (token prefixes) to continue on the same version."""
    return m.MigrateIn(group_id=a.group_id, attempt=a.attempt, version=a.version, source=a.source,
                       prompt_ids=prompts(a.group_id), requests=a.state, **sampling(run, a.attempt))  # fmt: skip


def train_batch(batch: ev.DeliverBatch, prompts: Prompts) -> m.TrainBatch:
    """The learner's batch: each group's prompt, its samples' headers, and their payloads as the workers sent them."""
    groups = [(g.group_id, g.version, prompts(g.group_id), [s.payload for s in g.samples]) for g in batch.groups]
    return packed.batch_message(batch.step, groups, redelivery=batch.redelivery)
