"""Filtering that refills (``core.filter_uniform``): a group whose rewards are all equal is consumed as filtered
when it finishes, counted once, never trained and never lost; the batch fills with other whole groups, the run
dispatches one more group for each, and a step filters at most its cap (then uniform groups are trained)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import pytest

from dora.config import ConfigError, CoreConfig
from dora.core.core import Core
from dora.core.events import (
    BatchRequested,
    DeliverBatch,
    Lease,
    Pin,
    RunFinished,
    VersionLoaded,
    VersionPublished,
    WorkerJoined,
)
from dora.ids import Mode
from tests.unit.machine import finished, together
from tests.unit.test_core import of


@dataclass
class Run:
    """One worker and the learner around a strict core; ``flat(group, attempt)``: that lease's rewards are all
    equal. Leases are finished in the order they came (oldest first) unless told otherwise."""

    core: Core
    flat: Callable[[int, int], bool]
    leases: list[Lease]
    batches: list[DeliverBatch]
    filtered: dict[int, list[int]]
    """step -> the groups filtered in its window, as the broker reads them when it journals the step."""
    finished: bool = False

    def handle(self, event) -> list:
        acts = self.core.handle(0, event)
        self.leases += of(acts, Lease)
        for b in of(acts, DeliverBatch):
            self.batches.append(b)
            self.filtered[b.step] = self.core.filtered_with(b.step)
        self.finished |= bool(of(acts, RunFinished))
        for a in of(acts, Pin):
            self.handle(VersionLoaded(worker_id=a.worker_id, version=a.version))
        return acts

    def finish(self, lease: Lease) -> list:
        self.leases.remove(lease)
        rewards = [1.0] * lease.n_samples if self.flat(lease.group_id, lease.attempt) else [0.0, 1.0] * lease.n_samples
        return self.handle(together([
            finished(worker_id=lease.worker_id, group_id=lease.group_id, attempt=lease.attempt, index=i,
                     segments=((lease.version, 3),), reward=rewards[i])
            for i in range(lease.n_samples)
        ]))  # fmt: skip

    def to_end(self, limit: int = 1000) -> None:
        """Learner: ask, train, publish; workers: finish the oldest lease whenever the learner waits."""
        for _ in range(limit):
            if self.finished:
                return
            if self.core.transfer.in_training is not None:
                self.handle(VersionPublished(version=self.core.transfer.in_training.step + 1))
            elif not self.core.learner_waiting:
                self.handle(BatchRequested(step=self.core.step))
            else:
                self.finish(self.leases[0])
        raise AssertionError("the run did not end")

    def trained(self) -> list[int]:
        return [g.group_id for b in self.batches for g in b.groups]


def start(flat: Callable[[int, int], bool], slots: int = 64, **kw) -> Run:
    base = dict(mode=Mode.DORA, max_staleness=1, train_groups=2, group_size=2, total_steps=3, filter_uniform=True)
    run = Run(core=Core(CoreConfig(**{**base, **kw}), strict=True), flat=flat, leases=[], batches=[], filtered={})
    run.handle(WorkerJoined(worker_id="a", slots=slots))
    return run


def test_a_uniform_group_is_filtered_once_and_the_batch_fills_with_other_whole_groups():
    run = start(lambda g, a: g == 0)
    assert [x.group_id for x in run.leases] == [0, 1, 2, 3]  # (K + 1) x B groups: admission's whole room
    run.finish(run.leases[0])  # group 0: every sample got the same reward
    assert run.core.transfer.filtered == [0] and run.core.filtered_with(0) == [0]
    assert [x.group_id for x in run.leases] == [1, 2, 3, 4], "its room went to one more group at once"
    run.handle(BatchRequested(step=0))
    run.finish(run.leases[0])
    run.finish(run.leases[0])
    (batch,) = run.batches
    assert [g.group_id for g in batch.groups] == [1, 2] and all(len(g.samples) == 2 for g in batch.groups)
    run.to_end()
    assert sorted(run.trained()) == [1, 2, 3, 4, 5, 6] and run.core.transfer.filtered == [0]
    assert run.core.scheduler.cursor == 3 * 2 + 1, "the prompt budget grew by the one group filtered, no more"


def test_a_uniform_group_due_now_is_filtered_and_the_batch_waits_for_its_replacement():
    """K = 0 (sync): the wave is the batch. The group due at step 0 that comes back uniform is filtered, not
    trained; a refill is leased on the same version with the same deadline, and the batch takes it."""
    run = start(lambda g, a: g == 1, mode=Mode.SYNC, max_staleness=0, total_steps=2)
    run.handle(BatchRequested(step=0))
    assert [(x.group_id, x.version) for x in run.leases] == [(0, 0), (1, 0)]
    run.finish(run.leases[0])
    acts = run.finish(run.leases[0])  # group 1, uniform: the batch must not take it
    assert not of(acts, DeliverBatch) and run.core.transfer.filtered == [1]
    assert [(x.group_id, x.version) for x in of(acts, Lease)] == [(2, 0)], "the refill, on the batch's version"
    assert run.core.ledger.deadline_counts() == {0: 2}, "the feasibility invariant counts the refill, not group 1"
    (batch,) = of(run.finish(run.leases[0]), DeliverBatch)
    assert [g.group_id for g in batch.groups] == [0, 2] and batch.step == 0
    run.to_end()
    assert sorted(run.trained()) == [0, 2, 3, 4] and run.core.transfer.filtered == [1]


def test_a_group_filtered_frees_room_under_the_deadline_rule_and_never_overruns_k():
    """Every group due at step 1 comes back uniform while the learner waits on them: each is filtered, the room
    it frees is leased again, and step 1 takes later groups, each within K of its version."""
    run = start(lambda g, a: g in (2, 3), total_steps=3)
    run.to_end()
    assert run.core.transfer.filtered == [2, 3]
    assert sorted(run.trained()) == [0, 1, 4, 5, 6, 7]
    for b in run.batches:
        for g in b.groups:
            assert g.version <= b.step <= g.deadline <= g.version + 1


@pytest.mark.parametrize("cap", [1, 3])
def test_a_run_whose_groups_all_come_back_uniform_filters_its_cap_per_step_then_trains_them(cap):
    """A solved task: every group uniform. Each step filters ``cap`` groups, then trains uniform ones (zero
    advantage), so the run ends having dispatched total_steps x (train_groups + cap) groups."""
    run = start(lambda g, a: True, max_filtered=cap, total_steps=4)
    run.to_end()
    assert len(run.batches) == 4 and all(len(b.groups) == 2 for b in run.batches)
    assert len(run.core.transfer.filtered) == 4 * cap
    assert [len(run.filtered[s]) for s in range(4)] == [cap] * 4
    consumed = sorted(run.trained() + run.core.transfer.filtered)
    assert consumed == list(range(4 * (2 + cap))) == list(range(run.core.scheduler.cursor))


def test_the_cap_defaults_to_four_batches_and_filtering_off_trains_uniform_groups_as_before():
    assert CoreConfig(train_groups=3, filter_uniform=True).filter_cap == 12
    assert CoreConfig(train_groups=3, filter_uniform=True, max_filtered=5).filter_cap == 5
    assert CoreConfig(train_groups=3).filter_cap == 0
    with pytest.raises(ConfigError, match="max_filtered must be an integer >= 1"):
        CoreConfig(max_filtered=0)
    run = start(lambda g, a: True, filter_uniform=False)
    run.to_end()
    assert sorted(run.trained()) == list(range(6)) and run.core.transfer.filtered == []


def test_a_group_re_run_after_a_bad_sample_is_judged_on_its_new_samples_alone():
    """Rewards are kept per lease: a re-run's samples decide, not the ones its failed attempt left."""
    run = start(lambda g, a: True, total_steps=1, group_size=2)
    lease = run.leases[0]
    run.handle(finished(worker_id="a", group_id=lease.group_id, attempt=lease.attempt, index=0,
                              segments=((0, 3),), reward=1.0))  # fmt: skip
    # the second sample holds a token of another version: the group re-runs whole
    run.handle(finished(worker_id="a", group_id=lease.group_id, attempt=lease.attempt, index=1,
                              segments=((5, 3),), reward=1.0))  # fmt: skip
    (again,) = [x for x in run.leases if x.group_id == lease.group_id and x.attempt != lease.attempt]
    for i, reward in enumerate((1.0, 0.0)):
        run.handle(finished(worker_id="a", group_id=again.group_id, attempt=again.attempt, index=i,
                                  segments=((0, 3),), reward=reward))  # fmt: skip
    assert lease.group_id not in run.core.transfer.filtered
    assert [f.group.group_id for q in run.core.transfer._by_deadline.values() for f in q] == [lease.group_id]


