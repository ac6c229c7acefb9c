"""A model of the rollout fleet and the learner that carries out the core's actions.

The world decides nothing. It holds what the real processes hold (loaded weights, running requests
with their token counts and version history, exports in transit, the learner's batch) and turns the
core's actions into that state and that state back into events. It records every token under the
version the worker *actually* had loaded, so a scheduling bug in the core shows up as a C1/C3
violation in the learner's checks here, independently of the core's own assertions.

Agentic episodes: an episode that ends a turn waits on its tool call inside its worker's engine,
holding its lease (the core still counts it in flight) but no decode slot. ``on_turn_end`` tells the
driver, which owns the clock, and calls ``tool_returned`` when the result is back; without a driver
the tool answers at once. A migration takes waiting episodes along (same version only, as always).

Elastic workers (``join(elastic=True)``): on ``Lend`` a worker pauses what it holds (decoding stops;
its KV is kept for the resume, or dropped with ``yield_kv = "drop"`` and re-prefilled then) until the
driver reports ``finish_yield``; ``Reclaim`` (same version) or ``Pin`` (newest) brings it back through a
load, which the driver finishes with ``finish_load``.

Multi-version workers (``join(holds=n)``, a LoRA engine with n adapter slots): a ``Pin`` may come while
requests run, naming in ``keep`` every version they run under; the worker loads the new version beside them and
they go on decoding meanwhile. Each request runs under its own version, which must be one the worker holds
whenever it decodes; the world checks that at every decode step, independently of the core.

Two drivers use it: the discrete-event simulator (``dora.sim.des``, virtual time) and the property
tests (hypothesis chooses which enabled event happens next).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

from dora.core.events import (
    Action,
    BatchRequested,
    DeliverBatch,
    ExportGroup,
    GroupExported,
    ImportGroup,
    LearnerLost,
    Lease,
    LeaseLost,
    Lend,
    Lent,
    Pin,
    Reclaim,
    Refused,
    ResultsReported,
    Retire,
    Revoke,
    RunFinished,
    SampleResult,
    VersionLoaded,
    VersionPublished,
    WorkerJoined,
    WorkerLost,
)
from dora.ids import AttemptId, GroupId, WorkerId
from dora.sim.engine import Engine, Request
from dora.sim.workload import Workload


class WorldError(AssertionError):
    """The core asked for something the real system could not do, or trained data it must not."""


@dataclass(slots=True)
class SimWorker:
    worker_id: WorkerId
    slots: int
    engine: Engine
    loaded: int | None = None
    """Version whose weights are in memory and serving."""
    loading: int | None = None
    exporting: dict[GroupId, tuple[AttemptId, list[Request]]] = field(default_factory=dict)
    alive: bool = True
    prefill_debt: int = 0
    """Tokens to prefill before decoding resumes (new requests, re-prefill after a swap or a migration)."""
    elastic: bool = False
    yielded: bool = False
    """Its accelerators are the trainer's: nothing decodes."""
    yield_pending: bool = False
    """Told to yield and not yet reported done (``finish_yield``)."""
    woken: bool = False
    """Came back from a yield with the last action (the driver adds the wake-up to its load)."""
    resume_debt: int = 0
    """Tokens to re-prefill when it comes back (its KV was dropped at the yield)."""
    holds: int = 1
    """Versions its engine holds at once (adapter slots); 1: full weights."""
    kept: set[int] = field(default_factory=set)
    """A multi-version worker: the older versions it holds besides ``loaded`` (from the last ``Pin``)."""

    @property
    def requests(self) -> list[Request]:
        return self.engine.requests()

    @property
    def decoding(self) -> bool:
        adds = self.holds > 1 and self.loading != self.loaded  # a multi-version engine adds a version beside the
        return (self.alive and (self.loading is None or adds) and not self.yielded  # others, which decode meanwhile
                and bool(self.engine.running))  # fmt: skip

    def serves(self, version: int | None) -> bool:
        """Whether a request of ``version`` may run here now: the loaded version (not while loading another), or a
        version it keeps."""
        return (self.loaded == version and self.loading is None) or version in self.kept


