"""Elastic workers (docs/how-it-works.md#elastic-workers): what the core does when a batch is taken and when the
step is published.

When a batch is taken, each elastic worker hands its running groups to standalone workers of the same version
that have room (a migration: C1 holds because the weights are identical) and is told to ``Lend``: it pauses
whatever it still holds. With ``core.migrate`` off (agent episodes, whose agent talks to one worker's endpoint)
nothing is handed over: the worker holds all its running groups paused. The batch is delivered once every elastic
worker has yielded (the trainer has its accelerators). After the publish each yielded worker comes back
(``wake``). Functions of the ``Core``'s state, as ``dispatch`` is of the scheduler's.
"""

from __future__ import annotations

from typing import Protocol

from dora.config import CoreConfig
from dora.core import orchestrator
from dora.core.events import DeliverBatch, Lend, Outbox, Reclaim
from dora.core.ledger import Ledger
from dora.core.scheduler import GroupState, Scheduler, Worker
from dora.ids import GroupId, WorkerId


class Core(Protocol):
    """What of ``dora.core.core.Core`` these functions read and move."""

    cfg: CoreConfig
    ledger: Ledger
    scheduler: Scheduler
    yielding: set[WorkerId]
    held: DeliverBatch | None

    def assign(self, worker: WorkerId, out: Outbox, *, interrupt: bool = False) -> None: ...
    def keeps(self, w: Worker) -> tuple[int, ...] | None: ...


def would_pause(core: Core) -> bool:
    """Would a batch taken now hold a running group paused through the step? The elastic workers yield for
    it, and a group of theirs that no standalone worker of its version has room for waits on its yielded
    worker (``evacuate``): taking the batch early then only trades that group's rollout time for the
    trainer's, and the group is due a step later anyway. In ``partial`` mode (``in_flight_swap``) nothing is
    evacuated (the publish swaps every worker's weights anyway), nor without migration (``migrate`` off), so
    any running group of theirs would wait."""
    sched = core.scheduler
    if core.cfg.in_flight_swap or not core.cfg.migrate:
        return any(running_by_version(core, w) for w in sched.workers.values() if w.elastic and not w.yielded)
    holders = (  # made as they are placed: the first that does not fit ends the check
        running
        for w in sched.workers.values()  # in join order, as yield_elastic evacuates them
        if w.elastic and not w.yielded and w.groups
        for running in running_by_version(core, w)
    )
    room: dict[int, dict[WorkerId, int]] = {}
    for p in evacuation_peers(core):
        version = core.ledger.version_of(p.worker_id)
        if version is not None:
            room.setdefault(version, {})[p.worker_id] = p.free
    return not orchestrator.all_placed(holders, room)


def yield_elastic(core: Core, batch: DeliverBatch, out: Outbox) -> None:
    """The batch is taken: elastic workers hand what they can to standalone peers of their version (unless
    ``migrate`` is off) and yield; the batch goes out when they all have (at once if there are none)."""
    sched = core.scheduler
    elastic = sorted((w for w in sched.workers.values() if w.elastic and not w.yielded), key=lambda x: x.order)
    if not elastic:
        out.emit(batch)
        return
    # partial swaps every worker's weights at the publish anyway; without migration groups stay where they run
    hand = not core.cfg.in_flight_swap and core.cfg.migrate
    peers = evacuation_peers(core) if hand else []
    for w in elastic:
        if hand:
            evacuate(core, w, peers, out)
        sched.lend(w)
        core.yielding.add(w.worker_id)
        out.emit(Lend(worker_id=w.worker_id))
    core.held = batch


def evacuation_peers(core: Core) -> list[Worker]:
    """The workers a yielding elastic worker may hand running groups to: standalone, loaded, staying."""
    return [w for w in core.scheduler.workers.values() if not w.elastic and w.ready and not w.leaving]


def evacuate(core: Core, worker: Worker, peers: list[Worker], out: Outbox) -> None:
    """Migrate the worker's running groups to standalone workers of its version with room; the rest stay
    held (paused) on it."""
    sched = core.scheduler
    for version, running in running_by_version(core, worker):
        views = [orchestrator.WorkerView(worker_id=p.worker_id, version=version, free=p.free, groups=(),
                                         settled=True, order=p.order)
                 for p in peers if core.ledger.version_of(p.worker_id) == version]  # fmt: skip
        for gid, dst in orchestrator.place_some(running, views):
            sched.migrate(sched.flights[gid], sched.workers[dst], out)


def running_by_version(core: Core, worker: Worker) -> list[tuple[int, tuple[tuple[GroupId, int], ...]]]:
    """The worker's running groups as (version, ((group, unfinished samples), ...)), its pinned version first,
    then the versions it keeps, oldest first. Peers take a version's groups where it is their pinned one."""
    sched = core.scheduler
    pinned = core.ledger.version_of(worker.worker_id)
    by_version: dict[int, list[tuple[GroupId, int]]] = {}
    for g in sorted(worker.groups):
        f = sched.flights[g]
        if f.state is GroupState.RUNNING:
            by_version.setdefault(f.version, []).append((g, sched.unfinished(f)))
    order = sorted(by_version, key=lambda v: (v != pinned, v))
    return [(v, tuple(by_version[v])) for v in order]


def hand_over(core: Core, out: Outbox) -> None:
    if core.held is not None and not core.yielding:
        out.emit(core.held)
        core.held = None


def wake(core: Core, worker: Worker, out: Outbox) -> None:
    """A yielded worker comes back after the publish: it resumes the version it holds groups of (C1),
    or loads the newest one."""
    core.scheduler.reclaim(worker)
    version = core.ledger.version_of(worker.worker_id)
    assert version is not None
    holds = worker.groups or worker.incoming
    if version != core.ledger.newest and worker.holds > 1 and not worker.incoming and core.keeps(worker) is not None:
        core.assign(worker.worker_id, out)  # a multi-version worker takes the newest, keeping what it runs
    elif version == core.ledger.newest or (holds and not core.cfg.in_flight_swap):
        out.emit(Reclaim(worker_id=worker.worker_id, version=version))
    elif not core.cfg.in_flight_swap:
        core.assign(worker.worker_id, out)
    # in_flight_swap (partial): the publish swaps every worker, this one included, to the newest weights
