"""Finished samples and train batches on the wire: small headers beside packed payload frames.

A worker packs what its engine finished (``pack_samples``): the samples' token ids, log-probs and loss masks
are laid one after the other into one array per kind (int32, float32, uint8), and each sample's header says
where its tokens lie and carries an xxh3-64 checksum of its bytes. The codec sends each packed array as one
raw frame and receives it as one zero-copy view.

The broker decodes the headers only: it decides on them and keeps the received message as the sample's
payload. A train batch (``batch_message``) forwards those messages' arrays as its sources, unread and
uncopied, with each group's headers saying which source holds each sample.

The learner (``unpack_batch``) checks what the broker skipped: each span lies in its source (the message's
own validation), dtypes, and every sample's checksum. A corrupt batch is refused with the group named.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import xxhash

from dora.ids import AttemptId, GroupId
from dora.samples import Batch, FinishedSample, TrainGroup, TrainSample
from dora.wire import messages as m

TOKEN = m.PACKED_DTYPES["token_ids"]
LOGPROB = m.PACKED_DTYPES["logprobs"]
MASK = m.PACKED_DTYPES["loss_mask"]


class CorruptBatch(ValueError):
    """A train batch whose payload does not match its headers (a checksum, a span): never trained on."""

    def __init__(self, step: int, group_id: int, index: int, problem: str) -> None:
        super().__init__(f"batch {step}: group {group_id} sample {index}: {problem}")
        self.step, self.group_id, self.index = step, group_id, index


def checksum(token_ids: np.ndarray, logprobs: np.ndarray, loss_mask: np.ndarray | None) -> int:
    """xxh3-64 of a sample's packed bytes: token ids, then log-probs, then the loss mask when it has one."""
    h = xxhash.xxh3_64(token_ids.data)
    h.update(logprobs.data)
    if loss_mask is not None:
        h.update(loss_mask.data)
    return h.intdigest()


def _as(arr: np.ndarray, dtype: np.dtype[Any], what: str) -> np.ndarray:
    if arr.dtype == dtype:
        return arr.ravel()
    if dtype.kind == "i" and arr.size and (arr.min() < np.iinfo(dtype).min or arr.max() > np.iinfo(dtype).max):
        raise ValueError(f"{what} do not fit in {dtype}")
    return arr.astype(dtype).ravel()


def pack_samples(samples: Sequence[FinishedSample]) -> m.SamplesFinished:
    """One message for finished samples (at least one): headers, and one packed array per kind."""
    ids = [_as(s.token_ids, TOKEN, "token ids") for s in samples]
    lps = [_as(s.logprobs, LOGPROB, "log-probs") for s in samples]
    masked = [s.loss_mask is not None for s in samples]
    token_ids = np.concatenate(ids) if ids else np.zeros(0, TOKEN)
    logprobs = np.concatenate(lps) if lps else np.zeros(0, LOGPROB)
    loss_mask = None
    if any(masked):
        parts = [_as(s.loss_mask, MASK, "loss mask") if s.loss_mask is not None else np.ones(len(a), MASK)
                 for s, a in zip(samples, ids, strict=True)]  # fmt: skip
        loss_mask = np.concatenate(parts)
    headers, offset = [], 0
    for s, a, lp, is_masked in zip(samples, ids, lps, masked, strict=True):
        n = len(a)
        mask = loss_mask[offset : offset + n] if is_masked and loss_mask is not None else None
        headers.append(header(s, offset=offset, checksum=checksum(a, lp, mask)))
        offset += n
    return m.SamplesFinished(samples=tuple(headers), token_ids=token_ids, logprobs=logprobs, loss_mask=loss_mask)


def header(s: FinishedSample, *, offset: int, checksum: int) -> m.SampleHeader:
    return m.SampleHeader(
        group_id=s.group_id, attempt=s.attempt, index=s.index,
        segments=tuple((int(v), int(n)) for v, n in s.segments.tolist()), reward=s.reward, finish=s.finish,
        offset=offset, tokens=len(s.token_ids), checksum=checksum, masked=s.loss_mask is not None,
        turns=None if s.turns is None else tuple((int(a), int(b), int(v)) for a, b, v in s.turns.tolist()),
        gen_time_s=s.gen_time_s, broker_epoch=s.broker_epoch, reward_components=s.reward_components,
        reward_error=s.reward_error,
    )  # fmt: skip


