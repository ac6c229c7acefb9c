"""The core's face to its readers: what the broker, its metrics and the simulator may ask of the core's state.

``Core.handle`` is the only way in; ``Core.view`` is the only way to look. Every query answers with plain values or
frozen snapshots, so nothing outside the core holds (or can change) the scheduler's, the ledger's or the transfer
queue's own objects.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Set
from dataclasses import dataclass

from dora.core.events import ReadyGroup
from dora.core.ledger import Ledger
from dora.core.scheduler import Scheduler
from dora.core.transfer import TransferQueue
from dora.ids import AttemptId, GroupId, WorkerId


@dataclass(frozen=True, slots=True)
class WorkerState:
    """One rollout worker as the core sees it."""

    worker_id: WorkerId
    version: int | None
    """The version it is pinned to (serving or loading it)."""
    slots: int
    used: int
    """Sequences reserved: unfinished samples of its groups plus incoming migrations."""
    ready: bool
    """The pinned version's weights are loaded."""
    leaving: bool
    """Handing its groups to peers of its version before it loads the newest weights."""
    yielded: bool
    """Told to yield its accelerators to the trainer (or yielded them) until the step is published."""
    lending: bool
    """Told to yield, and its answer not taken yet."""
    leases: tuple[tuple[GroupId, AttemptId], ...]
    """The (group, attempt) leases it holds, by group."""


@dataclass(frozen=True, slots=True)
class VersionSummary:
    """A version's workers and groups: every live version, and a retired one that still owns a queued re-run."""

    workers: int
    """Workers pinned to it (loading or serving it)."""
    running: int
    """Groups of it running on a worker."""
    queued: int
    """Groups of it waiting for a (re-)lease."""
    state: str
    """Its place in the ledger's lifecycle (published, live, draining, retired)."""


@dataclass(frozen=True, slots=True)
class CoreTotals:
    """The run's counts so far, as the metrics and the simulator's outcome report them."""

    dispatched: int
    """Groups dispatched (the prompt cursor: the next fresh group id)."""
    in_flight: int
    """Groups owed and not finished: queued for a (re-)lease, running or migrating."""
    finished_waiting: int
    """Finished groups waiting for a train batch."""
    consumed: int
    """Groups taken into train batches, the one in training too."""
    in_training: int | None
    """The groups of the batch delivered and not yet published; None when none is."""
    filtered: int
    """Groups consumed as filtered over the whole run (a restarted broker's earlier ones too)."""
    staleness: dict[int, int]
    """Trajectories consumed, by staleness (a copy)."""
    migrated_groups: int
    migrated_requests: int
    requeued: int
    """Voided leases whose group runs again, whole."""


class CoreView:
    """Read-only queries on the core's state. Built once by the ``Core``, over its own parts."""

    def __init__(self, scheduler: Scheduler, ledger: Ledger, transfer: TransferQueue, lending: Set[WorkerId]) -> None:
        self._sched = scheduler
        self._ledger = ledger
        self._transfer = transfer
        self._lending = lending

    @property
    def newest(self) -> int:
        """The newest published version."""
        return self._ledger.newest

    @property
    def dispatched(self) -> int:
        """Groups dispatched so far (the next fresh group id): the journal reserves ids through it."""
        return self._sched.cursor

    def alive(self) -> list[int]:
        """Versions not retired, oldest first."""
        return self._ledger.alive()

    def worker_count(self) -> int:
        return len(self._sched.workers)

    def has_worker(self, worker: WorkerId) -> bool:
        return worker in self._sched.workers

    def worker(self, worker: WorkerId) -> WorkerState | None:
        """The worker's state; None for a worker the core does not know."""
        w = self._sched.workers.get(worker)
        if w is None:
            return None
        leases = []
        for g in sorted(w.groups):
            attempt = self._sched.flights[g].attempt
            assert attempt is not None  # a group a worker holds runs under a lease
            leases.append((g, attempt))
        return WorkerState(
            worker_id=worker,
            version=self._ledger.version_of(worker),
            slots=w.slots,
            used=w.used,
            ready=w.ready,
            leaving=w.leaving,
            yielded=w.yielded,
            lending=worker in self._lending,
            leases=tuple(leases),
        )

    def workers(self) -> list[WorkerState]:
        """Every worker, in join order."""
        return [s for w in self._sched.workers if (s := self.worker(w)) is not None]

    def serving(self, version: int) -> list[WorkerId]:
        """The workers ready to serve ``version``: pinned to it, loaded, not leaving; by name."""
        workers = self._sched.workers
        return sorted(w for w in self._ledger.workers_of(version) if workers[w].ready and not workers[w].leaving)

    def owes(self, group: GroupId) -> bool:
        """Whether the group is owed and not finished (queued, running or migrating)."""
        return group in self._sched.flights

    def exporting(self, worker: WorkerId, group: GroupId, attempt: AttemptId) -> bool:
        """Whether ``worker`` is to export its lease ``attempt`` of ``group`` for a migration still under way."""
        f = self._sched.flights.get(group)
        return f is not None and f.worker == worker and f.target is not None and f.attempt == attempt

    def versions(self) -> dict[int, VersionSummary]:
        """Every live version, and every retired one that still owns a queued re-run, oldest first."""
        led = self._ledger
        states = {v: led.state(v).value for v in led.alive()}
        running, queued = Counter[int](), Counter[int]()
        for f in self._sched.flights.values():
            (queued if f.worker is None else running)[f.version] += 1
        return {
            v: VersionSummary(workers=len(led.workers_of(v)), running=running[v], queued=queued[v],
                              state=states.get(v, "retired"))
            for v in sorted(states.keys() | running.keys() | queued.keys())
        }  # fmt: skip

    def filtered(self) -> list[GroupId]:
        """The groups this core consumed as filtered (all rewards equal), in order."""
        return list(self._transfer.filtered)

    def dropped(self) -> tuple[ReadyGroup, ...]:
        """The finished groups discarded as too stale (the drop_stale baseline), in order."""
        return tuple(self._transfer.dropped)

    def totals(self) -> CoreTotals:
        sched, tq = self._sched, self._transfer
        return CoreTotals(
            dispatched=sched.cursor,
            in_flight=len(sched.flights),
            finished_waiting=len(tq),
            consumed=len(tq.consumed),
            in_training=len(tq.in_training.groups) if tq.in_training is not None else None,
            filtered=sched.filtered,
            staleness=dict(tq.staleness),
            migrated_groups=sched.stats_migrated_groups,
            migrated_requests=sched.stats_migrated_requests,
            requeued=sched.stats_requeued,
        )
