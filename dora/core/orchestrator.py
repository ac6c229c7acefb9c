"""Orchestrator: re-partitions workers across live versions and plans same-version migrations.

DORA's Algorithm 1 as dora implements it (docs/how-it-works.md#the-orchestrator). Given the pending requests
``R_v`` of each live version (unfinished samples, plus the planned top-up of the newest version):

1. each version gets ``round(W * R_v / sum R)`` workers, at least one if ``R_v > 0``; rounding is
   repaired by largest remainder so the targets add up to ``W``; if there are fewer workers than
   versions with work, the oldest versions (nearest deadlines) get one each;
2. workers only ever move to the newest version (a draining version never gains workers); a version
   above its target releases the workers holding the fewest unfinished requests first;
3. a leaving worker's groups are planned onto the staying workers of the **same** version with free
   slots (C1: identical weights, so the continuation is exact); a worker whose groups do not fit
   stays until the next trigger. Workers that keep the version besides a newer one (multi-version workers,
   ``hosts``) take its groups too: they hold the same weights, so the continuation is as exact.
   Without migration (``core.migrate = false``: agent episodes, whose agent talks to one worker's endpoint)
   a leaving worker keeps its groups: it takes no new ones and moves once they have ended.
4. with ``core.drain_load`` set (dora's addition), a staying worker is packed to at most that many
   unfinished samples, and an older version keeps at least ``ceil(R_v / drain_load)`` of its workers.
   Its samples are due before any newer version's, and each decode step of a worker slows with every
   sequence it runs: the paper's proportional split packs a draining version's long tail onto one or two
   workers, where it decodes several times slower than spread out, and the trainer waits for it.

The plan is pure data; the core applies it (ExportGroup now, Pin once the worker is empty).
Triggers: a published version (mandatory), a worker's KV use crossing a threshold, and a timer.
Between triggers only idle workers of versions without pending work move (they keep the ledger
within K + 1 live versions).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from dora.ids import GroupId, WorkerId


@dataclass(frozen=True, slots=True)
class WorkerView:
    worker_id: WorkerId
    version: int
    free: int
    groups: tuple[tuple[GroupId, int], ...]
    """(group, unfinished samples) for every group the worker holds."""
    settled: bool
    """Weights loaded and not already leaving."""
    order: int


@dataclass(slots=True)
class Plan:
    moves: list[WorkerId] = field(default_factory=list)
    """Workers that leave their version for the newest one."""
    migrations: list[tuple[GroupId, WorkerId, WorkerId]] = field(default_factory=list)
    """(group, source, target), always between workers of the same version."""


def allocate(workers: int, pending: dict[int, int], newest: int) -> dict[int, int]:
    """Target worker count per version: round(W * R_v / sum R), >= 1 for any version with work, sum = W."""
    active = sorted(v for v, r in pending.items() if r > 0)
    if not active or workers <= 0:
        return {newest: max(workers, 0)}
    if workers < len(active):
        return {v: 1 for v in active[:workers]}
    total = sum(pending[v] for v in active)
    quota = {v: workers * pending[v] / total for v in active}
    target = {v: max(1, math.floor(quota[v] + 0.5)) for v in active}
    while sum(target.values()) > workers:  # give back from the most over-served (newer first on ties)
        v = max((v for v in active if target[v] > 1), key=lambda v: (target[v] - quota[v], v))
        target[v] -= 1
    while sum(target.values()) < workers:  # hand out to the most under-served (newer first on ties)
        v = max(active, key=lambda v: (quota[v] - target[v], v))
        target[v] += 1
    return target


def plan(workers: list[WorkerView], pending: dict[int, int], newest: int, *, full: bool,
         fleet: int | None = None, drain_load: int = 0,
         hosts: dict[int, list[WorkerView]] | None = None, migrate: bool = True) -> Plan:  # fmt: skip
    """Which workers move to ``newest`` and which groups they hand over first.

    ``full=False`` (between triggers): only empty workers of versions with no pending work move.
    ``fleet``: the workers the targets are shared among, when ``workers`` leaves out those of ``newest`` (they
    neither move nor take others' groups; default: ``len(workers)``).
    ``drain_load`` (0: no bound): no staying worker is given groups beyond this many unfinished samples, and an
    older version keeps at least ``ceil(R_v / drain_load)`` workers (of those it has).
    ``hosts``: per version, workers that keep it besides the version they are pinned to (multi-version workers):
    they never move here and only take groups; their room is shared by every version they keep.
    ``migrate=False`` (``core.migrate``): no group moves; a leaving worker keeps its groups (the core marks it
    leaving, so it takes no new ones, and moves it once they have ended).
    """
    out = Plan()
    target = allocate(len(workers) if fleet is None else fleet, pending, newest)
    by_version: dict[int, list[WorkerView]] = {}
    for w in workers:
        if w.version == newest:
            continue
        if not w.settled:
            if not w.groups:
                out.moves.append(w.worker_id)  # loading a superseded version: go straight to the newest
            continue
        by_version.setdefault(w.version, []).append(w)
    hosts = hosts or {}
    free = {h.worker_id: _room(h, drain_load) for views in hosts.values() for h in views}
    for version in sorted(by_version):
        ranked = sorted(by_version[version], key=lambda w: (_load(w), w.order))
        keep = target.get(version, 0)
        if drain_load and pending.get(version):
            keep = max(keep, -(-pending[version] // drain_load))
        surplus = len(ranked) - keep
        if not full:
            surplus = len(ranked) if not pending.get(version) else 0
        # The least-loaded leave; their groups go only to workers that stay, so nothing moves twice.
        leaving, staying = ranked[: max(surplus, 0)], ranked[max(surplus, 0) :]
        free.update({w.worker_id: _room(w, drain_load) for w in staying})
        targets = staying + hosts.get(version, [])
        for cand in leaving:
            placed = _place(cand, targets, free) if migrate else []
            if placed is None:  # its groups do not fit: it stays (and can take others' groups)
                staying.append(cand)
                targets.append(cand)
                free[cand.worker_id] = _room(cand, drain_load)
                continue
            out.moves.append(cand.worker_id)
            out.migrations.extend(placed)
    return out


def place_some(groups: tuple[tuple[GroupId, int], ...], peers: list[WorkerView]) -> list[tuple[GroupId, WorkerId]]:
    """First-fit-decreasing of ``(group, unfinished samples)`` onto ``peers`` (one version): as many as fit,
    the largest first; each goes to the peer with the most room left. What does not fit is left out."""
    free = {p.worker_id: p.free for p in peers}
    order = {p.worker_id: p.order for p in peers}
    placed: list[tuple[GroupId, WorkerId]] = []
    for gid, n in sorted(groups, key=lambda g: (-g[1], g[0])):
        fits = [w for w in free if free[w] >= n]
        if fits:
            dst = max(fits, key=lambda w: (free[w], -order[w]))
            free[dst] -= n
            placed.append((gid, dst))
    return placed


def all_placed(holders: Iterable[tuple[int, tuple[tuple[GroupId, int], ...]]],
               room: dict[int, dict[WorkerId, int]]) -> bool:  # fmt: skip
    """Would every group of ``holders`` ((version, ((group, unfinished samples), ...)) each, in turn) find room on
    ``room`` (version -> {peer: free slots}), each placed by ``place_some`` and taking its room from the next
    holder's? ``room`` is used up in place."""
    for version, groups in holders:
        free = room.setdefault(version, {})
        if sum(n for _, n in groups) > sum(free.values()):  # cannot fit however placed
            return False
        views = [WorkerView(worker_id=p, version=version, free=n, groups=(), settled=True, order=i)
                 for i, (p, n) in enumerate(free.items())]  # fmt: skip
        placed = place_some(groups, views)
        if len(placed) < len(groups):
            return False
        need = dict(groups)
        for gid, dst in placed:
            free[dst] -= need[gid]
    return True


def _load(w: WorkerView) -> int:
    return sum(n for _, n in w.groups)


def _room(w: WorkerView, drain_load: int) -> int:
    """How many more unfinished samples a staying worker may be given: its free slots, within ``drain_load``."""
    return w.free if not drain_load else max(0, min(w.free, drain_load - _load(w)))


def _place(
    leaving: WorkerView, staying: list[WorkerView], free: dict[WorkerId, int]
) -> list[tuple[GroupId, WorkerId, WorkerId]] | None:
    """First-fit-decreasing of the leaving worker's groups onto the staying ones; None if one does not fit."""
    if not leaving.groups:
        return []
    trial = dict(free)
    placed: list[tuple[GroupId, WorkerId, WorkerId]] = []
    for gid, n in sorted(leaving.groups, key=lambda g: (-g[1], g[0])):
        fits = [w for w in staying if trial[w.worker_id] >= n]
        if not fits:
            return None
        dst = max(fits, key=lambda w: (trial[w.worker_id], -w.order))
        trial[dst.worker_id] -= n
        placed.append((gid, leaving.worker_id, dst.worker_id))
    free.update(trial)
    return placed
