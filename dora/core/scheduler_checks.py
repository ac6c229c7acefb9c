"""The scheduler's invariants, recomputed from scratch: what it keeps incrementally (slot use, incoming migrations,
groups per version, the idle, leaving and idle unready workers, the roster, pending samples per version) against a
recount from its flights, and every leased group on a worker serving its version (C1). The core runs them after
every event in strict mode; a broken one raises ``InvariantViolation``.
"""

from __future__ import annotations

from collections import Counter

from dora.core.ledger import InvariantViolation
from dora.core.scheduler import GroupState, Scheduler, Worker
from dora.ids import GroupId, WorkerId


def check(sched: Scheduler, *, placement: bool = True) -> None:
    """Recompute slot use and lease ownership from scratch and compare.

    ``placement``: every leased group runs on a worker serving its version (off only in partial
    mode, where workers swap weights under running requests by design).
    """
    holders = _check_flights(sched, placement)
    _check_indexes(sched)
    if len(holders) != sum(len(w.groups) for w in sched.workers.values()):
        raise InvariantViolation("a group is held twice or listed by no worker")
    if len(set(sched.queue)) != len(sched.queue) or any(
        sched.flights[g].state is not GroupState.QUEUED for g in sched.queue
    ):
        raise InvariantViolation("queue holds a group twice or a group that is not queued")


def _check_flights(sched: Scheduler, placement: bool) -> dict[GroupId, WorkerId]:
    """Each worker's slot use, incoming migrations and groups per version, recounted from the flights; returns
    the holder of every leased group."""
    used = {w: 0 for w in sched.workers}
    incoming = {w: 0 for w in sched.workers}
    claims: dict[WorkerId, Counter[int]] = {w: Counter() for w in sched.workers}
    holders: dict[GroupId, WorkerId] = {}
    for f in sched.flights.values():
        if f.state is GroupState.QUEUED:
            if f.worker is not None or f.attempt is not None:
                raise InvariantViolation(f"queued group {f.group_id} still has a lease")
            continue
        if f.worker is None or f.worker not in sched.workers:
            raise InvariantViolation(f"group {f.group_id} held by unknown worker {f.worker}")
        if placement and not sched.ledger.holds(f.worker, f.version):
            raise InvariantViolation(
                f"C1: group {f.group_id} of version {f.version} on {f.worker} serving "
                f"{sched.ledger.version_of(f.worker)} (keeping {sorted(sched.ledger.kept_by(f.worker))})"
            )
        holders[f.group_id] = f.worker
        used[f.worker] += sched.unfinished(f)
        claims[f.worker][f.version] += 1
        if f.target is not None:
            if placement and not sched.ledger.holds(f.target, f.version):
                raise InvariantViolation(f"C1: group {f.group_id} of version {f.version} migrating to {f.target}")
            used[f.target] += sched.unfinished(f)
            incoming[f.target] += 1
            claims[f.target][f.version] += 1
    for w in sched.workers.values():
        _check_worker(sched, w, used[w.worker_id], incoming[w.worker_id], claims[w.worker_id], holders)
    return holders


def _check_worker(
    sched: Scheduler, w: Worker, used: int, incoming: int, claims: Counter[int], holders: dict[GroupId, WorkerId]
) -> None:
    """One worker's records against what the flights say it holds."""
    if w.incoming != incoming:
        raise InvariantViolation(f"{w.worker_id}: {w.incoming} migrations in recorded, {incoming}")
    if w.yielded and w.ready:
        raise InvariantViolation(f"{w.worker_id} yielded its accelerators but counts as ready")
    if used != w.used:
        raise InvariantViolation(f"{w.worker_id}: {w.used} slots recorded, {used} held")
    if w.used > w.slots:
        raise InvariantViolation(f"{w.worker_id} over capacity: {w.used} > {w.slots}")
    if w.claims != claims:
        raise InvariantViolation(f"{w.worker_id}: groups per version {dict(w.claims)} != {claims}")
    kept = sched.ledger.kept_by(w.worker_id)
    if kept - set(w.claims) or len(kept) + 1 > w.holds:
        raise InvariantViolation(f"{w.worker_id} keeps {sorted(kept)}, runs {dict(w.claims)}, holds {w.holds}")
    for gid in w.groups:
        if holders.get(gid) != w.worker_id:
            raise InvariantViolation(f"{w.worker_id} lists group {gid} it does not hold")


def _check_indexes(sched: Scheduler) -> None:
    """What is kept incrementally (pending samples, the idle, leaving and idle unready workers, the roster)
    against a recount."""
    if _recount(sched) != sched.pending_requests():
        raise InvariantViolation(f"pending requests {sched.pending_requests()} != recount {_recount(sched)}")
    if sched.idle != {w.worker_id for w in sched.workers.values() if not w.groups}:
        raise InvariantViolation("idle-worker set out of date")
    if sched.leaving != {w.worker_id for w in sched.workers.values() if w.leaving}:
        raise InvariantViolation("leaving-worker set out of date")
    idle_unready: dict[int, set[WorkerId]] = {}
    for w in sched.workers.values():
        if not w.ready and not w.groups and (v := sched.ledger.version_of(w.worker_id)) is not None:
            idle_unready.setdefault(v, set()).add(w.worker_id)
    if idle_unready != sched.idle_unready:
        raise InvariantViolation("idle unready workers per version out of date")
    listed: dict[int, set[tuple[WorkerId, int, int]]] = {}
    for w in sched.workers.values():
        pinned = sched.ledger.version_of(w.worker_id)
        for v in ({pinned} if pinned is not None else set()) | sched.ledger.kept_by(w.worker_id):
            if v not in listed:
                listed[v] = sched.roster.listed(v)
            if sched.serves(w, v) and (w.worker_id, w.free, w.order) not in listed[v]:
                raise InvariantViolation(f"{w.worker_id} serves v{v} with {w.free} free slots, not on the roster")


def _recount(sched: Scheduler) -> dict[int, int]:
    """Unfinished samples of leased groups per version, counted from the flights."""
    load: dict[int, int] = {}
    for f in sched.flights.values():
        if f.state is not GroupState.QUEUED:
            load[f.version] = load.get(f.version, 0) + sched.unfinished(f)
    return load
