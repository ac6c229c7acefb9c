"""Discrete-event simulation: the production core driven by the world model on a virtual clock.

Timing model (all parameters in ``Timing``):
- a worker decodes all its running requests together (continuous batching); one decode step takes
  ``tpot_base_s + tpot_per_seq_s * running`` seconds, so a lone straggler costs almost as much per
  token as a full batch (memory-bound decode);
- requests that must be re-prefilled (partial mode after a weight swap) first cost
  ``prefill_per_token_s`` per token already generated;
- loading a new version takes ``load_s``; exporting a migrated group takes ``export_s``;
- the learner trains a batch in ``train_fixed_s + train_per_token_s * tokens`` and then publishes.

Rollout workers and the learner are separate resources (disaggregated placement). The core makes
every decision; this module only advances time.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter, deque
from dataclasses import dataclass, field

from dora.broker.core import Core
from dora.broker.events import (
    Action,
    Assign,
    Cancel,
    DeliverBatch,
    Event,
    Lease,
    MigrateIn,
    MigrateOut,
    Tick,
)
from dora.config import CoreConfig
from dora.ids import Mode, WorkerId
from dora.sim.world import Lengths, World


@dataclass(frozen=True, slots=True, kw_only=True)
class Timing:
    tpot_base_s: float = 0.02
    tpot_per_seq_s: float = 0.0001
    prefill_per_token_s: float = 0.0002
    load_s: float = 1.0
    export_s: float = 0.05
    train_fixed_s: float = 2.0
    train_per_token_s: float = 0.0
    tick_s: float = 2.0

    def step_s(self, running: int) -> float:
        return self.tpot_base_s + self.tpot_per_seq_s * running


@dataclass(slots=True)
class Result:
    mode: Mode
    staleness_bound: int
    wall_s: float
    steps: int
    tokens: int
    learner_idle_s: float
    staleness: Counter[int]
    c1_violations: int
    trained: list[int]
    expected_groups: int
    migrated_requests: int
    requeued: int
    max_live_versions: int
    step_times: list[float] = field(default_factory=list)

    @property
    def throughput(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def c2_ok(self) -> bool:
        return sorted(self.trained) == list(range(self.expected_groups))

    @property
    def max_staleness(self) -> int:
        return max((k for k, n in self.staleness.items() if n), default=0)

    @property
    def mean_staleness(self) -> float:
        n = sum(self.staleness.values())
        return sum(k * v for k, v in self.staleness.items()) / n if n else 0.0


class Simulation:
    """One run of one mode.

    ``deaths``: (time_s, worker index) kills; each killed worker is replaced after ``restart_s``.
    """

    def __init__(
        self,
        cfg: CoreConfig,
        *,
        workers: int,
        slots: int,
        timing: Timing | None = None,
        lengths: Lengths | None = None,
        deaths: tuple[tuple[float, int], ...] = (),
        restart_s: float = 1.0,
        strict: bool = False,
    ) -> None:
        if cfg.total_steps is None:
            raise ValueError("a simulation needs total_steps")
        self.cfg = cfg
        self.timing = timing or Timing()
        self.core = Core(cfg, strict=strict)
        self.world = World(
            group_size=cfg.group_size,
            train_groups=cfg.train_groups,
            max_staleness=cfg.staleness,
            lengths=lengths or Lengths(),
            mixed_versions_allowed=cfg.mode is Mode.PARTIAL,
        )
        self.n_workers = workers
        self.slots = slots
        self.restart_s = restart_s
        self.now = 0.0
        self._queue: list[tuple[float, int, str, object]] = []
        self._pending_work = 0
        """Queued events other than the timer; when none is left the run can no longer change."""
        self._seq = itertools.count()
        self._last: dict[WorkerId, float] = {}
        self._debt_s: dict[WorkerId, float] = {}
        self._epoch: dict[WorkerId, int] = {}
        self._inbox: deque[Event] = deque()
        self._touched: set[WorkerId] = set()
        self._feeding = False
        self.world.before_change = self._advance
        self._idle_since: float | None = 0.0
        self.learner_idle_s = 0.0
        self.max_alive = 1
        self.step_times: list[float] = []
        self._step_started = 0.0
        for t, idx in deaths:
            self._at(t, "kill", idx)

    # ------------------------------------------------------------------ plumbing

    def _at(self, t: float, kind: str, arg: object = None) -> None:
        heapq.heappush(self._queue, (t, next(self._seq), kind, arg))
        self._pending_work += kind != "tick"

    def _feed(self, event: Event | None) -> None:
        """Hand an event to the core; events it causes at the same instant are queued, not nested."""
        if event is not None:
            self._inbox.append(event)
        if self._feeding:
            return
        self._feeding = True
        try:
            while self._inbox or self._touched:
                while self._inbox:
                    actions = self.core.handle(self.now, self._inbox.popleft())
                    self.world.apply(actions)
                    self._react(actions)
                    self.max_alive = max(self.max_alive, len(self.core.ledger.alive()))
                touched, self._touched = self._touched, set()
                for w in sorted(touched):
                    self._reschedule(w)
        finally:
            self._feeding = False

    def _react(self, actions: list[Action]) -> None:
        for a in actions:
            match a:
                case Lease() | MigrateIn() | Cancel():
                    self._touched.add(a.worker_id)
                case Assign():
                    self._at(self.now + self.timing.load_s, "loaded", (a.worker_id, a.version))
                    self._touched.add(a.worker_id)
                case MigrateOut():
                    self._at(self.now + self.timing.export_s, "export", (a.worker_id, a.group_id))
                    self._touched.add(a.worker_id)
                case DeliverBatch(redelivery=False):
                    if self._idle_since is not None:
                        self.learner_idle_s += self.now - self._idle_since
                        self._idle_since = None
                    tokens = sum(n for g in a.groups for s in g.samples for _, n in s.segments)
                    self._at(self.now + self.timing.train_fixed_s + self.timing.train_per_token_s * tokens, "trained")

    def _decoding(self, worker: WorkerId) -> bool:
        w = self.world.workers[worker]
        return w.alive and w.loading is None and bool(w.requests)

    def _advance(self, worker: WorkerId) -> None:
        """Bring one worker's decoding up to ``now``; its finished samples go to the inbox."""
        last = self._last.get(worker, self.now)
        self._last[worker] = self.now
        w = self.world.workers[worker]
        if w.prefill_debt:
            self._debt_s[worker] = self._debt_s.get(worker, 0.0) + w.prefill_debt * self.timing.prefill_per_token_s
            w.prefill_debt = 0
        if not self._decoding(worker) or self.now <= last:
            return
        dt = self.now - last
        debt = self._debt_s.get(worker, 0.0)
        pay = min(debt, dt)
        self._debt_s[worker] = debt - pay
        tokens = (dt - pay) / self.timing.step_s(len(w.requests))
        self._inbox.extend(self.world.decode(worker, tokens + 1e-7))
        self._touched.add(worker)

    def _reschedule(self, worker: WorkerId) -> None:
        self._advance(worker)
        self._epoch[worker] = self._epoch.get(worker, 0) + 1
        if not self._decoding(worker):
            return
        w = self.world.workers[worker]
        remaining = min(r.length - r.generated for r in w.requests)
        t = self.now + self._debt_s.get(worker, 0.0) + remaining * self.timing.step_s(len(w.requests))
        self._at(t, "decode", (worker, self._epoch[worker]))

    # ------------------------------------------------------------------ run

    def run(self, max_events: int = 5_000_000) -> Result:
        for _ in range(self.n_workers):
            self._feed(self.world.join(self.slots))
        self._feed(self.world.request_batch())
        self._at(self.timing.tick_s, "tick")
        for _ in range(max_events):
            if self.world.learner.finished or not self._queue:
                break
            if not self._pending_work:
                break  # only the timer is left: nothing will ever change again
            self.now, _, kind, arg = heapq.heappop(self._queue)
            self._pending_work -= kind != "tick"
            self._dispatch(kind, arg)
        if not self.world.learner.finished:
            raise RuntimeError(
                f"simulation of {self.cfg.mode} stopped at step {self.core.step} with no event left (deadlock)"
            )
        lr = self.world.learner
        return Result(
            mode=self.cfg.mode,
            staleness_bound=self.cfg.staleness,
            wall_s=self.now,
            steps=lr.steps,
            tokens=self.world.tokens_trained,
            learner_idle_s=self.learner_idle_s,
            staleness=lr.staleness,
            c1_violations=lr.c1_violations,
            trained=list(lr.trained),
            expected_groups=self.cfg.prompt_budget or 0,
            migrated_requests=self.world.migrated_requests,
            requeued=self.core.scheduler.stats_requeued,
            max_live_versions=self.max_alive,
            step_times=self.step_times,
        )

    def _dispatch(self, kind: str, arg: object) -> None:
        match kind:
            case "decode":
                worker, epoch = arg  # type: ignore[misc]
                if self._epoch.get(worker) == epoch:
                    self._touched.add(worker)  # rescheduling catches its clock up first
                    self._feed(None)
            case "loaded":
                worker, version = arg  # type: ignore[misc]
                w = self.world.workers[worker]
                if w.alive and w.loading == version:
                    self._feed(self.world.finish_load(worker))
                    self._touched.add(worker)
                    self._feed(None)
            case "export":
                worker, group = arg  # type: ignore[misc]
                w = self.world.workers[worker]
                if w.alive and group in w.exporting:
                    self._feed(self.world.finish_export(worker, group))
            case "trained":
                self.step_times.append(self.now - self._step_started)
                self._step_started = self.now
                self._feed(self.world.publish())
                if not self.world.learner.finished:
                    self._idle_since = self.now
                    self._feed(self.world.request_batch())
            case "tick":
                for w in self.world.alive_workers():
                    self._touched.add(w.worker_id)
                self._feed(Tick())
                self._at(self.now + self.timing.tick_s, "tick")
            case "kill":
                live = self.world.alive_workers()
                if live:
                    victim = live[int(arg) % len(live)]  # type: ignore[call-overload]
                    self._advance(victim.worker_id)
                    self._feed(self.world.kill(victim.worker_id))
                    self._at(self.now + self.restart_s, "join")
            case "join":
                self._feed(self.world.join(self.slots))
