"""Scheduler: the lease book. It leases whole groups to workers, fences results, re-queues the work of lost
workers, and migrates running groups between workers of one version.

A group (one prompt x G samples) is leased to exactly one worker at a time and so carries exactly
one version (C1). Every lease gets a fresh attempt id; a result is accepted only from the current
holder with the current attempt (``check_result``), so a late result from a dead or superseded lease is
refused and nothing is trained twice. A lost lease returns to the front of the queue whole (C2): partial
output is discarded and the prompt re-runs on the newest version, so its deadline only moves later.

The scheduler holds the state (flights, workers, the queue, the prompt cursor), is the only writer of it (dispatch,
intake, the elastic workers' moves and the core call its methods), and keeps what it derives from it consistent:
slot use, the idle, leaving and unready workers, the roster, and pending samples per version.
``scheduler_checks`` recomputes all of it from scratch. A group's deadline lives on its flight; the ledger's counts
by deadline move with it (``admit``, ``move``). The choice of which group is leased next, on which version, with
which deadline, is made in ``dispatch`` (the admission arithmetic itself lives in ``deadline``). The checks on a
finished sample that passed the fence, and the taking of it into its group, live in ``intake``.

Multi-version workers (``holds`` > 1: a LoRA engine holds several adapter versions) serve the version they are
pinned to and every older version they keep (``Ledger.keep``): a version stays kept exactly while a group of it
runs on the worker or is migrating to it, and is dropped as its last one leaves. Leases and migrations go to any
worker that serves the version; a lease or migration of a version to a worker that does not serve it is a
broken invariant (C1). A worker that holds one version (full weights) never keeps any.
"""

from __future__ import annotations

from collections import Counter, deque
from dataclasses import dataclass, field
from enum import StrEnum

from dora.config import CoreConfig
from dora.core.events import (
    ExportGroup,
    ImportGroup,
    Lease,
    Outbox,
    ReadySample,
    Refused,
    Revoke,
)
from dora.core.ledger import InvariantViolation, Ledger
from dora.core.roster import Roster
from dora.ids import AttemptId, GroupId, WorkerId


