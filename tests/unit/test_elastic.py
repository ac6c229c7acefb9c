"""Elastic workers in the core: they hand running groups to standalone peers of their version, yield before
the batch goes out, and come back after the publish on the version they hold groups of (C1)."""

from __future__ import annotations

from dora.config import CoreConfig
from dora.core.core import Core
from dora.core.events import (
    BatchRequested,
    DeliverBatch,
    ExportGroup,
    GroupExported,
    ImportGroup,
    Lease,
    Lend,
    Lent,
    Pin,
    Reclaim,
    Refused,
    Tick,
    VersionLoaded,
    VersionPublished,
    WorkerJoined,
    WorkerLost,
)
from dora.ids import Mode
from tests.unit.machine import finished
from tests.unit.test_core import of


def fleet(standalone_slots: int = 2, elastic_slots: int = 4, *, migrate: bool = True) -> tuple[Core, list[Lease]]:
    """K = 2, one group of 2 a batch, 2 groups out at once; standalone "s" (one group's room) gets the first,
    elastic "e" the second."""
    cfg = CoreConfig(mode=Mode.DORA, max_staleness=2, train_groups=1, group_size=2, rollout_groups=2, migrate=migrate)
    core = Core(cfg)
    leases = []
    for name, slots, elastic in (("s", standalone_slots, False), ("e", elastic_slots, True)):
        core.handle(0, WorkerJoined(worker_id=name, slots=slots, elastic=elastic))
        leases += of(core.handle(0, VersionLoaded(worker_id=name, version=0)), Lease)
    return core, leases


def finish(core: Core, lease: Lease, index: int) -> list:
    return core.handle(0, finished(worker_id=lease.worker_id, group_id=lease.group_id, attempt=lease.attempt,
                                         index=index, segments=((lease.version, 3),)))  # fmt: skip


def test_running_groups_move_to_a_standalone_peer_and_the_batch_waits_for_the_yield():
    core, leases = fleet()
    g0, g1 = leases
    assert (g0.worker_id, g1.worker_id) == ("s", "e")
    core.handle(0, BatchRequested(step=0))
    finish(core, g0, 0)
    acts = finish(core, g0, 1)  # the batch is taken while "s" has room for g1
    (out,) = of(acts, ExportGroup)
    assert (out.group_id, out.worker_id, out.target, out.version) == (g1.group_id, "e", "s", 0)
    assert of(acts, Lend) == [Lend(worker_id="e")]
    assert not of(acts, DeliverBatch), "the trainer does not have the elastic accelerators yet"
    assert all(a.worker_id == "s" for a in of(acts, Lease)), "nothing is leased to a yielded worker"
    assert not of(core.handle(0, BatchRequested(step=0)), DeliverBatch), "a repeated request does not skip the yield"
    (batch,) = of(core.handle(0, Lent(worker_id="e")), DeliverBatch)
    assert [g.group_id for g in batch.groups] == [g0.group_id]
    (moved,) = of(core.handle(0, GroupExported(worker_id="e", group_id=g1.group_id, attempt=g1.attempt,
                                                   n_requests=2)), ImportGroup)  # fmt: skip
    assert (moved.worker_id, moved.version) == ("s", 0)
    acts = core.handle(0, VersionPublished(version=1))
    assert of(acts, Pin) == [Pin(worker_id="e", version=1)], "it held nothing: it comes back on the newest"
    assert not of(acts, Reclaim)


def test_without_migration_a_lending_worker_keeps_its_groups_paused_though_a_peer_has_room():
    core, leases = fleet(migrate=False)
    g0, g1 = leases
    core.handle(0, BatchRequested(step=0))
    finish(core, g0, 0)
    acts = finish(core, g0, 1)  # "s" has room for g1, as in the first test
    assert not of(acts, ExportGroup) and of(acts, Lend) == [Lend(worker_id="e")]
    assert core.scheduler.workers["e"].groups == {g1.group_id}
    assert of(core.handle(0, Lent(worker_id="e")), DeliverBatch)
    acts = core.handle(0, VersionPublished(version=1))
    assert of(acts, Reclaim) == [Reclaim(worker_id="e", version=0)], "C1: its group goes on under version 0"
    core.handle(0, VersionLoaded(worker_id="e", version=0))
    finish(core, g1, 0)
    assert not of(finish(core, g1, 1), ExportGroup), "its group ended where it ran"
    acts = core.handle(0, Tick())  # "s" still runs a v0 group: v0 keeps one worker, the empty one moves
    assert of(acts, Pin) == [Pin(worker_id="e", version=1)]
    assert core.scheduler.stats_migrated_groups == 0


def test_groups_with_no_room_elsewhere_stay_paused_and_resume_on_their_version():
    core, (g0, g1) = fleet()
    finish(core, g0, 0)
    finish(core, g0, 1)  # "s" takes the next group and is full
    acts = core.handle(0, BatchRequested(step=0))
    assert not of(acts, ExportGroup) and of(acts, Lend) == [Lend(worker_id="e")]
    assert of(core.handle(0, Lent(worker_id="e")), DeliverBatch)
    acts = core.handle(0, VersionPublished(version=1))
    assert of(acts, Reclaim) == [Reclaim(worker_id="e", version=0)], "C1: its group goes on under version 0"
    assert not [a for a in of(acts, Pin) if a.worker_id == "e"]
    assert core.ledger.version_of("e") == 0
    core.handle(0, VersionLoaded(worker_id="e", version=0))
    finish(core, g1, 0)
    finish(core, g1, 1)
    assert g1.group_id not in core.scheduler.flights and len(core.transfer) == 1, "finished, waiting to be trained"


def test_a_load_that_ends_after_the_yield_does_not_make_the_worker_ready():
    core = Core(CoreConfig(mode=Mode.DORA, max_staleness=1, train_groups=1, group_size=1, rollout_groups=1))
    core.handle(0, WorkerJoined(worker_id="s", slots=2))
    (g0,) = of(core.handle(0, VersionLoaded(worker_id="s", version=0)), Lease)
    core.handle(0, WorkerJoined(worker_id="e", slots=2, elastic=True))  # still loading version 0
    finish(core, g0, 0)
    assert of(core.handle(0, BatchRequested(step=0)), Lend) == [Lend(worker_id="e")]
    acts = core.handle(0, VersionLoaded(worker_id="e", version=0))
    assert of(acts, Refused)[0].reason == "load_while_yielded" and not core.scheduler.workers["e"].ready
    assert of(core.handle(0, Lent(worker_id="e")), DeliverBatch)


def test_losing_a_yielding_worker_releases_the_batch_and_requeues_its_groups_whole():
    core, (g0, g1) = fleet()
    finish(core, g0, 0)
    finish(core, g0, 1)
    core.handle(0, BatchRequested(step=0))
    acts = core.handle(0, WorkerLost(worker_id="e"))
    assert of(acts, DeliverBatch), "the trainer no longer waits for a dead worker"
    assert g1.group_id in core.scheduler.flights and core.scheduler.flights[g1.group_id].worker != "e"
    assert of(core.handle(0, Lent(worker_id="e")), Refused)[0].reason == "unexpected_yield"