def unpack_samples(msg: m.SamplesFinished) -> tuple[FinishedSample, ...]:
    """The samples of a message, their arrays views on its packed ones (tests and tools; the broker never does)."""
    out = []
    for h in msg.samples:
        span = slice(h.offset, h.offset + h.tokens)
        mask = msg.loss_mask[span] if h.masked and msg.loss_mask is not None else None
        out.append(FinishedSample(
            group_id=h.group_id, attempt=h.attempt, index=h.index, segments=_rows(h.segments, 2),
            token_ids=msg.token_ids[span], logprobs=msg.logprobs[span], reward=h.reward, finish=h.finish,
            gen_time_s=h.gen_time_s, broker_epoch=h.broker_epoch, reward_components=h.reward_components,
            reward_error=h.reward_error, loss_mask=mask,
            turns=None if h.turns is None else _rows(h.turns, 3),
        ))  # fmt: skip
    return tuple(out)


def _rows(rows: tuple[tuple[int, ...], ...], width: int) -> np.ndarray:
    return np.array(rows, dtype=np.int32).reshape(-1, width)


Carried = tuple[m.SampleHeader, m.SamplesFinished]
"""A sample as the broker holds it: its header and the message whose packed arrays hold its payload."""


def batch_message(
    step: int, groups: Sequence[tuple[GroupId, int, np.ndarray, Sequence[Carried]]], *, redelivery: bool = False
) -> m.TrainBatch:
    """The learner's batch from ``(group_id, version, prompt_ids, samples)``: the samples' source messages'
    packed arrays are forwarded as they are (each source once), the prompts packed into one array."""
    index: dict[int, int] = {}
    sources: list[m.SamplesFinished] = []
    out, prompts, offset = [], [], 0
    for group_id, version, prompt, samples in groups:
        refs = []
        for _, msg in samples:
            k = index.get(id(msg))
            if k is None:
                k = index[id(msg)] = len(sources)
                sources.append(msg)
            refs.append(k)
        prompt = _as(np.asarray(prompt), TOKEN, "prompt token ids")
        prompts.append(prompt)
        out.append(m.BatchGroup(group_id=group_id, version=version, prompt_offset=offset, prompt_tokens=len(prompt),
                                samples=tuple(h for h, _ in samples), sources=tuple(refs)))  # fmt: skip
        offset += len(prompt)
    return m.TrainBatch(
        step=step, groups=tuple(out), prompt_ids=np.concatenate(prompts) if prompts else np.zeros(0, TOKEN),
        token_ids=tuple(s.token_ids for s in sources), logprobs=tuple(s.logprobs for s in sources),
        loss_mask=tuple(s.loss_mask for s in sources), redelivery=redelivery,
    )  # fmt: skip


def pack_batch(batch: Batch) -> m.TrainBatch:
    """A learner's batch packed for the wire (tests, and the learner's ranks broadcasting what rank 0 received)."""
    groups = []
    for g in batch.groups:
        msg = pack_samples([
            FinishedSample(group_id=g.group_id, attempt=AttemptId(0), index=s.index,
                           segments=s.segments if s.segments is not None else np.zeros((0, 2), np.int32),
                           token_ids=s.token_ids, logprobs=s.logprobs, reward=s.reward, finish=s.finish,
                           loss_mask=s.loss_mask, turns=s.turns)
            for s in g.samples
        ])  # fmt: skip
        groups.append((g.group_id, g.version, g.prompt_ids, [(h, msg) for h in msg.samples]))
    return batch_message(batch.step, groups, redelivery=batch.redelivery)


def unpack_batch(msg: m.TrainBatch) -> Batch:
    """The learner's batch: every sample's arrays as views on the received frames, each checked against its
    header's checksum. Raises ``CorruptBatch`` naming the first group that does not match."""
    groups = []
    for g in msg.groups:
        samples = []
        for h, k in zip(g.samples, g.sources, strict=True):
            span = slice(h.offset, h.offset + h.tokens)
            ids, lps = msg.token_ids[k][span], msg.logprobs[k][span]
            source = msg.loss_mask[k]
            mask = source[span] if h.masked and source is not None else None
            if checksum(ids, lps, mask) != h.checksum:
                raise CorruptBatch(msg.step, g.group_id, h.index, "its payload does not match its checksum")
            samples.append(TrainSample(
                index=h.index, token_ids=ids, logprobs=lps, reward=h.reward, finish=h.finish,
                segments=_rows(h.segments, 2), loss_mask=mask, turns=None if h.turns is None else _rows(h.turns, 3),
            ))  # fmt: skip
        prompt = msg.prompt_ids[g.prompt_offset : g.prompt_offset + g.prompt_tokens]
        groups.append(TrainGroup(group_id=g.group_id, version=g.version, prompt_ids=prompt, samples=tuple(samples)))
    return Batch(step=msg.step, groups=tuple(groups), redelivery=msg.redelivery)
