"""Multi-version workers in the core (LoRA: one engine holds several adapter versions).

A worker that holds several versions takes a new one while groups of older ones still run on it, and keeps
serving those (C1 per group: each runs to its end under the version it was leased on). A kept version leaves
the worker with its last group, and only then may retire. A full-weight worker (holds 1) drains first, as before.
"""

from __future__ import annotations

from dora.core import orchestrator
from dora.core.core import Core
from dora.core.events import (
    BatchRequested,
    Lease,
    Pin,
    Retire,
    Tick,
    VersionLoaded,
    VersionPublished,
    WorkerJoined,
)
from dora.core.ledger import VersionState
from dora.core.orchestrator import WorkerView
from tests.unit.test_core import cfg, finish, of


def join(core: Core, worker: str, *, slots: int = 4, holds: int = 1) -> list:
    (assign,) = of(core.handle(0, WorkerJoined(worker_id=worker, slots=slots, holds=holds)), Pin)
    return core.handle(0, VersionLoaded(worker_id=worker, version=assign.version))


def train_one(core: Core, lease: Lease) -> list:
    """The learner takes the one-group batch made of ``lease``'s group and publishes the next version."""
    finish(core, lease)
    step = core.step
    core.handle(0, BatchRequested(step=step))
    return core.handle(0, VersionPublished(version=step + 1))


def test_a_multi_version_worker_takes_the_new_version_beside_a_running_group_and_serves_both():
    core = Core(cfg(max_staleness=2, rollout_groups=2))
    first, second = of(join(core, "a", holds=3), Lease)
    assert first.version == second.version == 0
    finish(core, first)  # the watermark refills on v0, the newest yet
    assert not of(core.handle(0, Tick()), Lease)  # the refill came with the finish: two v0 groups run
    assert sorted(core.scheduler.workers["a"].groups) == [second.group_id, second.group_id + 1]
    core.handle(0, BatchRequested(step=0))
    (assign,) = of(core.handle(0, VersionPublished(version=1)), Pin)  # v0 groups still run on "a"
    assert (assign.worker_id, assign.version, assign.keep) == ("a", 1, (0,))
    assert core.ledger.holds("a", 0) and core.ledger.holds("a", 1)
    core.handle(0, VersionLoaded(worker_id="a", version=1))
    acts = finish(core, second)
    (lease,) = of(acts, Lease)
    assert (lease.worker_id, lease.version) == ("a", 1)  # new work on v1 beside the v0 group still running
    assert core.ledger.holds("a", 0)
    flight = core.scheduler.flights[second.group_id + 1]
    assert flight.version == 0 and flight.worker == "a"  # it runs on to its end under v0 (C1)
    finish(core, Lease(worker_id="a", group_id=flight.group_id, attempt=flight.attempt, version=0, n_samples=1))
    assert not core.ledger.holds("a", 0)  # version 0 left the worker with its last group
    retired = []
    for step in (1, 2):  # both v0 groups are trained (one per batch); then no group or worker holds version 0
        acts = core.handle(0, BatchRequested(step=step)) + core.handle(0, VersionPublished(version=step + 1))
        retired += [r.version for r in of(acts, Retire)]
    assert 0 in retired


def test_a_full_weight_worker_with_a_running_group_is_not_told_to_change_version():
    core = Core(cfg(max_staleness=2, rollout_groups=2))
    first, _ = of(join(core, "a", holds=1), Lease)
    acts = train_one(core, first)
    assert not of(acts, Pin)  # it drains its v0 groups first
    assert core.ledger.version_of("a") == 0 and not core.ledger.kept_by("a")


def test_a_kept_version_is_alive_until_its_last_group_leaves_the_worker():
    core = Core(cfg(max_staleness=1, rollout_groups=2))
    first, _ = of(join(core, "a", holds=2), Lease)
    train_one(core, first)
    core.handle(0, VersionLoaded(worker_id="a", version=1))
    assert core.ledger.state(0) is not VersionState.RETIRED
    assert set(core.ledger.keepers(0)) == {"a"}