def test_a_sample_without_a_reward_never_makes_its_group_uniform():
    run = start(lambda g, a: True, total_steps=1)
    lease = run.leases[0]
    for i in range(2):
        run.handle(finished(worker_id="a", group_id=lease.group_id, attempt=lease.attempt, index=i,
                                  segments=((0, 3),)))  # fmt: skip
    assert run.core.transfer.filtered == [] and len(run.core.transfer) == 1


def test_a_restarted_core_counts_the_groups_filtered_before_it_in_its_budget():
    """The journal's filtered groups move the budget: every owed id is kept, in order, for it to reach."""
    core = Core(CoreConfig(train_groups=2, group_size=1, total_steps=2, filter_uniform=True), start_cursor=8,
                initial_version=1, strict=True)  # fmt: skip
    assert core.restore([3, 5, 6, 7], filtered=2) == 2  # ids >= 2 x 2 + 2: past the budget as it stands
    assert list(core.scheduler.owed) == [3, 5, 6, 7]
    acts = core.handle(0, WorkerJoined(worker_id="a", slots=8))
    core.handle(0, VersionLoaded(worker_id="a", version=of(acts, Pin)[0].version))
    assert sorted(g for g in core.scheduler.flights) == [3, 5], "ids below 2 x 2 + 2 only"
    plain = Core(CoreConfig(train_groups=2, group_size=1, total_steps=2), start_cursor=8, initial_version=1)
    assert plain.restore([3, 5, 6, 7]) == 3 and list(plain.scheduler.owed) == [3]
