"""Adaptive deadlines: each group gets the earliest deadline in [v + 1, v + K] that admission allows, and a
due group still running moves a step later (never past v + K) only when that lets a waiting trainer take its
batch now. K = 0 stays synchronous training, exactly."""

from __future__ import annotations

from dataclasses import replace

import pytest

from dora.config import CoreConfig
from dora.core import elastic
from dora.core.core import Core
from dora.core.events import (
    BatchRequested,
    DeliverBatch,
    Lease,
    Lend,
    Lent,
    Pin,
    Reclaim,
    VersionLoaded,
    VersionPublished,
    WorkerJoined,
)
from dora.ids import Mode
from dora.sim.des import Simulation
from tests.unit.machine import finished
from tests.unit.simcfg import small
from tests.unit.test_core import of


def done(core: Core, lease: Lease, now: float = 0.0) -> list:
    return core.handle(now, finished(worker_id=lease.worker_id, group_id=lease.group_id, attempt=lease.attempt,
                                         index=0, segments=((lease.version, 4),)))  # fmt: skip


def test_groups_get_the_earliest_admissible_deadline():
    core = Core(CoreConfig(mode=Mode.DORA, max_staleness=3, train_groups=1, group_size=1, deadlines="adaptive"))
    core.handle(0, WorkerJoined(worker_id="w", slots=8))
    leases = of(core.handle(0, VersionLoaded(worker_id="w", version=0)), Lease)
    deadlines = [core.scheduler.flights[x.group_id].deadline for x in leases]
    # (d - s + 1) x B groups fit under each deadline d: 2 by step 1, one more by each later step; K = 3 ends it
    assert deadlines == [1, 1, 2, 3]
    fixed = Core(CoreConfig(mode=Mode.DORA, max_staleness=3, train_groups=1, group_size=1))
    fixed.handle(0, WorkerJoined(worker_id="w", slots=8))
    leases = of(fixed.handle(0, VersionLoaded(worker_id="w", version=0)), Lease)
    assert [fixed.scheduler.flights[x.group_id].deadline for x in leases] == [3, 3, 3, 3], "the same admission room"


def test_a_running_due_group_moves_later_only_to_spare_the_trainer_a_wait():
    core = Core(CoreConfig(mode=Mode.DORA, max_staleness=2, train_groups=1, group_size=1, rollout_groups=2,
                           deadlines="adaptive"))  # fmt: skip
    core.handle(0, WorkerJoined(worker_id="w", slots=4))
    g0, g1 = of(core.handle(0, VersionLoaded(worker_id="w", version=0)), Lease)
    assert [core.scheduler.flights[x.group_id].deadline for x in (g0, g1)] == [1, 1]
    core.handle(0, BatchRequested(step=0))
    acts = done(core, g1, now=1.0)  # step 0 takes g1 (the trainer waited); g0 (deadline 1) still runs
    (b0,) = of(acts, DeliverBatch)
    (g2,) = of(acts, Lease)
    assert core.scheduler.flights[g2.group_id].deadline == 2, "step 1's room is g0's: the next deadline"
    core.handle(1, VersionPublished(version=1))
    assert not of(core.handle(1, BatchRequested(step=1)), DeliverBatch), "nothing finished: the trainer waits"
    assert core.scheduler.flights[g0.group_id].deadline == 1, "no move that does not help"
    (b1,) = of(done(core, g2, now=2.0), DeliverBatch)  # moving g0 to step 2 lets step 1 take g2 now
    assert [g.group_id for g in b1.groups] == [g2.group_id] and core.extended == 1
    assert core.scheduler.flights[g0.group_id].deadline == 2 == g0.version + 2, "never past v + K"
    core.handle(2, VersionPublished(version=2))
    core.handle(2, BatchRequested(step=2))
    assert core.transfer.waiting_on(core.ledger.deadline_counts()) == 1, "now step 2 must wait for g0"
    (b2,) = of(done(core, g0, now=3.0), DeliverBatch)
    assert g0.group_id in [g.group_id for g in b2.groups] and b0.step == 0


