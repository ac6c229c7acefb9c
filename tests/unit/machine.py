"""Drive the pure core and the world model together, one event at a time, checking everything.

Shared by the stateful property test (hypothesis picks the next event) and the mutation check.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from dora.config import CoreConfig
from dora.core.core import Core
from dora.core.events import Action, DeliverBatch, Event, ResultsReported, Retire, SampleResult, Segments, Tick
from dora.ids import AttemptId, Finish, GroupId, WorkerId
from dora.sim.workload import Workload
from dora.sim.world import World


def finished(
    *,
    worker_id: str,
    group_id: int,
    attempt: int,
    index: int,
    segments: Segments,
    finish: Finish = Finish.STOP,
    reward: float | None = None,
    payload: object = None,
) -> ResultsReported:
    """One finished sample, reported alone."""
    sample = SampleResult(group_id=GroupId(group_id), attempt=AttemptId(attempt), index=index, segments=segments,
                          finish=finish, reward=reward)  # fmt: skip
    return ResultsReported(worker_id=WorkerId(worker_id), samples=(sample,), payloads=(payload,))


def together(reports: list[ResultsReported]) -> ResultsReported:
    """Reports of one worker as one report of all their samples, in order (the form a worker's message takes)."""
    return ResultsReported(
        worker_id=reports[0].worker_id,
        samples=tuple(s for r in reports for s in r.samples),
        payloads=tuple(x for r in reports for x in r.payloads),
    )


@dataclass
class Harness:
    cfg: CoreConfig
    slots: int
    workload: Workload
    core: Core = field(init=False)
    world: World = field(init=False)
    now: float = 0.0
    events: int = 0
    max_alive: int = 0
    kept_max: int = 0
    """The most versions one worker served at once (pinned and kept)."""
    delivered: list[DeliverBatch] = field(default_factory=list)
    retired: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.core = Core(self.cfg, strict=True)
        self.world = World(
            group_size=self.cfg.group_size,
            train_groups=self.cfg.train_groups,
            max_staleness=self.cfg.staleness,
            workload=self.workload,
            mixed_versions_allowed=self.cfg.in_flight_swap,
        )

    def feed(self, event: Event) -> list[Action]:
        self.now += 1.0
        self.events += 1
        actions = self.core.handle(self.now, event)
        self.world.apply(actions)
        for a in actions:
            if isinstance(a, DeliverBatch) and not a.redelivery:
                self.delivered.append(a)
                self._check_filtered(a)
            elif isinstance(a, Retire):
                self.retired.append(a.version)
        self.max_alive = max(self.max_alive, len(self.core.ledger.alive()))
        led = self.core.ledger
        for w in self.core.multi:
            self.kept_max = max(self.kept_max, 1 + len(led.kept_by(w)))
        return actions

    def uniform(self, group: int) -> bool:
        """Whether the group's latest attempt gave every sample the same reward (as the world drew them)."""
        attempt = self.world.attempts[group]
        return len({self.workload.reward(group, i, attempt) for i in range(self.cfg.group_size)}) == 1

    def _check_filtered(self, batch: DeliverBatch) -> None:
        """With filtering, a batch holds a uniform group only once its step has filtered as many as it may."""
        if not self.cfg.filter_uniform:
            return
        flat = [g.group_id for g in batch.groups if self.uniform(g.group_id)]
        filtered = self.core.filtered_with(batch.step)
        assert not flat or len(filtered) == self.cfg.filter_cap, (
            f"batch {batch.step} trains uniform groups {flat} with {len(filtered)} filtered, cap {self.cfg.filter_cap}"
        )

    def feed_all(self, events: list[ResultsReported]) -> None:
        for ev in events:
            self.feed(ev)

    # --------------------------------------------------------------- the environment's moves

    def progress_possible(self) -> bool:
        """Something can still happen without a new worker joining (used for the liveness check)."""
        lr = self.world.learner
        if lr.finished:
            return True
        if lr.batch is not None or lr.writing is not None or not lr.waiting:
            return True
        return self.world.busy()

    def step_once(self) -> bool:
        """Make the one most natural move; False if nothing can move (deadlock unless finished)."""
        lr = self.world.learner
        if lr.finished:
            return False
        if lr.batch is not None or lr.writing is not None:
            self.feed(self.world.publish())
            return True
        if not lr.waiting:
            self.feed(self.world.request_batch())
            return True
        for w in self.world.alive_workers():
            if w.yield_pending:
                self.feed(self.world.finish_yield(w.worker_id))
                return True
            if w.loading is not None:
                self.feed(self.world.finish_load(w.worker_id))
                return True
            if w.exporting:
                self.feed(self.world.finish_export(w.worker_id, next(iter(w.exporting))))
                return True
        due = [
            (s, w.worker_id)
            for w in self.world.alive_workers()
            if (s := self.world.steps_to_next(w.worker_id)) is not None
        ]
        if due:
            need, worker = min(due)
            self.feed_all(self.world.decode(worker, need + 1e-9))
            self.feed(Tick())
            return True
        if not self.world.alive_workers():
            self.feed(self.world.join(self.slots))
            return True
        return False

    def drain(self, limit: int = 200_000) -> None:
        """Run to the end of the run; fail on deadlock or on a run that does not end."""
        for _ in range(limit):
            if not self.step_once():
                break
        lr = self.world.learner
        assert lr.finished, (
            f"deadlock at step {self.core.step}: learner waiting={lr.waiting}, "
            f"flights={len(self.core.scheduler.flights)}, queued={len(self.core.scheduler.queue)}, "
            f"finished={len(self.core.transfer)}, "
            f"workers={[(w.worker_id, w.loaded, len(w.requests)) for w in self.world.alive_workers()]}"
        )

    def check_end(self) -> None:
        """C2 over the whole run: every group of the run trained exactly once, in whole batches, or filtered
        exactly once (its rewards all equal), and nothing else dispatched."""
        total = self.cfg.prompt_budget
        assert total is not None
        trained = self.world.learner.trained
        filtered = self.core.transfer.filtered
        assert len(trained) == len(set(trained)), "a group was trained twice"
        assert len(filtered) == len(set(filtered)), "a group was filtered twice"
        assert not set(trained) & set(filtered), "a group was filtered and trained"
        assert sorted(trained + filtered) == list(range(total + len(filtered))), "a dispatched group was lost"
        assert self.core.scheduler.cursor == total + len(filtered), "more groups dispatched than consumed"
        assert all(self.uniform(g) for g in filtered), "a group with a signal was filtered"
        assert len(filtered) <= self.cfg.filter_cap * self.cfg.total_steps  # type: ignore[operator]
        assert self.world.learner.steps == self.cfg.total_steps
        assert max(self.world.learner.staleness, default=0) <= self.cfg.staleness
        assert self.max_alive <= self.cfg.staleness + 1