def test_a_worker_with_too_few_adapter_slots_waits_for_its_groups_before_it_moves():
    core = Core(cfg(max_staleness=2, rollout_groups=2))
    first, _ = of(join(core, "a", slots=6, holds=2), Lease)
    acts = train_one(core, first)  # v1 comes while two v0 groups run: "a" keeps v0
    assert of(acts, Pin)[0].keep == (0,)
    core.handle(0, VersionLoaded(worker_id="a", version=1))
    v0 = [core.scheduler.flights[g] for g in sorted(core.scheduler.workers["a"].groups)]
    finish(core, Lease(worker_id="a", group_id=v0[0].group_id, attempt=v0[0].attempt, version=0, n_samples=1))
    v1 = [f for f in core.scheduler.flights.values() if f.version == 1]
    assert v1 and all(f.worker == "a" for f in v1)
    core.handle(0, BatchRequested(step=1))
    acts = core.handle(0, VersionPublished(version=2))  # v2 while v0 and v1 both run there: it holds two
    assert not of(acts, Pin) and core.ledger.version_of("a") == 1
    last = v0[1]
    acts = finish(core, Lease(worker_id="a", group_id=last.group_id, attempt=last.attempt, version=0, n_samples=1))
    (assign,) = of(acts, Pin)  # v0's last group ended: now it can keep v1 and take v2
    assert (assign.version, assign.keep) == (2, (1,))


def test_the_plan_hands_a_leaving_workers_groups_to_a_worker_that_keeps_their_version():
    leaving = WorkerView(worker_id="f0", version=0, free=0, groups=((7, 1),), settled=True, order=1)
    staying = WorkerView(worker_id="f1", version=0, free=0, groups=((8, 2),), settled=True, order=2)
    keeper = WorkerView(worker_id="lora", version=0, free=6, groups=((9, 1),), settled=True, order=3)
    # one worker for v0 (little is left of it): the less loaded f0 leaves; only "lora" has room for its group
    out = orchestrator.plan([leaving, staying], {0: 4, 1: 40}, 1, full=True, fleet=3, hosts={0: [keeper]})
    assert out.moves == ["f0"] and out.migrations == [(7, "f0", "lora")]
    without = orchestrator.plan([leaving, staying], {0: 4, 1: 40}, 1, full=True, fleet=3)
    assert without.moves == [] and without.migrations == []  # no room on f1: f0 stays, as before


def test_a_keepers_room_is_shared_by_every_version_it_keeps():
    keeper = WorkerView(worker_id="lora", version=0, free=2, groups=(), settled=True, order=9)
    views = [WorkerView(worker_id=f"f{v}{i}", version=v, free=0, groups=((10 * v + i, 2),), settled=True, order=i)
             for v in (0, 1) for i in (0, 1)]  # fmt: skip
    out = orchestrator.plan(views, {0: 4, 1: 4, 2: 80}, 2, full=True, fleet=6,
                            hosts={0: [keeper], 1: [keeper]})  # fmt: skip
    assert [dst for _, _, dst in out.migrations] == ["lora"]  # two free slots: one group of two samples in all


def test_an_elastic_worker_back_from_its_yield_serves_the_versions_it_keeps_again():
    """Found by the property machine: an elastic multi-version worker that comes back after the publish serves
    the older version it keeps at once, with the free slots it has now (the roster offers it again)."""
    from dora.config import CoreConfig
    from dora.ids import Mode
    from dora.sim.workload import Workload
    from tests.unit.machine import Harness

    cfg = CoreConfig(mode=Mode.DORA, max_staleness=3, train_groups=3, group_size=3, total_steps=4,
                     deadlines="fixed", drain_load=0)  # fmt: skip
    h = Harness(cfg=cfg, slots=9, workload=Workload.lognormal(median=8, sigma=0.96875, difficulty_sigma=0.7, cap=200,
                                                              seed=4022, prompt_tokens=4))  # fmt: skip
    for elastic in (False, True):
        h.feed(h.world.join(h.slots, elastic=elastic, holds=2))
    h.feed(h.world.request_batch())
    h.drain()  # strict mode: every invariant after every event
    h.check_end()
    assert h.kept_max == 2