@pytest.mark.parametrize("elastic", [False, True])
def test_no_deadline_moves_where_taking_the_batch_would_pause_a_group_on_a_yielding_worker(elastic):
    """Worker e holds g0 (v0, due at step 1), and no other worker serves v0 then. When the next group finishes,
    moving g0 a step later would let step 1 take that group at once. A standalone e runs g0 on through the step,
    so the move is made; an elastic e would yield for the batch with g0 paused on it (no worker of v0 to hand it
    to), so the trainer waits for g0 instead."""
    core = Core(CoreConfig(mode=Mode.DORA, max_staleness=2, train_groups=1, group_size=1, rollout_groups=2,
                           deadlines="adaptive"))  # fmt: skip
    core.handle(0, WorkerJoined(worker_id="e", slots=2, elastic=elastic))
    g0, g1 = of(core.handle(0, VersionLoaded(worker_id="e", version=0)), Lease)
    core.handle(0, WorkerJoined(worker_id="s", slots=1))
    core.handle(0, BatchRequested(step=0))
    acts = done(core, g1, now=1.0)  # step 0 takes g1; an elastic e yields for it, holding g0 (s has no weights)
    if elastic:
        assert of(acts, Lend) and not of(acts, DeliverBatch)
        acts += core.handle(1.0, Lent(worker_id="e"))
    assert [g.group_id for g in of(acts, DeliverBatch)[0].groups] == [g1.group_id]
    acts += core.handle(1.0, VersionPublished(version=1))
    assert [a.worker_id for a in of(acts, Pin)] == ["s"] and len(of(acts, Reclaim)) == elastic
    acts += core.handle(1.0, VersionLoaded(worker_id="s", version=1))
    (g2,) = of(acts, Lease)  # e's free slot on v0 while it stays, or s on v1
    assert g2.worker_id == ("s" if elastic else "e")
    core.handle(1.0, BatchRequested(step=1))
    acts = done(core, g2, now=2.0)
    if not elastic:
        assert [g.group_id for g in of(acts, DeliverBatch)[0].groups] == [g2.group_id] and core.extended == 1
        assert core.scheduler.flights[g0.group_id].deadline == 2
        return
    assert not of(acts, Lend) and not of(acts, DeliverBatch) and core.extended == 0, "no move that pauses g0"
    assert core.scheduler.flights[g0.group_id].deadline == 1
    acts = done(core, g0, now=3.0)  # step 1 takes g0 at its deadline, e yields with nothing left to pause
    assert of(acts, Lend) and not of(acts, DeliverBatch)
    assert [g.group_id for g in of(core.handle(3.0, Lent(worker_id="e")), DeliverBatch)[0].groups] == [g0.group_id]


@pytest.mark.parametrize("mode", [Mode.DORA, Mode.PARTIAL])
def test_a_group_that_a_peer_of_its_version_has_room_for_pauses_only_where_nothing_is_handed_over(mode):
    """Elastic e runs g0 on v0 beside a standalone s of v0 with free slots. Yielding for a batch, e hands g0 to s
    (dora), so a deadline may move to take the batch early. In partial mode a yield hands nothing over (the
    publish swaps every worker's weights anyway): g0 would wait on e through the step, so no deadline moves for it.
    (Found by tests/unit/test_core_properties.py: partial mode, adaptive deadlines, an elastic worker.)"""
    core = Core(CoreConfig(mode=mode, max_staleness=2, train_groups=1, group_size=1, rollout_groups=1,
                           deadlines="adaptive"))  # fmt: skip
    core.handle(0, WorkerJoined(worker_id="e", slots=2, elastic=True))
    (g0,) = of(core.handle(0, VersionLoaded(worker_id="e", version=0)), Lease)
    core.handle(0, WorkerJoined(worker_id="s", slots=2))
    assert not of(core.handle(0, VersionLoaded(worker_id="s", version=0)), Lease), "one group in flight at most"
    assert elastic.would_pause(core) == (mode is Mode.PARTIAL), g0


def run(cfg, mode: Mode, deadlines: str):
    c = replace(cfg, core=replace(cfg.core, deadlines=deadlines))
    return Simulation(c, mode, strict=True).run()


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.DORA])
@pytest.mark.parametrize("placement", ["disaggregated", "colocated"])
def test_k0_is_synchronous_training_exactly_under_either_rule(mode, placement):
    cfg = small(workers=4, credit=8, steps=6, k=0, train_groups=4, group_size=2, sigma=1.5, seed=3,
                placement={m.value: placement for m in Mode})  # fmt: skip
    fixed, adaptive = run(cfg, mode, "fixed"), run(cfg, mode, "adaptive")
    assert (adaptive.wall_s, adaptive.trained, adaptive.staleness) == (fixed.wall_s, fixed.trained, fixed.staleness)
    assert set(adaptive.staleness) == {0}


def test_a_fleet_that_keeps_up_trains_fresher_data_under_adaptive_deadlines():
    cfg = small(workers=8, credit=16, steps=12, k=3, train_groups=4, group_size=4, sigma=1.0, seed=7, train_s=4.0)
    fixed, adaptive = run(cfg, Mode.DORA, "fixed"), run(cfg, Mode.DORA, "adaptive")

    def mean(hist):
        return sum(k * n for k, n in hist.items()) / sum(hist.values())

    assert max(adaptive.staleness) <= 3 and max(fixed.staleness) <= 3
    assert mean(adaptive.staleness) < mean(fixed.staleness)
