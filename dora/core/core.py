"""The pure decision core (dora.core), driven by the broker actor live and by the simulator on a virtual clock:
one event in, a list of actions out.

``Core.handle(now, event)`` is the only entry point, and ``Core.view`` (``dora.core.view``) the only window on the
state. The broker actor calls ``handle`` for every decoded message and timer; the simulator calls it for every
virtual-time event. Every decision (admission, placement, batching, re-partitioning, migration, retirement) is made
here, so the simulator and the live system cannot disagree.

After each event the core (1) applies the event, (2) hands a batch to a waiting learner if the
deadline rule allows, (3) lets the orchestrator move workers, (4) dispatches work, (5) retires
versions, and in strict mode (6) re-checks every invariant from scratch, raising
``InvariantViolation`` on a bug.

Elastic workers share their accelerators with the trainer (docs/how-it-works.md#elastic-workers). When a batch is
taken, each one hands its running groups to standalone workers of the same version that have room (a migration:
C1 holds because the weights are identical; none with ``migrate`` off) and is told to ``Lend`` them: it pauses
whatever it still holds. The batch is delivered once every elastic worker has lent its accelerators (the trainer
has them). After the step is published each such worker comes back: one that holds groups ``Reclaim``s the
version it served, so they go on under the same weights (C1); one that holds none is pinned to the newest version.
Held groups keep their deadlines; the feasibility invariant counts them like any running group, so C2
and C3 hold as before. All workers elastic is colocated training; none is disaggregated (``dora.core.elastic``).

Multi-version workers (LoRA, docs/how-it-works.md#multi-version-workers) take each new version as soon as they
can keep every version their groups run under (``Pin.keep``): they are never drained for a publish
(``_advance``).
"""

from __future__ import annotations

from collections import Counter

from dora.config import CoreConfig
from dora.core import core_checks, deadline, elastic, intake, orchestrator
from dora.core.dispatch import budget_left, dispatch
from dora.core.events import (
    Action,
    BatchRequested,
    DeliverBatch,
    Event,
    GroupExported,
    LearnerLost,
    LeaseLost,
    Lent,
    LoadReported,
    Outbox,
    Pin,
    ReadyGroup,
    Refused,
    ResultsReported,
    Retire,
    RunFinished,
    Tick,
    VersionLoaded,
    VersionPublished,
    WorkerJoined,
    WorkerLost,
)
from dora.core.ledger import InvariantViolation, Ledger
from dora.core.scheduler import Flight, Scheduler, Worker
from dora.core.transfer import TransferQueue
from dora.core.view import CoreView
from dora.ids import GroupId, Mode, WorkerId