class GroupState(StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    MIGRATING = "migrating"


@dataclass(slots=True)
class Flight:
    """A group that is owed but not finished: queued for a (re-)lease, running, or being migrated."""

    group_id: GroupId
    version: int
    """Dispatch version; for a queued re-run, the version of its last lease."""
    state: GroupState
    deadline: int = 0
    """The last step allowed to train it (for a queued re-run: its floor, the deadline it had)."""
    attempt: AttemptId | None = None
    worker: WorkerId | None = None
    target: WorkerId | None = None
    """Migration target while MIGRATING."""
    done: dict[int, ReadySample] = field(default_factory=dict)
    rewards: dict[int, float | None] = field(default_factory=dict)
    """The rewards of ``done``'s samples, kept only where uniform groups are filtered (``filter_uniform``)."""
    failures: int = 0
    reruns: int = 0


@dataclass(slots=True)
class Worker:
    worker_id: WorkerId
    slots: int
    order: int
    used: int = 0
    """Sequences reserved: unfinished samples of held groups plus incoming migrations."""
    ready: bool = False
    """Weights of the pinned version are loaded."""
    leaving: bool = False
    """Handing its groups to peers of its version before it loads the newest weights."""
    elastic: bool = False
    """Shares its accelerators with the trainer and yields them for every train step."""
    yielded: bool = False
    """Told to yield (or yielded): its accelerators are the trainer's until the step is published."""
    incoming: int = 0
    """Groups migrating to it, not yet exported by their source: it must keep its version until they land."""
    groups: set[GroupId] = field(default_factory=set)
    holds: int = 1
    """Versions it can serve at once: 1 for full weights; a LoRA engine's adapter slots."""
    claims: Counter[int] = field(default_factory=Counter)
    """Groups per version that it holds or that are migrating to it (what keeps a kept version)."""

    @property
    def free(self) -> int:
        return self.slots - self.used


class Scheduler:
    """Leases, workers and the prompt cursor. Pure: no I/O, no clock.

    The cursor, the owed groups, the wave, the refills and the admission horizon are the state ``dispatch`` reads
    and moves; ``took`` and ``release`` are the bookkeeping ``intake`` calls as samples are taken."""

    def __init__(self, cfg: CoreConfig, ledger: Ledger, start_cursor: int = 0) -> None:
        self.cfg = cfg
        self.ledger = ledger
        self.cursor = start_cursor
        """Next fresh group id (position in the prompt stream)."""
        self.workers: dict[WorkerId, Worker] = {}
        self.flights: dict[GroupId, Flight] = {}
        self.queue: deque[GroupId] = deque()
        self.owed: deque[GroupId] = deque()
        """Groups a restarted broker owes from before the restart: handed out again before the cursor moves."""
        self.reissued = 0
        self.filtered = 0
        """Groups consumed as filtered over the whole run (a restarted broker's earlier ones too): each lets one
        more fresh group be dispatched beyond the prompt budget (``dispatch.budget_left``)."""
        self.refill = 0
        """The wave modes: fresh groups owed for filtered ones, dispatched beside the waves (not part of one)."""
        self._next_attempt = 1
        self._joined = 0
        self.wave_left = 0
        self.wave: set[GroupId] = set()
        self.idle: set[WorkerId] = set()
        """Workers holding no group (kept incrementally: the orchestrator looks at them on every event)."""
        self.leaving: set[WorkerId] = set()
        self.idle_unready: dict[int, set[WorkerId]] = {}
        """version -> the idle workers pinned to it whose weights are not loaded (loading them, or yielded), kept
        incrementally: one of them pinned to an older version than the newest is due to move."""
        self._idle_unready_at: dict[WorkerId, int] = {}
        self.roster = Roster()
        """The serving workers of each version by free slots: every change to a worker's ``used``, ``ready``,
        ``leaving`` or pin is offered to it (``offer``), so a lease does not look at every worker."""
        self.pending: dict[int, int] = {}
        """Unfinished samples of leased groups per version (R_v), kept incrementally."""
        self.horizon = cfg.staleness
        """New groups get deadlines at most v + horizon (K, or less under adaptive deadlines; see Core)."""
        k = cfg.staleness
        self.first_offset = min(1, k) if cfg.deadlines == "adaptive" and not cfg.drops_stale else k
        """The earliest deadline a group dispatched on v may get, as v + this: K (fixed), or 1 (adaptive)."""
        self.stats_requeued = 0
        self.stats_migrated_groups = 0
        self.stats_migrated_requests = 0
        self.stats_migrated_to_keepers = 0
        """Migrations to a worker that keeps the group's version besides a newer pin."""

    # ------------------------------------------------------------------ queries

    def unfinished(self, flight: Flight) -> int:
        return self.cfg.group_size - len(flight.done)

    def outstanding(self) -> int:
        return len(self.flights)

    def pending_requests(self) -> dict[int, int]:
        """Unfinished samples of leased groups per version (R_v of the orchestrator)."""
        return {v: n for v, n in self.pending.items() if n}

    def _owe(self, version: int, n: int) -> None:
        self.pending[version] = self.pending.get(version, 0) + n

    def _hold(self, worker: Worker, group: GroupId) -> None:
        worker.groups.add(group)
        self._claim(worker, self.flights[group].version)
        self.idle.discard(worker.worker_id)
        self._file(worker)

    def _unhold(self, worker: Worker, group: GroupId) -> None:
        worker.groups.discard(group)
        self._unclaim(worker, self.flights[group].version)
        if not worker.groups:
            self.idle.add(worker.worker_id)
            self._file(worker)

    def _claim(self, worker: Worker, version: int) -> None:
        worker.claims[version] += 1

    def _unclaim(self, worker: Worker, version: int) -> None:
        """One group of ``version`` left the worker (or will not arrive): the last one takes a kept version along."""
        worker.claims[version] -= 1
        if not worker.claims[version]:
            del worker.claims[version]
            self.ledger.drop(worker.worker_id, version)

    def set_ready(self, worker: Worker, ready: bool) -> None:
        """Its pinned version's weights are loaded (or not); set after any pin change."""
        worker.ready = ready
        self._file(worker)
        if ready:  # an unready worker serves nothing: there is nothing to offer
            self.offer(worker)

    def _file(self, worker: Worker) -> None:
        """Keep ``idle_unready`` after a change of the worker's groups, readiness or pin (or its loss)."""
        name = worker.worker_id
        was = self._idle_unready_at.pop(name, None)
        if was is not None:
            self.idle_unready[was].discard(name)
            if not self.idle_unready[was]:
                del self.idle_unready[was]
        version = self.ledger.version_of(name)
        if version is not None and not worker.ready and not worker.groups and name in self.workers:
            self.idle_unready.setdefault(version, set()).add(name)
            self._idle_unready_at[name] = version

    def set_leaving(self, worker: Worker, leaving: bool) -> None:
        worker.leaving = leaving
        (self.leaving.add if leaving else self.leaving.discard)(worker.worker_id)
        self.offer(worker)

    def serves(self, worker: Worker, version: int) -> bool:
        """Whether the worker may be given work of ``version`` now: its pinned version once loaded (and not
        leaving it), or a version it keeps (loaded before) while its accelerators are its own."""
        name = worker.worker_id
        if self.ledger.version_of(name) == version:
            return worker.ready and not worker.leaving
        return not worker.yielded and version in self.ledger.kept_by(name)

    def offer(self, worker: Worker) -> None:
        """Tell the roster the worker's free slots under every version it serves now."""
        name = worker.worker_id
        version = self.ledger.version_of(name)
        if version is not None and worker.ready and not worker.leaving:
            self.roster.offer(version, name, worker.free, worker.order)
        if worker.holds > 1 and not worker.yielded:
            for kept in self.ledger.kept_by(name):
                self.roster.offer(kept, name, worker.free, worker.order)

    def pick_worker(self, version: int, need: int) -> Worker | None:
        """The ready worker of ``version`` with the most free slots (join order breaks ties), if it has ``need``."""
        pinned, keepers = self.ledger.pinned_to(version), self.ledger.keepers(version)
        if self.roster.crowded(version, len(pinned) + len(keepers)):
            serving = [self.workers[w] for w in pinned] + [self.workers[w] for w in keepers]
            self.roster.rebuild(version, ((w.worker_id, w.free, w.order) for w in serving if self.serves(w, version)))

        def current(name: WorkerId) -> tuple[int, int] | None:
            w = self.workers.get(name)
            return (w.free, w.order) if w is not None and self.serves(w, version) else None

        best = self.roster.best(version, current)
        worker = self.workers[best] if best is not None else None
        return worker if worker is not None and worker.free >= need else None

    def forget(self, version: int) -> None:
        """``version`` is retired: nothing of it runs or will (so its pending count is 0 and is dropped, and the
        count of every other version keeps its place)."""
        self.roster.forget([version])
        self.pending.pop(version, None)

    # ------------------------------------------------------------------ groups (what dispatch, intake, the core change)

    def restore(self, owed: list[GroupId], filtered: int) -> None:
        """A restarted broker's debts: groups to hand out again before the cursor moves, and the groups its run
        filtered before the restart."""
        self.owed.extend(owed)
        self.filtered = filtered

    def open_group(self, *, wave: bool = True) -> Flight:
        """The next fresh group, queued: one a restarted broker owes, else the one at the cursor (``wave``: in the
        wave modes, one of the current wave; a refill for a filtered group is not)."""
        if self.owed:
            gid = self.owed.popleft()
            self.reissued += 1
        else:
            gid = GroupId(self.cursor)
            self.cursor += 1
        flight = Flight(group_id=gid, version=self.ledger.newest, state=GroupState.QUEUED)
        self.flights[gid] = flight
        if self.cfg.waves and wave:
            self.wave.add(gid)
        return flight

    def next_rerun(self) -> Flight:
        """The re-run at the front of the queue, taken off it."""
        return self.flights[self.queue.popleft()]

    def admit(self, flight: Flight, version: int, deadline: int) -> None:
        """A fresh group is to run on ``version``, due at ``deadline``: the flight holds its deadline, and the
        ledger counts it there (this and ``move`` are the only writers of either)."""
        self.ledger.add_group(version, deadline)
        flight.version, flight.deadline = version, deadline

    def move(self, flight: Flight, version: int, deadline: int) -> None:
        """The group moves later: a re-run on a newer version, or a deadline extended (see ``admit``)."""
        self.ledger.move_group((flight.version, flight.deadline), (version, deadline))
        flight.version, flight.deadline = version, deadline

    def count_filtered(self) -> None:
        """A finished group was consumed as filtered: one more fresh group may be dispatched (a refill, in the
        wave modes)."""
        self.filtered += 1
        if self.cfg.waves:
            self.refill += 1

    def refilled(self) -> None:
        self.refill -= 1

    def start_wave(self) -> None:
        self.wave_left = self.cfg.train_groups

    def waved(self) -> None:
        """One group of the wave was leased."""
        self.wave_left -= 1

    def widen(self) -> None:
        """Adaptive deadlines: new groups may be due one step later (at most K)."""
        self.horizon = min(self.cfg.staleness, self.horizon + 1)

    def narrow(self) -> None:
        """Adaptive deadlines: new groups are due one step sooner (at least min(1, K))."""
        self.horizon = max(min(1, self.cfg.staleness), self.horizon - 1)

    def take(self, flight: Flight, sample: ReadySample, reward: float | None) -> None:
        """A finished sample of the flight's lease passed intake's checks (its slot is freed by ``took``)."""
        flight.done[sample.index] = sample
        if self.cfg.filter_uniform:
            flight.rewards[sample.index] = reward

    def fail(self, flight: Flight) -> int:
        """A sample of the flight failed its checks: how many times the group has failed now."""
        flight.failures += 1
        return flight.failures

    # ------------------------------------------------------------------ workers

    def join(self, worker: WorkerId, slots: int, *, elastic: bool = False, holds: int = 1) -> Worker:
        self._joined += 1
        w = Worker(worker_id=worker, slots=slots, order=self._joined, elastic=elastic, holds=holds)
        self.workers[worker] = w
        self.idle.add(worker)
        return w

    def lend(self, worker: Worker) -> None:
        """The elastic worker is told to yield its accelerators to the trainer: it serves nothing until it is back."""
        self.set_leaving(worker, False)
        worker.yielded = True
        self.set_ready(worker, False)

    def reclaim(self, worker: Worker) -> None:
        """The worker takes its accelerators back after the publish: the versions it keeps are served again (its
        pinned one once it has loaded)."""
        worker.yielded = False
        self.offer(worker)

    def lose(self, worker: WorkerId, out: Outbox) -> None:
        """Re-queue every group the worker held (whole); void migrations that targeted it."""
        w = self.workers.pop(worker)
        self.idle.discard(worker)
        self.leaving.discard(worker)
        self._file(w)
        for gid in sorted(w.groups):
            self.requeue(self.flights[gid], out, notify=False)
        for f in self.flights.values():
            if f.target == worker:
                f.target = None  # the source still exports; the export is then re-run (see exported)

    # ------------------------------------------------------------------ leasing

    def lease(self, flight: Flight, worker: Worker, version: int, out: Outbox) -> None:
        if flight.state is not GroupState.QUEUED:
            raise InvariantViolation(f"lease of group {flight.group_id} in state {flight.state}")
        if not self.serves(worker, version):
            raise InvariantViolation(f"lease of group {flight.group_id} on a worker not serving {version}")
        flight.attempt = AttemptId(self._next_attempt)
        self._next_attempt += 1
        flight.state = GroupState.RUNNING
        flight.worker = worker.worker_id
        flight.version = version
        self._hold(worker, flight.group_id)
        worker.used += self.cfg.group_size
        self.offer(worker)
        self._owe(version, self.cfg.group_size)
        out.emit(
            Lease(
                worker_id=worker.worker_id,
                group_id=flight.group_id,
                attempt=flight.attempt,
                version=version,
                n_samples=self.cfg.group_size,
            )
        )

    def requeue(self, flight: Flight, out: Outbox, *, notify: bool = True) -> None:
        """Void the current lease and put the group at the front of the queue, whole."""
        if flight.state is not GroupState.QUEUED:
            self._owe(flight.version, -self.unfinished(flight))
        if flight.worker is not None:
            holder = self.workers.get(flight.worker)
            if holder is not None:
                self._unhold(holder, flight.group_id)
                holder.used -= self.unfinished(flight)
                self.offer(holder)
                if notify and flight.attempt is not None:
                    out.emit(Revoke(worker_id=holder.worker_id, group_id=flight.group_id, attempt=flight.attempt))
        if flight.target is not None and flight.target in self.workers:
            self.workers[flight.target].used -= self.unfinished(flight)
            self.workers[flight.target].incoming -= 1
            self._unclaim(self.workers[flight.target], flight.version)
            self.offer(self.workers[flight.target])
        flight.state = GroupState.QUEUED
        flight.attempt = None
        flight.worker = None
        flight.target = None
        flight.done.clear()
        flight.rewards.clear()
        flight.reruns += 1
        self.stats_requeued += 1
        self.queue.appendleft(flight.group_id)

    def due(self, step: int) -> list[Flight]:
        """Unfinished groups whose deadline is ``step``."""
        return [f for f in self.flights.values() if f.deadline == step]

    # ------------------------------------------------------------------ results (taken by intake)

    def check_result(self, worker: WorkerId, group: GroupId, attempt: AttemptId) -> Flight | str:
        """The flight a result belongs to, or the reason it is refused."""
        if worker not in self.workers:
            return "unknown_worker"
        flight = self.flights.get(group)
        if flight is None:
            return "unknown_group"
        if flight.attempt != attempt:
            return "stale_attempt"
        if flight.worker != worker:
            return "not_holder"
        return flight

    def took(self, flight: Flight, samples: int) -> None:
        """``samples`` more of the flight's samples finished: their slots are free (and reserved no more on a
        migration's target)."""
        if not samples:
            return
        assert flight.worker is not None  # a running flight has a holder
        holder = self.workers[flight.worker]
        holder.used -= samples
        self.offer(holder)
        self._owe(flight.version, -samples)
        if flight.target is not None:
            target = self.workers[flight.target]
            target.used -= samples
            self.offer(target)

    def release(self, flight: Flight) -> None:
        """A finished group leaves the scheduler (its slots are already free)."""
        if flight.worker is not None and flight.worker in self.workers:
            self._unhold(self.workers[flight.worker], flight.group_id)
        if flight.target is not None and flight.target in self.workers:  # it finished while migrating
            self.workers[flight.target].incoming -= 1
            self._unclaim(self.workers[flight.target], flight.version)
        del self.flights[flight.group_id]
        self.wave.discard(flight.group_id)

    # ------------------------------------------------------------------ migration

    def migrate(self, flight: Flight, target: Worker, out: Outbox) -> None:
        """Ask the holder to export the group's running samples for ``target`` (same version only)."""
        src = flight.worker
        if src is None or flight.state is not GroupState.RUNNING or flight.attempt is None:
            raise InvariantViolation(f"migration of group {flight.group_id} in state {flight.state}")
        if not self.serves(target, flight.version) or target.worker_id == src:
            raise InvariantViolation(
                f"migration of group {flight.group_id} (version {flight.version}) to {target.worker_id} "
                f"serving {self.ledger.version_of(target.worker_id)}"
            )
        flight.state = GroupState.MIGRATING
        flight.target = target.worker_id
        self.stats_migrated_to_keepers += self.ledger.version_of(target.worker_id) != flight.version
        target.used += self.unfinished(flight)
        target.incoming += 1
        self._claim(target, flight.version)
        self.offer(target)
        out.emit(
            ExportGroup(
                worker_id=src,
                target=target.worker_id,
                group_id=flight.group_id,
                attempt=flight.attempt,
                version=flight.version,
            )
        )

    def exported(
        self, worker: WorkerId, group: GroupId, attempt: AttemptId, n_requests: int, state: object, out: Outbox
    ) -> None:
        found = self.check_result(worker, group, attempt)
        if isinstance(found, str):
            out.emit(Refused(reason=found, worker_id=worker, group_id=group, attempt=attempt))
            return
        flight = found
        if flight.state is not GroupState.MIGRATING:
            out.emit(Refused(reason="not_migrating", worker_id=worker, group_id=group, attempt=attempt))
            return
        if flight.target is None or n_requests != self.unfinished(flight):
            # The target died meanwhile, or the export does not match what is owed: re-run the group.
            self.requeue(flight, out, notify=False)
            return
        src = self.workers[worker]
        dst = self.workers[flight.target]
        self._unhold(src, group)
        src.used -= n_requests
        self.offer(src)
        self._hold(dst, group)
        dst.incoming -= 1
        self._unclaim(dst, flight.version)
        flight.worker = dst.worker_id
        flight.target = None
        flight.state = GroupState.RUNNING
        self.stats_migrated_groups += 1
        self.stats_migrated_requests += n_requests
        out.emit(
            ImportGroup(
                worker_id=dst.worker_id,
                source=worker,
                group_id=group,
                attempt=attempt,
                version=flight.version,
                n_requests=n_requests,
                state=state,
            )
        )