@dataclass(slots=True)
class Learner:
    version: int = 0
    waiting: bool = False
    batch: DeliverBatch | None = None
    """The batch being trained."""
    writing: DeliverBatch | None = None
    """A batch trained whose version is being written (an overlapped publish): the learner may take the next batch
    meanwhile, and the version is published when the write ends."""
    trained: list[GroupId] = field(default_factory=list)
    steps: int = 0
    staleness: Counter[int] = field(default_factory=Counter)
    c1_violations: int = 0
    mixed_version_trajectories: int = 0
    finished: bool = False


@dataclass(kw_only=True, eq=False)
class World:
    """Fleet + learner state machine. ``apply`` takes the core's actions; the other methods make events."""

    group_size: int
    train_groups: int
    max_staleness: int
    workload: Workload
    mixed_versions_allowed: bool = False
    max_running: int | None = None
    """Sequences an engine decodes at once (None: as many as it holds)."""
    kv_budget_tokens: int = 1 << 62
    kv_transfer: bool = True
    """Migration carries the KV cache (no re-prefill on the target)."""
    keep_kv: bool = True
    """An episode waiting on a tool call keeps its KV cache (see ``dora.sim.engine``)."""
    yield_kv: str = "offload"
    """What a yielding worker does with the KV of what it holds: "offload" (to host memory) or "drop"."""
    on_turn_end: Callable[[WorkerId, Request], None] | None = field(default=None, init=False)
    """Called when an episode ends a turn and its tool call starts (None: the tool answers at once)."""
    episodes: dict[tuple[int, int, int], tuple[int, int]] = field(default_factory=dict, init=False)
    """(group, attempt, index) of finished multi-turn episodes -> (turns, observation tokens), for the trainer."""
    workers: dict[WorkerId, SimWorker] = field(default_factory=dict, init=False)
    learner: Learner = field(default_factory=Learner, init=False)
    retired: set[int] = field(default_factory=set, init=False)
    sent: list[ResultsReported] = field(default_factory=list, init=False)
    """Every result ever sent, for replaying late or duplicated messages."""
    attempts: dict[GroupId, AttemptId] = field(default_factory=dict, init=False)
    """Each group's latest lease: the attempt whose samples it finished with (or runs now)."""
    migrated_requests: int = field(default=0, init=False)
    migrated_waiting: int = field(default=0, init=False)
    """Migrated episodes that were waiting on a tool call (their state went along)."""
    migrated_tokens: int = field(default=0, init=False)
    reprefill_tokens: int = field(default=0, init=False)
    refused: Counter[str] = field(default_factory=Counter, init=False)
    tokens_trained: int = field(default=0, init=False)
    before_change: Callable[[WorkerId], None] | None = field(default=None, init=False)
    """Called before an action changes a live worker (the simulator catches its clock up first)."""
    _ids: int = field(default=0, init=False)

    # ------------------------------------------------------------------ actions from the core

    def apply(self, actions: list[Action]) -> None:
        for a in actions:
            match a:
                case Lease():
                    self._lease(a)
                case Pin():
                    self._pin(a)
                case Lend():
                    self._lend(a)
                case Reclaim():
                    self._reclaim(a)
                case ExportGroup():
                    self._export(a)
                case ImportGroup():
                    self._import(a)
                case Revoke():
                    self._revoke(a)
                case DeliverBatch():
                    self._receive(a)
                case Retire():
                    self._retire(a.version)
                case Refused():
                    self.refused[a.reason] += 1
                case RunFinished():
                    self.learner.finished = True

    def _lease(self, a: Lease) -> None:
        self.attempts[a.group_id] = a.attempt
        w = self._live(a.worker_id)
        if w is None:
            return  # the message was sent to a process that is already dead
        if not w.serves(a.version):
            raise WorldError(f"lease of version {a.version} to {w.worker_id} serving {w.loaded}")
        if len(w.engine) + a.n_samples > w.slots:
            raise WorldError(f"{w.worker_id} leased beyond its {w.slots} slots")
        reqs = self._requests(a)
        if w.holds > 1:
            for r in reqs:
                r.version = a.version
        w.prefill_debt += w.engine.submit(reqs)

    def _pin(self, a: Pin) -> None:
        w = self._live(a.worker_id)
        if w is None:
            return
        self._wake(w)
        running = {r.version for r in w.requests}
        if w.holds > 1 and not a.interrupt:
            if not running <= set(a.keep) or len(set(a.keep) | {a.version}) > w.holds:
                raise WorldError(f"{w.worker_id} told to load v{a.version} keeping {a.keep}, running "
                                 f"{sorted(running, key=str)} with {w.holds} versions at most")  # fmt: skip
        elif len(w.engine) and not a.interrupt:
            raise WorldError(f"{w.worker_id} told to swap weights under {len(w.engine)} requests")
        if a.version in self.retired or set(a.keep) & self.retired:
            raise WorldError(f"{w.worker_id} told to load retired version {a.version}")
        w.kept = set(a.keep)
        w.loading = a.version

    def _lend(self, a: Lend) -> None:
        w = self._live(a.worker_id)
        if w is None:
            return
        if not w.elastic or w.yielded:
            raise WorldError(f"{w.worker_id} told to yield (elastic={w.elastic}, yielded={w.yielded})")
        w.yielded = w.yield_pending = True
        if self.yield_kv == "drop":
            w.resume_debt += w.engine.drop_kv()

    def _reclaim(self, a: Reclaim) -> None:
        w = self._live(a.worker_id)
        if w is None:
            return
        if not w.yielded or w.loaded != a.version:
            raise WorldError(f"{w.worker_id} told to resume {a.version} (serving {w.loaded})")
        self._wake(w)
        w.loading = a.version

    def _export(self, a: ExportGroup) -> None:
        w = self._live(a.worker_id)
        if w is not None:
            w.exporting[a.group_id] = (a.attempt, w.engine.remove(a.group_id, a.attempt))
            w.prefill_debt += w.engine.admit()  # what waited behind the group runs now

    def _import(self, a: ImportGroup) -> None:
        w = self._live(a.worker_id)
        if w is None:
            return
        if not w.serves(a.version):
            raise WorldError(f"migration of version {a.version} into {w.worker_id} serving {w.loaded}")
        reqs: list[Request] = a.state
        for r in reqs:
            r.holder = w.worker_id
            if w.holds > 1 or r.version is not None:
                r.version = a.version
            self.migrated_waiting += r.waiting_tool
            held = r.has_kv or r.turn == 0  # an episode between turns may have dropped its cache
            r.has_kv = self.kv_transfer and held
            if held and not self.kv_transfer:
                self.reprefill_tokens += round(r.context)
        self.migrated_requests += a.n_requests
        self.migrated_tokens += round(sum(r.context for r in reqs))
        w.prefill_debt += w.engine.submit(reqs, front=True)

    def _revoke(self, a: Revoke) -> None:
        w = self._live(a.worker_id)
        if w is not None:
            w.engine.remove(a.group_id, a.attempt)
            w.exporting.pop(a.group_id, None)
            w.prefill_debt += w.engine.admit()

    def _retire(self, version: int) -> None:
        self.retired.add(version)
        for w in self.workers.values():
            serving = w.loaded == version and len(w.engine) and w.loading is None
            serving = serving or any(r.version == version for r in w.requests)
            if w.alive and (w.loading == version or serving):
                raise WorldError(f"version {version} retired while {w.worker_id} still uses it")

    def _requests(self, a: Lease) -> list[Request]:
        prompt = self.workload.prompt_len(a.group_id)
        if not self.workload.multi_turn:
            reqs = [
                Request(a.group_id, a.attempt, i, self.workload.length(a.group_id, i, a.attempt), prompt)
                for i in range(a.n_samples)
            ]
        else:
            reqs = []
            for i in range(a.n_samples):
                ep = self.workload.episode(a.group_id, i, a.attempt)
                ends = tuple(itertools.accumulate(ep.turns))
                reqs.append(Request(a.group_id, a.attempt, i, ends[-1], prompt, ends=ends if len(ends) > 1 else (),
                                    observations=ep.observations, tools_s=ep.tools_s))  # fmt: skip
        for r in reqs:
            r.holder = a.worker_id
        return reqs

    @staticmethod
    def _wake(w: SimWorker) -> None:
        if w.yielded:
            if w.yield_pending:
                raise WorldError(f"{w.worker_id} called back before it finished yielding")
            w.yielded, w.woken = False, True

    def _live(self, worker: WorkerId) -> SimWorker | None:
        w = self.workers.get(worker)
        if w is None or not w.alive:
            return None
        if self.before_change is not None:
            self.before_change(worker)
        return w

    def _receive(self, batch: DeliverBatch) -> None:
        lr = self.learner
        if batch.step != lr.version + (lr.writing is not None) or lr.batch is not None:
            raise WorldError(f"learner at version {lr.version} (writing: {lr.writing is not None}) got batch "
                             f"{batch.step}")  # fmt: skip
        if len(batch.groups) != self.train_groups:
            raise WorldError(f"batch {batch.step} has {len(batch.groups)} groups, not {self.train_groups}")
        for g in batch.groups:
            if len(g.samples) != self.group_size:
                raise WorldError(f"group {g.group_id} has {len(g.samples)} samples")
            lag = batch.step - g.version
            if not 0 <= lag <= self.max_staleness:
                raise WorldError(f"C3: group {g.group_id} v{g.version} at step {batch.step}")
            if len({s.payload for s in g.samples}) != 1:
                raise WorldError(f"group {g.group_id} mixes samples of different leases")
            for s in g.samples:
                versions = {v for v, n in s.segments if n > 0}
                if versions - {g.version}:
                    if not self.mixed_versions_allowed:
                        raise WorldError(f"C1: group {g.group_id} sample {s.index} versions {sorted(versions)}")
                    lr.c1_violations += 1
                    lr.mixed_version_trajectories += len(versions) > 1
        lr.batch = batch
        lr.waiting = False

    # ------------------------------------------------------------------ events the world produces

    def join(self, slots: int, *, elastic: bool = False, holds: int = 1) -> WorkerJoined:
        self._ids += 1
        wid = WorkerId(f"w{self._ids}")
        engine = Engine(self.max_running or slots, self.kv_budget_tokens, keep_kv=self.keep_kv)
        self.workers[wid] = SimWorker(worker_id=wid, slots=slots, engine=engine, elastic=elastic, holds=holds)
        return WorkerJoined(worker_id=wid, slots=slots, elastic=elastic, holds=holds)

    def kill(self, worker: WorkerId) -> WorkerLost:
        w = self.workers[worker]
        w.alive = False
        w.engine.clear()
        w.exporting.clear()
        return WorkerLost(worker_id=worker, reason="killed")

    def lose_lease(self, worker: WorkerId, group: GroupId, attempt: AttemptId) -> LeaseLost:
        """The lease's command never reached the worker (or its export's answer was lost): it holds nothing of it."""
        w = self.workers[worker]
        w.engine.remove(group, attempt)
        w.prefill_debt += w.engine.admit()
        if w.exporting.get(group, (None,))[0] == attempt:
            del w.exporting[group]
        return LeaseLost(worker_id=worker, group_id=group, attempt=attempt)

    def finish_load(self, worker: WorkerId) -> VersionLoaded:
        w = self.workers[worker]
        if w.loading is None:
            raise WorldError(f"{worker} is not loading")
        resumed = w.loading == w.loaded
        w.loaded, w.loading = w.loading, None
        if resumed:  # back from a yield under the same weights: what it held goes on (C1)
            w.prefill_debt += w.resume_debt
            self.reprefill_tokens += w.resume_debt
            w.resume_debt = 0
        elif len(w.engine) and w.holds == 1:  # partial: interrupted requests resume on the new weights after re-prefill
            tokens = w.engine.swap_weights(w.loaded)
            self.reprefill_tokens += tokens
            w.prefill_debt += tokens
        else:
            w.engine.version = w.loaded
        return VersionLoaded(worker_id=worker, version=w.loaded)

    def finish_yield(self, worker: WorkerId) -> Lent:
        w = self.workers[worker]
        if not w.yield_pending:
            raise WorldError(f"{worker} is not yielding")
        w.yield_pending = False
        return Lent(worker_id=worker)

    def finish_export(self, worker: WorkerId, group: GroupId) -> GroupExported:
        w = self.workers[worker]
        attempt, requests = w.exporting.pop(group)
        return GroupExported(worker_id=worker, group_id=group, attempt=attempt,
                                 n_requests=len(requests), state=requests)  # fmt: skip

    def steps_to_next(self, worker: WorkerId) -> float | None:
        w = self.workers[worker]
        return w.engine.steps_to_next() if w.decoding else None

    def decode(self, worker: WorkerId, steps: float) -> list[ResultsReported]:
        """The worker's running requests advance ``steps`` decode steps together (continuous batching); each sample
        that finishes is reported on its own."""
        w = self.workers[worker]
        if not w.decoding:
            return []
        if w.holds > 1 and not self.mixed_versions_allowed:
            unheld = {r.version for r in w.engine.running.values() if not w.serves(r.version)}
            if unheld:
                raise WorldError(
                    f"C1: {w.worker_id} decodes requests of versions {sorted(unheld, key=str)} it does not hold"
                )
        finished, prefill = w.engine.run_for(steps)
        w.prefill_debt += prefill
        for r in w.engine.take_turn_ends():
            if self.on_turn_end is not None:
                self.on_turn_end(worker, r)
            else:
                w.prefill_debt += w.engine.resume(r)
        if self.workload.multi_turn:
            for r in finished:
                self.episodes[(r.group_id, r.attempt, r.index)] = (len(r.ends) or 1, sum(r.observations))
        done = [
            ResultsReported(worker_id=worker, payloads=(r.attempt,), samples=(SampleResult(
                group_id=GroupId(r.group_id), attempt=AttemptId(r.attempt), index=r.index, segments=r.segments(),
                reward=self.workload.reward(r.group_id, r.index, r.attempt)),))
            for r in finished
        ]  # fmt: skip
        self.sent.extend(done)
        return done

    def tool_returned(self, r: Request) -> WorkerId | None:
        """An episode's tool result is back. It resumes on the worker holding it (returned), or on the worker
        a migration in transit takes it to; if its lease was voided meanwhile, nothing happens."""
        r.tool_back = True
        w = self.workers.get(r.holder) if r.holder is not None else None
        if w is None or not w.alive or not w.engine.is_parked(r):
            return None
        if self.before_change is not None:
            self.before_change(w.worker_id)
        w.prefill_debt += w.engine.resume(r)
        return w.worker_id

    def request_batch(self) -> BatchRequested:
        """The learner asks for its next batch: the one after the version it holds (one ahead of the published
        version while that one is being written)."""
        lr = self.learner
        lr.waiting = True
        return BatchRequested(step=lr.version + (lr.writing is not None))

    def finish_training(self) -> None:
        """The learner has trained its batch and starts writing the version in the background (at most one
        write at a time): it may ask for the next batch before that version is published."""
        lr = self.learner
        if lr.batch is None or lr.writing is not None:
            raise WorldError("a write starts without a trained batch, or beside another")
        lr.writing, lr.batch = lr.batch, None

    def publish(self) -> VersionPublished:
        """The version being written is durable (or, without a write in the background, the batch in training is
        trained and written): it is published, completing its batch."""
        lr = self.learner
        done = lr.writing or lr.batch
        if done is None:
            raise WorldError("publish without a batch")
        for g in done.groups:
            lr.trained.append(g.group_id)
            lr.staleness[done.step - g.version] += len(g.samples)
            self.tokens_trained += sum(n for s in g.samples for _, n in s.segments)
        if lr.writing is not None:
            lr.writing = None
        else:
            lr.batch = None
        lr.version += 1
        lr.steps += 1
        return VersionPublished(version=lr.version)

    def crash_learner(self) -> LearnerLost:
        """The learner dies mid-step (a write in flight is lost with it); it restarts from its last published
        version and asks again."""
        self.learner.batch = None
        self.learner.writing = None
        self.learner.waiting = False
        return LearnerLost(reason="killed")

    # ------------------------------------------------------------------ views

    def alive_workers(self) -> list[SimWorker]:
        return [w for w in self.workers.values() if w.alive]

    def busy(self) -> bool:
        """Anything in the fleet that can still make progress on its own."""
        return any(w.decoding or w.loading is not None or w.exporting or w.engine.parked or w.yield_pending
                   for w in self.alive_workers())  # fmt: skip
