"""The learner's own check of every batch it is handed, before any gradient: C1, C2 and C3 per trajectory.

The broker's core decides every batch so that these hold; the learner does not trust that and checks
again, on what arrived over the wire: exactly ``train_groups`` distinct whole groups of ``group_size``
samples, none trained before (C2), each trajectory's staleness ``u - v`` within K (C3), and one policy
version per trajectory unless the mode swaps weights under running requests (C1). A failure raises
InvariantBroken and the learner stops (exit 3) before training on it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from dora.samples import Batch, TrainGroup, TrainSample


class InvariantBroken(RuntimeError):
    pass


def check_batch(
    batch: Batch, *, step: int, groups: int, group_size: int, k: int, mixed_ok: bool,
    trained: set[int] | frozenset[int] = frozenset(),
) -> dict[str, Any]:  # fmt: skip
    """Raise InvariantBroken unless the batch is exact, whole, new (no group in ``trained``), fresh enough and
    (where promised) single-version."""
    if batch.step != step:
        raise InvariantBroken(f"asked for batch {step}, got {batch.step}")
    if len(batch.groups) != groups or len({g.group_id for g in batch.groups}) != groups:
        raise InvariantBroken(f"batch {step}: {len(batch.groups)} groups (distinct ones needed: {groups})")
    again = sorted(trained.intersection(g.group_id for g in batch.groups))
    if again:
        raise InvariantBroken(f"C2: batch {step} holds groups trained before: {again[:8]}")
    staleness: dict[int, int] = {}
    mixed = tokens = turns = 0
    for g in batch.groups:
        lag = step - g.version
        if not 0 <= lag <= k:
            raise InvariantBroken(f"C3: group {g.group_id} of version {g.version} at step {step} (K = {k})")
        if len(g.samples) != group_size or sorted(s.index for s in g.samples) != list(range(group_size)):
            raise InvariantBroken(f"C2: group {g.group_id} is not whole ({len(g.samples)} of {group_size} samples)")
        staleness[lag] = staleness.get(lag, 0) + len(g.samples)
        for s in g.samples:
            tokens += len(s.token_ids)
            versions = set() if s.segments is None else {int(v) for v, n in s.segments if n > 0}
            if versions - {g.version}:
                if not mixed_ok:
                    raise InvariantBroken(f"C1: group {g.group_id} sample {s.index} has versions {sorted(versions)}")
                mixed += 1
            if len(s.token_ids) != len(s.logprobs):
                raise InvariantBroken(f"group {g.group_id} sample {s.index}: tokens and log-probs differ in length")
            if s.turns is not None:
                turns += len(s.turns)
                mixed += check_turns(s, g, mixed_ok=mixed_ok) and not versions - {g.version}
    return {"staleness": staleness, "mixed_version_trajectories": mixed, "tokens": tokens, "turns": turns}


def check_turns(s: TrainSample, g: TrainGroup, *, mixed_ok: bool) -> bool:
    """C1 per turn of an episode: its turns are ordered spans of the trajectory, every model token (loss mask 1)
    lies in one and nothing else does, and each turn was sampled by the group's version. Returns whether some
    turn was not (allowed only where ``mixed_ok``); raises InvariantBroken on any other failure."""
    assert s.turns is not None, "an episode's sample"
    where = f"group {g.group_id} sample {s.index}"
    model = np.ones(len(s.token_ids), bool) if s.loss_mask is None else s.loss_mask.astype(bool)
    inside = np.zeros(len(s.token_ids), bool)
    end, other = 0, False
    for start, stop, version in s.turns.tolist():
        if not end <= start < stop <= len(s.token_ids):
            n = len(s.token_ids)
            raise InvariantBroken(f"{where}: turn [{start}, {stop}) out of order or out of its {n} tokens")
        inside[start:stop], end = True, stop
        if version != g.version:
            if not mixed_ok:
                raise InvariantBroken(f"C1: {where} has a turn [{start}, {stop}) of version {version}, not {g.version}")
            other = True
    if (inside != model).any():
        at = int(np.argmax(inside != model))
        raise InvariantBroken(f"{where}: the loss mask and the turns disagree at token {at}")
    return other