class Core:
    """Ledger + scheduler + transfer queue + orchestrator behind one ``handle``. Pure."""

    def __init__(
        self,
        cfg: CoreConfig,
        *,
        initial_version: int = 0,
        start_cursor: int = 0,
        strict: bool = True,
    ) -> None:
        self.cfg = cfg
        self.strict = strict
        self.ledger = Ledger(cfg.staleness, initial_version, bounded=not cfg.drops_stale)
        self.scheduler = Scheduler(cfg, self.ledger, start_cursor)
        self.transfer = TransferQueue(
            cfg.train_groups,
            cfg.staleness,
            count_c1=cfg.in_flight_swap,
            drop_stale=cfg.drops_stale,
            start_step=initial_version,
        )
        self.start_cursor = start_cursor
        self.learner_waiting = False
        self.finished = False
        self.now = 0.0
        self.refusals = Counter[str]()
        self.rebalances = 0
        self.fleet_ready = cfg.min_workers <= 0
        """True once min_workers workers have joined and loaded their weights; leasing starts then and never stops
        for it again. (Counting joins alone, the first worker to load would take every group the watermark allows
        while the others still load, and the fleet would not start together.)"""
        self.lost_unready = 0
        """Workers lost before the fleet was ready: they count towards min_workers, which they no longer hold back
        (a fleet waiting for a worker that died while loading would wait forever)."""
        self.yielding: set[WorkerId] = set()
        """Elastic workers told to yield for the batch taken that have not answered yet."""
        self.held: DeliverBatch | None = None
        """The batch taken, delivered once every elastic worker has yielded."""
        self.extended = 0
        """Deadlines moved a step later so that a waiting trainer could take its batch (adaptive deadlines)."""
        self.requested_at = 0.0
        """When the learner asked for the batch it waits for."""
        self.multi: set[WorkerId] = set()
        """Workers that hold several versions at once (LoRA): each one moves to a new version as soon as it can
        keep every version it still runs groups of (``_advance``), without draining or handing groups over."""
        self.behind: set[WorkerId] = set()
        """The multi-version workers that may be pinned to an older version than the newest."""
        self.filtered_before = 0
        """Groups a restarted broker's run had filtered before it (``restore``)."""
        self.view = CoreView(self.scheduler, self.ledger, self.transfer, self.yielding)
        """The only way to look at the core's state from outside it."""

    # ------------------------------------------------------------------ entry point

    def handle(self, now: float, event: Event) -> list[Action]:
        self.now = now
        out = Outbox()
        full = self._apply(event, out)
        self._filter()
        self._deliver(out)
        self._filter()  # a batch taken opens the next step's window: uniform groups left waiting may go now
        self._orchestrate(out, full=full)
        if not self.fleet_ready and self._ready_workers() + self.lost_unready >= self.cfg.min_workers:
            self.fleet_ready = True
        if self.fleet_ready:
            dispatch(self.scheduler, self.transfer.step, out)
        for version in self.ledger.collect_retired():
            self.scheduler.forget(version)
            out.emit(Retire(version=version))
        self._maybe_finish(out)
        for a in out.actions:
            if isinstance(a, Refused):
                self.refusals[a.reason] += 1
        if self.strict:
            self.check()
        return out.actions

    def _ready_workers(self) -> int:
        return sum(1 for w in self.scheduler.workers.values() if w.ready)

    def restore(self, owed: list[int], filtered: int = 0) -> int:
        """A restarted broker's debts: groups handed out before the restart and neither trained nor filtered (call
        before the first event). They are dispatched again, whole, before any group past the cursor, under the
        same admission rule as fresh groups; a group's prompt depends on its id alone. Ids at or past the prompt
        budget are left out (a journal reserves ids in blocks, beyond those it handed out, and this run trains
        only ids below its budget: owing those would dispatch groups it never trains); returns how many.
        ``filtered``: groups the run filtered before the restart; with ``filter_uniform`` each one moves the
        budget one id further, and more may yet, so every owed id is kept, in order, for the budget to reach."""
        if any(g >= self.scheduler.cursor for g in owed) or len(set(owed)) != len(owed):
            raise ValueError("restored groups must be distinct and below the cursor")
        budget = self.cfg.prompt_budget
        self.filtered_before = filtered
        kept = sorted(g for g in owed if budget is None or g < budget or self.cfg.filter_uniform)
        self.scheduler.restore([GroupId(g) for g in kept], filtered)
        return sum(1 for g in owed if budget is not None and g >= budget + filtered)

    def publishable(self, version: int) -> DeliverBatch | None:
        """The batch a publish of ``version`` completes, if the core takes that publish; None if it refuses it.
        (The broker journals the batch's groups before the publish takes effect.)"""
        batch = self.transfer.in_training
        if version != self.ledger.newest + 1 or batch is None or batch.step + 1 != version:
            return None
        return batch

    @property
    def step(self) -> int:
        """s: the next train step whose batch will be taken."""
        return self.transfer.step

    def filtered_with(self, step: int) -> list[GroupId]:
        """The groups filtered in step ``step``'s window (before its batch was taken): what the broker journals
        beside batch ``step``'s groups, before the publish that completes it takes effect."""
        return list(self.transfer.filtered_by_step.get(step, ()))

    def _apply(self, event: Event, out: Outbox) -> bool:
        """Apply one event; True if it is a trigger for a full re-partition."""
        sched, dora = self.scheduler, self.cfg.mode is Mode.DORA
        match event:
            case WorkerJoined():
                return self._joined(event, out) and dora
            case WorkerLost(worker_id=w):
                return self._lost(w, out) and dora
            case LeaseLost(worker_id=w, group_id=g, attempt=a):
                found = sched.check_result(w, g, a)
                if isinstance(found, str):  # re-leased or finished meanwhile: nothing is owed to this lease
                    out.emit(Refused(reason=f"lease_lost_{found}", worker_id=w, group_id=g, attempt=a))
                else:
                    sched.requeue(found, out, notify=False)  # whole, like a lost worker's (C2)
            case VersionLoaded(worker_id=w, version=v):
                self._loaded(w, v, out)
            case ResultsReported():
                for flight in intake.accept(sched, event, out):
                    self._finished(flight)
            case GroupExported(worker_id=w, group_id=g, attempt=a, n_requests=n, state=state):
                sched.exported(w, g, a, n, state, out)
            case Lent(worker_id=w):
                if w not in self.yielding:
                    out.emit(Refused(reason="unexpected_yield", worker_id=w))
                else:
                    self.yielding.discard(w)
                    elastic.hand_over(self, out)
            case LoadReported(worker_id=w, kv_use=kv):
                return dora and w in sched.workers and kv >= self.cfg.kv_rebalance_threshold
            case Tick():
                return dora
            case VersionPublished(version=v):
                return self._published(v, out) and dora
            case BatchRequested(step=step):
                self._requested(step, out)
            case LearnerLost():
                self.learner_waiting = False
            case _:
                raise TypeError(f"not a core event: {event!r}")
        return False

    def _joined(self, event: WorkerJoined, out: Outbox) -> bool:
        """A worker joins (again, if a restarted process kept its id): pinned to the newest version. False if
        it is refused."""
        w = event.worker_id
        if w in self.scheduler.workers:  # a restarted process under the same id: its old leases are void
            self._lose(w, out)
        if event.slots < self.cfg.group_size:
            out.emit(Refused(reason=f"slots {event.slots} < group_size {self.cfg.group_size}", worker_id=w))
            return False
        # partial swaps weights under running requests by design: it has no use for kept versions
        holds = 1 if self.cfg.in_flight_swap else max(1, event.holds)
        worker = self.scheduler.join(w, event.slots, elastic=event.elastic, holds=holds)
        if worker.holds > 1:
            self.multi.add(w)
        self.assign(w, out)
        return True

    def _lost(self, w: WorkerId, out: Outbox) -> bool:
        """A worker is gone: its groups re-run whole. False for a worker the core does not know."""
        if w not in self.scheduler.workers:
            out.emit(Refused(reason="unknown_worker", worker_id=w))
            return False
        self.lost_unready += not self.fleet_ready
        self._lose(w, out)
        return True

    def _loaded(self, w: WorkerId, v: int, out: Outbox) -> None:
        """A worker loaded the weights of ``v``: it serves them, if they are still the ones it is pinned to."""
        worker = self.scheduler.workers.get(w)
        if worker is None or self.ledger.version_of(w) != v:
            out.emit(Refused(reason="stale_load", worker_id=w))
        elif worker.ready:  # a repeat: the report came twice
            return
        elif worker.yielded:  # a load that ended after the yield: the worker reloads when it comes back
            out.emit(Refused(reason="load_while_yielded", worker_id=w))
        else:
            self.scheduler.set_ready(worker, True)
            self.ledger.mark_loaded(v)

    def _published(self, v: int, out: Outbox) -> bool:
        """The learner published ``v``: the batch in training is done. Yielded workers come back; in partial
        mode every worker swaps to ``v`` under its running requests. False if the publish is refused."""
        if self.publishable(v) is None or not self.transfer.trained(v):
            out.emit(Refused(reason=f"unexpected_publish v{v}"))
            return False
        self.ledger.publish(v)
        self.behind |= self.multi
        sched = self.scheduler
        for worker in sorted((w for w in sched.workers.values() if w.yielded), key=lambda x: x.order):
            elastic.wake(self, worker, out)
        if self.cfg.in_flight_swap:
            for w in list(sched.workers):
                self.assign(w, out, interrupt=True)
        return True

    def _requested(self, step: int, out: Outbox) -> None:
        """The learner asks for batch ``step``: sent again if it is one in training, else waited for.

        The learner may ask for batch ``s + 1`` as soon as it has trained batch ``s``, while version ``s + 1`` is
        still being written (``early``): the batch is taken as it would be after the publish (the same deadline
        rule at step ``s + 1``, the same C3 check against ``s + 1``), and version ``s + 1`` is published only once
        it is durable, so dispatch, admission and the ledger see nothing new. Two batches are then in training;
        the next publish completes the older. With K = 0 no group can fill batch ``s + 1`` before ``s + 1`` is
        published, so the early request just waits: sync stays sync. With elastic workers the batch waits for
        the publish (they lend their accelerators per step and come back on it)."""
        tq = self.transfer
        if self.held is not None and step == self.held.step:
            return  # it goes out once the elastic workers have yielded
        training = next((b for b in tq.training if b.step == step), None)
        newest = self.ledger.newest
        early = step == newest + 1 and [b.step for b in tq.training] == [newest]
        if training is not None:
            out.emit(DeliverBatch(step=training.step, groups=training.groups, redelivery=True))
        elif step == tq.step and ((step == newest and not tq.training) or early):
            if not self.learner_waiting:
                self.requested_at = self.now
            self.learner_waiting = True
        else:
            out.emit(Refused(reason=f"bad_step {step} (next is {tq.step})"))

    # ------------------------------------------------------------------ pieces

    def _lose(self, worker: WorkerId, out: Outbox) -> None:
        self.multi.discard(worker)
        self.behind.discard(worker)
        self.scheduler.lose(worker, out)
        self.ledger.unpin(worker)
        if worker in self.yielding:
            self.yielding.discard(worker)
            elastic.hand_over(self, out)

    def _adapt(self, *, waited: bool, surplus: int) -> None:
        """Adaptive deadlines: the admission horizon h in [1, K] (new groups get deadlines <= v + h) grows by
        one after a batch the trainer had to wait for, and shrinks by one after a batch taken on request with
        a whole further batch already finished (``surplus``: finished groups left). A fleet that keeps up
        gets a small pool of fresh groups; one that does not, the whole window. (By Little's law the
        unconsumed pool, up to (h + 1) x B groups, sets the mean staleness.)"""
        if waited:
            self.scheduler.widen()
        elif surplus >= self.cfg.train_groups:
            self.scheduler.narrow()

    def _extend_and_take(self) -> DeliverBatch | None:
        """Adaptive deadlines: the trainer waits on groups due now that still run. Move each one's deadline a
        step later where v + K allows, if that lets the batch be taken now; otherwise change nothing.
        Not while that would pause a running group on a yielding elastic worker (``_would_pause``).
        Moving groups from deadline s to s + 1 keeps the feasibility invariant (the counts at every later
        deadline are unchanged) and ``take`` still keeps it for s + 1, so C2, C3 and liveness hold."""
        s, B = self.step, self.cfg.train_groups
        if len(self.transfer) < B or not self.transfer.waiting_on(self.ledger.deadline_counts()):
            return None
        movable = [f for f in self.scheduler.due(s) if f.version + self.cfg.staleness > s]
        if not movable:
            return None
        moved = self.ledger.deadline_counts()  # the counts once they are moved, checked before moving any
        moved[s] -= len(movable)
        moved[s + 1] = moved.get(s + 1, 0) + len(movable)
        if not self.transfer.would_take({d: n for d, n in moved.items() if n}) or elastic.would_pause(self):
            return None  # it would not help yet (keep the data fresh), or it would pause a group
        for f in movable:
            self.scheduler.move(f, f.version, s + 1)
        batch = self.transfer.take(self.ledger.deadline_counts())
        assert batch is not None
        self.extended += len(movable)
        return batch

    def assign(self, worker: WorkerId, out: Outbox, *, interrupt: bool = False) -> None:
        """Pin ``worker`` to the newest version and tell it to load those weights; a multi-version worker keeps
        every version groups of it still run (or are migrating to it) under."""
        w = self.scheduler.workers[worker]
        newest = self.ledger.newest
        if self.ledger.version_of(worker) == newest:
            return
        keep = self.keeps(w) if not interrupt else ()
        if keep is None:
            raise InvariantViolation(f"{worker} told to change version while holding groups {sorted(w.groups)}")
        self.ledger.pin(worker, newest)
        for v in keep:
            self.ledger.keep(worker, v)
        self.scheduler.set_ready(w, False)
        if w.leaving:
            self.scheduler.set_leaving(w, False)
        self.scheduler.offer(w)
        out.emit(Pin(worker_id=worker, version=newest, interrupt=interrupt, keep=keep))

    def keeps(self, w: Worker) -> tuple[int, ...] | None:
        """The versions the worker must keep to take the newest one now (those its groups run under, or are
        migrating to it under); None if it cannot (a full-weight worker with groups, or too few adapter slots)."""
        keep = tuple(sorted(v for v in w.claims if v != self.ledger.newest))
        if keep and (w.holds == 1 or len(keep) + 1 > w.holds):
            return None
        return keep

    def _advance(self, out: Outbox) -> None:
        """Multi-version workers behind the newest version take it now where they can keep what they run (one
        that cannot yet waits for groups to finish; it is never drained, and its groups never moved, for this)."""
        newest = self.ledger.newest
        for name in sorted(self.behind, key=lambda n: self.scheduler.workers[n].order):
            w = self.scheduler.workers.get(name)
            if w is None or self.ledger.version_of(name) == newest:
                self.behind.discard(name)
            elif not w.yielded and not w.incoming and self.keeps(w) is not None:  # what comes in, lands first
                self.assign(name, out)
                self.behind.discard(name)

    def _finished(self, flight: Flight) -> None:
        samples = tuple(flight.done[i] for i in range(self.cfg.group_size))
        rewards = set(flight.rewards.values())
        self.transfer.add(
            ReadyGroup(group_id=flight.group_id, version=flight.version, samples=samples, deadline=flight.deadline),
            uniform=self.cfg.filter_uniform and len(rewards) == 1 and None not in rewards,
        )

    def _filter(self) -> None:
        """Consume the finished groups whose rewards are all equal as filtered, up to the step's cap (see
        ``TransferQueue.filter``). Each leaves the unconsumed counts, which only frees room: the feasibility
        invariant holds with fewer groups, a group due at ``s`` that is filtered is one the batch no longer
        waits for, and admission may lease another in its place at once (the prompt budget grows by one; in the
        wave modes a refill is owed beside the waves). Past the cap the step's uniform groups are trained."""
        cap = self.cfg.filter_cap
        if not cap:
            return
        for g in self.transfer.filter(cap):
            self.ledger.remove_group(g.version, g.deadline)
            self.scheduler.count_filtered()

    def _deliver(self, out: Outbox) -> None:
        training = self.transfer.training
        if not self.learner_waiting or len(training) > 1:
            return
        if training and any(w.elastic for w in self.scheduler.workers.values()):
            return  # an early request with elastic workers: taken once the pending publish is in
        if self.cfg.total_steps is not None and self.transfer.step >= self.cfg.total_steps:
            return
        if self.cfg.drops_stale:
            for g in self.transfer.expire():
                self.ledger.remove_group(g.version, g.deadline)
        batch = self.transfer.take(self.ledger.deadline_counts())
        if batch is None and self.cfg.deadlines == "adaptive":
            batch = self._extend_and_take()
        if batch is None:
            return
        for g in batch.groups:
            self.ledger.remove_group(g.version, g.deadline)
        self.learner_waiting = False
        if self.cfg.deadlines == "adaptive":
            self._adapt(waited=self.now > self.requested_at, surplus=len(self.transfer))
        elastic.yield_elastic(self, batch, out)

    def _orchestrate(self, out: Outbox, *, full: bool) -> None:
        sched = self.scheduler
        if self.behind:
            self._advance(out)
        # Workers that finished handing over their groups load the newest weights now.
        for w in [sched.workers[name] for name in sorted(sched.leaving & sched.idle)]:
            if not w.groups and not w.incoming:
                self.assign(w.worker_id, out)
        if full:
            self.rebalances += 1
        # Only workers off the newest version can move or hand groups over, so only they are looked at. A version
        # with no pending work gets no worker (orchestrator.allocate), so the plan moves each empty worker of it
        # whatever else it weighs: those move without a plan (at a publish, most of an idle fleet), and so does
        # every worker looked at between triggers (orchestrator.plan with full=False: they are all empty workers
        # of such versions, or empty ones loading weights). A full re-partition plans the others and counts
        # everyone (its targets depend on the fleet's size). tests/unit/test_orchestrator.py holds plan to this.
        if not full:
            moves = [w.worker_id for w in self._movable_between_triggers(sched.pending_requests()) if _movable(w)]
        else:
            moves = self._repartition(out)
        for worker in sorted(moves, key=lambda name: sched.workers[name].order):  # join order, as partial
            w = sched.workers[worker]
            if w.groups:
                sched.set_leaving(w, True)
            else:
                self.assign(worker, out)

    def _repartition(self, out: Outbox) -> list[WorkerId]:
        """A full re-partition: the empty workers of versions with nothing pending move without a plan; the others
        off the newest version are planned (their groups migrated where the plan says; with ``migrate`` off, a
        worker the plan moves keeps its groups and moves once they have ended). Returns the workers to move."""
        sched, led = self.scheduler, self.ledger
        newest, pending = led.newest, self._pending()
        moves: list[WorkerId] = []
        planned: list[tuple[Worker, int]] = []  # with the version each is pinned to
        for v in led.pinned_versions():
            if v == newest:
                continue
            nothing_left = not pending.get(v)
            for w in map(sched.workers.__getitem__, led.pinned_to(v)):
                if nothing_left and not w.groups and _movable(w):
                    moves.append(w.worker_id)
                elif _movable(w) and w.holds == 1:  # a multi-version worker moves when it can keep (_advance)
                    planned.append((w, v))
        if not planned:
            return moves
        planned.sort(key=lambda p: p[0].order)
        views = [
            orchestrator.WorkerView(
                worker_id=w.worker_id,
                version=v,
                free=w.free,
                groups=tuple((g, sched.unfinished(sched.flights[g])) for g in sorted(w.groups)),
                settled=w.ready and not w.leaving,
                order=w.order,
            )
            for w, v in planned
        ]
        on_newest = sum(1 for w in map(sched.workers.__getitem__, led.pinned_to(newest)) if _movable(w))
        drain = self.cfg.drain_load if self.cfg.mode is Mode.DORA else 0  # the baselines keep the paper's rule
        hosts = self._hosts({v.version for v in views}) if self.cfg.migrate else None
        plan = orchestrator.plan(views, pending, newest, full=True, fleet=len(views) + len(moves) + on_newest,
                                 drain_load=drain, hosts=hosts, migrate=self.cfg.migrate)  # fmt: skip
        for gid, _src, dst in plan.migrations:
            sched.migrate(sched.flights[gid], sched.workers[dst], out)
        return moves + plan.moves

    def _hosts(self, versions: set[int]) -> dict[int, list[orchestrator.WorkerView]]:
        """Per version, the multi-version workers that keep it and may take its groups now."""
        sched, hosts = self.scheduler, {}
        for v in sorted(versions):
            keepers = sorted((sched.workers[w] for w in self.ledger.keepers(v)), key=lambda w: w.order)
            views = [orchestrator.WorkerView(
                worker_id=w.worker_id, version=v, free=w.free, settled=True, order=w.order,
                groups=tuple((g, sched.unfinished(sched.flights[g])) for g in sorted(w.groups)),
            ) for w in keepers if sched.serves(w, v)]  # fmt: skip
            if views:
                hosts[v] = views
        return hosts

    def _movable_between_triggers(self, pending: dict[int, int]) -> list[Worker]:
        """The workers a plan between triggers may move, in name order: idle ones pinned to an older version that
        has no pending work, or still loading one. (An idle worker serving an older version with work left stays
        until the next trigger, so it is not looked at.) They are found through the ledger's pins per version and
        the scheduler's idle unready workers per version, so an event costs nothing per worker that is busy, on
        the newest version, or staying."""
        sched, led = self.scheduler, self.ledger
        names: list[WorkerId] = []
        for v in led.pinned_versions():
            if v == led.newest:
                continue
            pinned = led.pinned_to(v)
            if not pending.get(v):  # nothing of it runs: its workers are idle (bar partial's swaps), and move
                names.extend(w for w in pinned if w in sched.idle)
                continue
            names.extend(sched.idle_unready.get(v, ()))
        return [sched.workers[w] for w in sorted(names)]

    def _pending(self) -> dict[int, int]:
        """R_v: unfinished samples per version, plus what the newest version is about to receive."""
        sched = self.scheduler
        pending = sched.pending_requests()
        newest = self.ledger.newest
        top_up = len(sched.queue)
        if not self.cfg.waves and budget_left(sched):
            room = deadline.admissible(
                self.ledger.deadline_counts(), self.step, self.cfg.train_groups, newest + self.cfg.staleness
            )
            top_up += int(min(room, max(0, self.cfg.watermark - sched.outstanding())))
        if top_up:
            pending[newest] = pending.get(newest, 0) + top_up * self.cfg.group_size
        return pending

    def _maybe_finish(self, out: Outbox) -> None:
        total = self.cfg.total_steps
        if self.finished or total is None:
            return
        if self.transfer.step >= total and self.transfer.in_training is None:
            self.finished = True
            out.emit(RunFinished(steps=total))

    # ------------------------------------------------------------------ invariants

    def check(self) -> None:
        """Recompute every structural invariant; raise InvariantViolation on the first broken one."""
        core_checks.check(self)

def _movable(w: Worker) -> bool:
    """Not yielded to the trainer, and no group on its way to it (it keeps its version until that lands)."""
    return not w.yielded and not w.incoming
