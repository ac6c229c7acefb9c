"""The core's event handling: fencing, re-runs, migration protocol, modes, learner hand-off."""

from __future__ import annotations

import copy

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dora.config import ConfigError, CoreConfig
from dora.core import intake
from dora.core.core import Core
from dora.core.events import (
    BatchRequested,
    DeliverBatch,
    ExportGroup,
    GroupExported,
    ImportGroup,
    LearnerLost,
    Lease,
    Lent,
    LoadReported,
    Outbox,
    Pin,
    Refused,
    ResultsReported,
    Retire,
    Revoke,
    RunFinished,
    Tick,
    VersionLoaded,
    VersionPublished,
    WorkerJoined,
    WorkerLost,
)
from dora.core.intake import GroupFailed
from dora.ids import Finish, Mode
from dora.sim.des import Simulation
from tests.unit import machine
from tests.unit.machine import finished
from tests.unit.simcfg import small


def of(actions, kind):
    return [a for a in actions if isinstance(a, kind)]


def ready(core: Core, worker: str, slots: int = 8) -> list:
    acts = core.handle(0, WorkerJoined(worker_id=worker, slots=slots))
    (assign,) = of(acts, Pin)
    return core.handle(0, VersionLoaded(worker_id=worker, version=assign.version))


def finish(core: Core, lease: Lease, index: int = 0, *, worker=None, attempt=None, version=None, finish=Finish.STOP):
    return core.handle(
        0,
        finished(
            worker_id=worker or lease.worker_id, group_id=lease.group_id,
            attempt=lease.attempt if attempt is None else attempt, index=index,
            segments=((lease.version if version is None else version, 5),), finish=finish,
        ),
    )  # fmt: skip


def cfg(**kw) -> CoreConfig:
    base = dict(mode=Mode.DORA, max_staleness=1, train_groups=1, group_size=1, rollout_groups=1)
    return CoreConfig(**{**base, **kw})


# ---------------------------------------------------------------- fencing


def test_a_group_is_leased_whole_to_one_worker_with_a_fresh_attempt():
    core = Core(cfg(group_size=4, rollout_groups=2))
    leases = of(ready(core, "a", slots=8), Lease)
    assert [(x.n_samples, x.worker_id) for x in leases] == [(4, "a"), (4, "a")]
    assert len({x.attempt for x in leases}) == 2


@pytest.mark.parametrize(
    ("who", "attempt_delta", "index", "reason"),
    [
        ("ghost", 0, 0, "unknown_worker"),
        ("b", 0, 0, "not_holder"),
        ("a", 1, 0, "stale_attempt"),
        ("a", 0, 5, "bad_sample_index"),
    ],
)
def test_results_that_do_not_match_the_lease_are_refused(who, attempt_delta, index, reason):
    core = Core(cfg(group_size=2))
    (lease,) = of(ready(core, "a"), Lease)
    ready(core, "b")
    acts = finish(core, lease, index, worker=who, attempt=lease.attempt + attempt_delta)
    assert [r.reason for r in of(acts, Refused)] == [reason]
    assert core.scheduler.flights[lease.group_id].done == {}


def test_duplicate_sample_is_refused_and_changes_nothing():
    core = Core(cfg(group_size=2))
    (lease,) = of(ready(core, "a"), Lease)
    finish(core, lease, 0)
    acts = finish(core, lease, 0)
    assert [r.reason for r in of(acts, Refused)] == ["duplicate_sample"]
    assert len(core.scheduler.flights[lease.group_id].done) == 1


def test_results_taken_together_decide_as_the_same_results_one_by_one():
    """A report of several samples (what a worker sends in one message) = the same samples reported one by one."""

    def drive(together: bool) -> tuple[list, list, int, int]:
        core = Core(cfg(group_size=4, train_groups=2, max_staleness=1, rollout_groups=None), strict=True)
        log: list = []
        refusals: list = []
        reports = 0

        def handle(event) -> None:  # and load whatever weights the core assigns, as a worker would
            acts = core.handle(0, event)
            log.extend((x.group_id, x.worker_id, x.version) for x in of(acts, Lease))
            refusals.extend((r.group_id, r.index, r.reason) for r in of(acts, Refused))
            for a in of(acts, Pin):
                handle(VersionLoaded(worker_id=a.worker_id, version=a.version))
            for batch in of(acts, DeliverBatch):
                handle(VersionPublished(version=batch.step + 1))

        for w in ("a", "b"):
            handle(WorkerJoined(worker_id=w, slots=8))
        for _ in range(4):  # rounds: every held group finishes, the learner trains, new groups are leased
            held = sorted(core.scheduler.flights.values(), key=lambda f: f.group_id)
            for worker in ("a", "b"):
                results = [finished(worker_id=worker, group_id=f.group_id, attempt=f.attempt, index=i,
                                    segments=((f.version, 5),)) for f in held if f.worker == worker
                           for i in range(4)]  # fmt: skip
                if not results:
                    continue
                reports += 1
                results.append(results[0])  # a duplicate in the same report
                for e in [machine.together(results)] if together else results:
                    handle(e)
            handle(BatchRequested(step=core.step))
        return sorted(log), refusals, core.step, reports

    one_by_one, together = drive(False), drive(True)
    assert together == one_by_one
    log, refusals, steps, reports = together
    assert steps >= 3 and len(log) >= 8 and reports >= 4
    assert len(refusals) == reports  # the copy of a sample of a group already complete: no longer held
    assert all(r[2] in ("duplicate_sample", "unknown_group") for r in refusals)


def _twin_state(core: Core) -> tuple:
    """Everything a decision can depend on (the roster by what it answers, not by its lazy heap)."""
    sched, led = core.scheduler, core.ledger
    best = {v: [sched.pick_worker(v, need) for need in (0, 1, core.cfg.group_size)] for v in led.pinned_versions()}
    return (sched.flights, sched.workers, list(sched.queue), sched.pending_requests(), sched.idle, sched.leaving,
            sched.idle_unready, best, led.deadline_counts(), led.alive(), core.transfer._by_deadline,
            core.transfer.step, core.transfer.in_training, core.refusals, core.learner_waiting)  # fmt: skip


def _intake(core: Core, reports: list[ResultsReported]) -> tuple[list, str | None]:
    """The reports taken in (what the core does with them before it decides anything): the actions, and the
    failure if a group failed too often."""
    out = Outbox()
    try:
        for report in reports:
            for flight in intake.accept(core.scheduler, report, out):
                core._finished(flight)
    except GroupFailed as e:
        return out.actions, str(e)
    return out.actions, None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(),
    group_size=st.integers(1, 4),
    k=st.integers(0, 2),
    mode=st.sampled_from([Mode.DORA, Mode.PARTIAL, Mode.SYNC]),
    failures=st.integers(1, 4),
)
def test_a_report_is_taken_exactly_as_its_samples_one_by_one(data, group_size, k, mode, failures):
    """A report (the broker's form of a worker's message: the headers as they came, no event per sample) is taken
    exactly as its samples reported one at a time are: the same refusals, the same state, the same GroupFailed,
    whatever the report holds (duplicates, foreign and stale leases, bad indices, errors, C1 violations, several
    groups interleaved). (The decisions that follow are made once after a report.)"""
    one = Core(cfg(mode=mode, group_size=group_size, max_staleness=k, train_groups=2, rollout_groups=6,
                   max_group_failures=failures), strict=True)  # fmt: skip
    for w in ("a", "b"):
        ready(one, w, slots=3 * group_size)
    for _ in range(data.draw(st.integers(1, 12), label="reports")):
        worker = data.draw(st.sampled_from(["a"] * 4 + ["b"] * 4 + ["ghost"]), label="worker")
        flights = sorted(one.scheduler.flights.values(), key=lambda f: f.group_id)
        leases = [(f.group_id, f.attempt, f.version, f.worker) for f in flights if f.attempt is not None]
        own = [x for x in leases if x[3] == worker] or leases or [(99, 99, 0, worker)]
        samples = []
        for _ in range(data.draw(st.integers(1, 3), label="leases in the report")):
            group, attempt, version, _ = data.draw(st.sampled_from(own) if data.draw(st.integers(0, 4)) else
                                                   st.sampled_from(leases or own), label="lease")  # fmt: skip
            first = data.draw(st.integers(0, group_size - 1), label="first index")
            for index in range(first, first + data.draw(st.integers(1, group_size), label="samples")):
                bad = data.draw(st.sampled_from(["none"] * 12 + ["attempt", "index", "newer", "negative", "empty",
                                                                 "two runs", "mixed", "error", "again"]))  # fmt: skip
                segments = {"newer": ((version + 1, 5),), "negative": ((version, -1),), "empty": (),
                            "two runs": ((version, 2), (version, 3)),
                            "mixed": ((version, 2), (version + 1, 3))}.get(bad, ((version, 5),))  # fmt: skip
                sample = finished(
                    worker_id=worker, group_id=group, attempt=attempt + (bad == "attempt"),
                    index=-1 if bad == "index" else index, segments=segments,
                    finish=Finish.ERROR if bad == "error" else Finish.STOP, payload=("p", len(samples)),
                )  # fmt: skip
                samples.extend([sample, sample] if bad == "again" else [sample])
        report = machine.together(samples)
        whole, alone = copy.deepcopy(one), copy.deepcopy(one)
        assert _intake(whole, [report]) == _intake(alone, samples)
        assert _twin_state(whole) == _twin_state(alone)
        try:
            outcome = one.handle(1.0, report)
        except GroupFailed:
            event("group failed")
            return
        for a in outcome:
            event(f"{type(a).__name__} {a.reason}" if isinstance(a, Refused) else type(a).__name__)
        for a in outcome:  # the learner trains what it is given, the workers load what they are told
            if isinstance(a, DeliverBatch):
                one.handle(2.0, VersionPublished(version=a.step + 1))
            elif isinstance(a, Pin):
                one.handle(2.0, VersionLoaded(worker_id=a.worker_id, version=a.version))
        one.handle(3.0, BatchRequested(step=one.step))


def test_lost_worker_groups_rerun_whole_on_newest_and_late_results_are_refused():
    core = Core(cfg(group_size=2, max_staleness=1))
    (lease,) = of(ready(core, "a"), Lease)
    finish(core, lease, 0)
    ready(core, "b")
    acts = core.handle(0, WorkerLost(worker_id="a"))
    (rerun,) = of(acts, Lease)
    assert rerun.group_id == lease.group_id and rerun.worker_id == "b" and rerun.attempt != lease.attempt
    assert core.scheduler.flights[lease.group_id].done == {}, "partial output of the dead attempt is discarded"
    assert [r.reason for r in of(finish(core, lease, 1), Refused)] == ["unknown_worker"]


def test_restart_under_the_same_id_voids_the_old_leases_and_fences_their_results():
    core = Core(cfg(group_size=1))
    (old,) = of(ready(core, "a"), Lease)
    acts = core.handle(0, WorkerJoined(worker_id="a", slots=8))  # the process restarted before it expired
    assert of(acts, Pin)
    acts = core.handle(0, VersionLoaded(worker_id="a", version=0))
    (new,) = of(acts, Lease)
    assert new.group_id == old.group_id and new.attempt != old.attempt
    assert [r.reason for r in of(finish(core, old), Refused)] == ["stale_attempt"], "same worker, old attempt"
    assert not of(finish(core, new), Refused)


def test_c1_violating_sample_is_refused_and_the_group_rerun_then_the_run_stops_after_repeated_errors():
    core = Core(cfg(group_size=1, max_group_failures=2))
    (lease,) = of(ready(core, "a"), Lease)
    acts = finish(core, lease, version=lease.version + 1)
    assert [r.reason for r in of(acts, Refused)] == ["c1_violation"]
    assert of(acts, Revoke) == [Revoke(worker_id="a", group_id=lease.group_id, attempt=lease.attempt)]
    (rerun,) = of(acts, Lease)
    with pytest.raises(GroupFailed, match="neither trained nor dropped"):
        finish(core, rerun, finish=Finish.ERROR)


# ---------------------------------------------------------------- learner hand-off


def test_batches_are_exact_and_a_lost_learner_gets_the_same_batch_again():
    core = Core(cfg(train_groups=2, group_size=1, rollout_groups=3, total_steps=2))
    leases = of(ready(core, "a"), Lease)
    assert len(leases) == 3
    core.handle(0, BatchRequested(step=0))
    assert not of(finish(core, leases[0]), DeliverBatch), "one finished group is not a batch of two"
    (batch,) = of(finish(core, leases[1]), DeliverBatch)
    assert len(batch.groups) == 2 and batch.step == 0
    core.handle(0, LearnerLost())
    (again,) = of(core.handle(0, BatchRequested(step=0)), DeliverBatch)
    assert again.redelivery and again.groups == batch.groups
    assert of(core.handle(0, BatchRequested(step=5)), Refused)
    assert of(core.handle(0, VersionPublished(version=3)), Refused), "publish out of order"
    acts = core.handle(0, VersionPublished(version=1))
    assert not of(acts, Refused)


def test_the_next_batch_goes_out_while_its_version_is_written_and_the_publishes_complete_them_in_order():
    """K = 1: batch 1 may hold groups of version 0, so the learner gets it while version 1 is still being written;
    version 1 is published (and dispatched to) only when its write ends, and the two publishes complete the two
    batches oldest first. A lost learner gets both again, in order."""
    core = Core(cfg(train_groups=1, group_size=1, rollout_groups=4, total_steps=3, max_staleness=1))
    leases = of(ready(core, "a"), Lease)
    core.handle(0, BatchRequested(step=0))
    (b0,) = of(finish(core, leases[0]), DeliverBatch)
    assert not of(core.handle(0, BatchRequested(step=1)), Refused), "asked for early: waited for, not refused"
    (b1,) = of(finish(core, leases[1]), DeliverBatch)
    assert (b0.step, b1.step) == (0, 1) and b1.groups[0].version == 0
    assert core.ledger.newest == 0, "nothing is published before its write ends"
    assert of(core.handle(0, BatchRequested(step=2)), Refused), "at most one batch ahead of the newest version"
    core.handle(0, LearnerLost())
    assert [a.step for a in of(core.handle(0, BatchRequested(step=0)), DeliverBatch)] == [0]
    assert of(core.handle(0, VersionPublished(version=2)), Refused), "the older batch is completed first"
    assert not of(core.handle(0, VersionPublished(version=1)), Refused)
    (again,) = of(core.handle(0, BatchRequested(step=1)), DeliverBatch)
    assert again.redelivery and again.groups == b1.groups
    assert not of(core.handle(0, VersionPublished(version=2)), Refused)
    assert core.transfer.training == []


def test_an_early_request_waits_for_the_publish_when_k_is_zero_or_workers_are_elastic():
    """K = 0: batch 1 needs groups of version 1, which cannot run before version 1 is published: the early
    request waits, and sync stays sync. Elastic workers lend their accelerators per step: no batch goes out
    before the pending publish."""
    core = Core(cfg(train_groups=1, group_size=1, rollout_groups=2, total_steps=2, max_staleness=0))
    leases = of(ready(core, "a"), Lease)
    core.handle(0, BatchRequested(step=0))
    of(finish(core, leases[0]), DeliverBatch)
    assert not of(core.handle(0, BatchRequested(step=1)), DeliverBatch | Refused)
    assert not of(core.handle(0, Tick()), Lease), "K = 0: nothing is leased on version 0 for step 1"
    acts = core.handle(0, VersionPublished(version=1))
    assert not of(acts, DeliverBatch)

    core = Core(cfg(train_groups=1, group_size=1, rollout_groups=4, total_steps=3, max_staleness=1))
    leases = of(ready(core, "a"), Lease)
    core.handle(0, WorkerJoined(worker_id="e", slots=8, elastic=True))
    core.handle(0, VersionLoaded(worker_id="e", version=0))
    core.handle(0, BatchRequested(step=0))
    finish(core, leases[0])
    (b0,) = of(core.handle(0, Lent(worker_id="e")), DeliverBatch)
    core.handle(0, BatchRequested(step=1))
    assert not of(finish(core, leases[1]), DeliverBatch), "held for the publish: an elastic worker is lent"
    assert core.transfer.training == [b0]


def test_run_ends_after_total_steps_and_never_dispatches_past_the_budget():
    core = Core(cfg(train_groups=1, group_size=1, rollout_groups=4, total_steps=2, max_staleness=3))
    leases = of(ready(core, "a"), Lease)
    assert len(leases) == 2, "budget = total_steps x train_groups groups"
    core.handle(0, BatchRequested(step=0))
    finish(core, leases[0])
    core.handle(0, VersionPublished(version=1))
    core.handle(0, BatchRequested(step=1))
    finish(core, leases[1])
    acts = core.handle(0, VersionPublished(version=2))
    assert of(acts, RunFinished) == [RunFinished(steps=2)]


# ---------------------------------------------------------------- versions, orchestration, migration


def test_dora_moves_workers_to_the_new_version_and_migrates_residual_groups_within_the_old_one():
    core = Core(cfg(group_size=1, train_groups=2, rollout_groups=4, max_staleness=1))
    leases = of(ready(core, "a", slots=2), Lease) + of(ready(core, "b", slots=2), Lease)
    by_worker = {w: [x for x in leases if x.worker_id == w] for w in "ab"}
    core.handle(0, BatchRequested(step=0))
    finish(core, by_worker["a"][0])
    (batch,) = of(finish(core, by_worker["b"][0]), DeliverBatch)
    # Admission (K=1: 2B groups due by step 1) left one v0 group on each worker. v1 brings two fresh
    # groups, so each version gets one worker: one worker hands its v0 group to the other and leaves.
    assert len(batch.groups) == 2
    acts = core.handle(0, VersionPublished(version=1))
    (out,) = of(acts, ExportGroup)
    assert out.version == 0 and core.ledger.version_of(out.target) == 0, "same version only"
    assert not of(acts, Pin), "the leaving worker keeps its version until its groups are handed over"
    acts = core.handle(0, GroupExported(worker_id=out.worker_id, group_id=out.group_id, attempt=out.attempt,
                                            n_requests=1, state="kv"))  # fmt: skip
    (mig,) = of(acts, ImportGroup)
    assert (mig.worker_id, mig.source, mig.version, mig.state) == (out.target, out.worker_id, 0, "kv")
    assert of(acts, Pin) == [Pin(worker_id=out.worker_id, version=1)]
    assert core.ledger.workers_of(0) == [out.target]


def test_without_migration_a_worker_the_plan_moves_keeps_its_group_and_moves_once_it_ends():
    core = Core(cfg(group_size=1, train_groups=2, rollout_groups=4, max_staleness=1, migrate=False))
    leases = of(ready(core, "a", slots=2), Lease) + of(ready(core, "b", slots=2), Lease)
    a0, a1, b0, b1 = sorted(leases, key=lambda x: (x.worker_id, x.group_id))
    core.handle(0, BatchRequested(step=0))
    finish(core, a0)
    assert of(finish(core, b0), DeliverBatch)
    # The same fleet as above: the plan moves one worker to v1 and keeps one on v0. Its group stays where it runs.
    for trigger in (VersionPublished(version=1), Tick(), LoadReported(worker_id="a", kv_use=1.0)):
        acts = core.handle(0, trigger)
        assert not of(acts, ExportGroup) and not of(acts, Pin), f"{trigger}: no group moves, no busy worker moves"
    leaving = core.scheduler.workers["a"]
    assert leaving.leaving and core.ledger.version_of("a") == 0 and sorted(leaving.groups) == [a1.group_id]
    acts = finish(core, a1)
    assert of(acts, Pin) == [Pin(worker_id="a", version=1)], "empty: it moves to the newest version"
    assert not of(acts, Lease), "it takes no new group of v0 while it drains, and loads v1 first"
    acts = finish(core, b1)
    assert of(acts, Pin) == [Pin(worker_id="b", version=1)], "v0 has nothing left: its last worker moves too"
    assert core.scheduler.stats_migrated_groups == 0


def test_export_after_the_target_died_reruns_the_group():
    core = Core(cfg(group_size=1, train_groups=2, rollout_groups=4, max_staleness=1))
    leases = of(ready(core, "a", slots=2), Lease) + of(ready(core, "b", slots=2), Lease)
    core.handle(0, BatchRequested(step=0))
    finish(core, next(x for x in leases if x.worker_id == "a"))
    finish(core, next(x for x in leases if x.worker_id == "b"))
    (out,) = of(core.handle(0, VersionPublished(version=1)), ExportGroup)
    core.handle(0, WorkerLost(worker_id=out.target))
    acts = core.handle(0, GroupExported(worker_id=out.worker_id, group_id=out.group_id, attempt=out.attempt,
                                            n_requests=1))  # fmt: skip
    assert not of(acts, ImportGroup)
    assert out.group_id in core.scheduler.queue, "the group is owed again, whole (next to the dead target's own)"
    assert of(acts, Pin) == [Pin(worker_id=out.worker_id, version=1)], "the source, now empty, moves on"
    acts = core.handle(0, VersionLoaded(worker_id=out.worker_id, version=1))
    (rerun,) = [x for x in of(acts, Lease) if x.group_id == out.group_id]
    assert rerun.version == 1 and rerun.attempt != out.attempt


def test_retire_is_emitted_once_the_last_group_is_consumed_and_no_worker_serves_it():
    core = Core(cfg(group_size=1, train_groups=1, rollout_groups=2, max_staleness=1, total_steps=2))
    l0, l1 = of(ready(core, "a"), Lease)
    core.handle(0, BatchRequested(step=0))
    finish(core, l0)
    finish(core, l1)
    acts = core.handle(0, VersionPublished(version=1))
    assert of(acts, Pin) == [Pin(worker_id="a", version=1)], "the idle worker moves on at once"
    assert not of(acts, Retire), "but v0 still owes a finished group to step 1"
    acts = core.handle(0, BatchRequested(step=1))
    assert of(acts, DeliverBatch) and of(acts, Retire) == [Retire(version=0)], "last v0 group consumed"
    acts = core.handle(0, VersionPublished(version=2))
    assert of(acts, Retire) == [Retire(version=1)] and of(acts, Pin) == [Pin(worker_id="a", version=2)]


def test_partial_mode_swaps_weights_under_running_requests_and_counts_c1_violations():
    core = Core(cfg(mode=Mode.PARTIAL, group_size=1, train_groups=1, rollout_groups=2, max_staleness=1))
    l0, l1 = of(ready(core, "a"), Lease)
    core.handle(0, BatchRequested(step=0))
    finish(core, l0)
    acts = core.handle(0, VersionPublished(version=1))
    assert of(acts, Pin) == [Pin(worker_id="a", version=1, interrupt=True)]
    core.handle(0, VersionLoaded(worker_id="a", version=1))
    core.handle(0, BatchRequested(step=1))
    mixed = finished(worker_id="a", group_id=l1.group_id, attempt=l1.attempt, index=0,
                           segments=((0, 3), (1, 4)))  # fmt: skip
    (batch,) = of(core.handle(0, mixed), DeliverBatch)
    assert batch.groups[0].version == 0 and core.transfer.c1_violations == 1


def test_modes_fix_their_staleness_bound():
    assert cfg(mode=Mode.SYNC, max_staleness=3).staleness == 0
    assert cfg(mode=Mode.ONE_STEP, max_staleness=3).staleness == 1
    assert cfg(mode=Mode.DORA, max_staleness=3).staleness == 3


@pytest.mark.parametrize(
    ("kw", "fragment"),
    [
        ({"mode": "fast"}, "mode must be one of"),
        ({"train_groups": 0}, "train_groups"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"group_size": 1.5}, "group_size"),
        ({"kv_rebalance_threshold": 0.0}, "kv_rebalance_threshold"),
    ],
)
def test_bad_config_is_one_clear_error(kw, fragment):
    with pytest.raises(ConfigError, match=fragment):
        cfg(**kw)


def test_slots_below_group_size_are_refused():
    core = Core(cfg(group_size=4))
    acts = core.handle(0, WorkerJoined(worker_id="tiny", slots=2))
    assert [r.reason for r in of(acts, Refused)] == ["slots 2 < group_size 4"] and "tiny" not in core.scheduler.workers


# ---------------------------------------------------------------- K = 0 is synchronous training


@pytest.mark.parametrize("seed", range(4))
def test_k0_reproduces_sync_exactly(seed):
    """dora and partial at K = 0 make the same decisions as sync: same batches, same times, faults included."""
    runs = []
    cfg = small(k=0, train_groups=5, group_size=3, steps=6, sigma=1.2, seed=seed, prefill_s_per_token=1e-3)
    for mode in (Mode.SYNC, Mode.DORA, Mode.PARTIAL):
        deaths = ((3.0, seed), (12.0, seed + 1), (25.0, seed + 2), (45.0, seed))
        runs.append(Simulation(cfg, mode, deaths=deaths, strict=True).run())
    sync = runs[0]
    assert sync.requeued > 0, "the faults must hit running work for this test to mean anything"
    for r in runs[1:]:
        assert r.trained == sync.trained and r.wall_s == sync.wall_s
        assert [s.published_s for s in r.steps] == [s.published_s for s in sync.steps]
        assert r.staleness == {0: sync.staleness[0]} and r.c1_violations == 0


def test_tick_outside_dora_changes_nothing():
    core = Core(cfg(mode=Mode.SYNC, group_size=1))
    ready(core, "a")
    assert core.handle(0, Tick()) == []


def test_drop_stale_discards_over_stale_groups_and_counts_them():
    """The peer baseline: no admission bound, first-finished-first-trained, over-stale work dropped (C2 broken)."""
    core = Core(cfg(mode=Mode.DROP_STALE, group_size=1, train_groups=1, rollout_groups=None, max_staleness=0))
    leases = of(ready(core, "a", slots=3), Lease)
    assert len(leases) == 3, "no deadline admission: the worker is filled to its credit"
    core.handle(0, BatchRequested(step=0))
    (b0,) = of(finish(core, leases[0]), DeliverBatch)
    core.handle(0, VersionPublished(version=1))
    finish(core, leases[1])  # version 0, now over-stale for step 1 (K = 0)
    core.handle(0, BatchRequested(step=1))
    assert [g.group_id for g in core.transfer.dropped] == [leases[1].group_id]
    assert not of(finish(core, leases[2]), DeliverBatch), "also over-stale: dropped, not trained"
    assert len(core.transfer.dropped) == 2 and core.transfer.consumed == [b0.groups[0].group_id]


def test_nothing_is_leased_until_min_workers_have_joined():
    core = Core(cfg(min_workers=2, rollout_groups=None))
    assert not of(ready(core, "a"), Lease) and not core.fleet_ready
    acts = core.handle(0, WorkerJoined(worker_id="b", slots=8))
    acts += core.handle(0, VersionLoaded(worker_id="b", version=of(acts, Pin)[0].version))
    assert of(acts, Lease) and core.fleet_ready  # leasing starts once the second worker is in


def test_the_first_leases_wait_until_min_workers_have_loaded_and_are_shared_among_them():
    """A worker that has joined but still loads its weights does not start the fleet: counting it, the worker
    that loaded first would take every group the watermark allows."""
    core = Core(cfg(min_workers=2, rollout_groups=None))
    ready(core, "a", slots=64)
    (assign,) = of(core.handle(0, WorkerJoined(worker_id="b", slots=64)), Pin)
    assert not core.fleet_ready and not core.scheduler.flights, "b joined but has not loaded: nothing leased"
    leases = of(core.handle(0, VersionLoaded(worker_id="b", version=assign.version)), Lease)
    assert core.fleet_ready and {x.worker_id for x in leases} == {"a", "b"}, leases


def test_a_worker_lost_before_the_fleet_is_ready_no_longer_holds_it_back():
    """min_workers = 2 and b dies while it loads: a alone starts the run once it has loaded, instead of waiting
    for b forever."""
    core = Core(cfg(min_workers=2, rollout_groups=None))
    (assign,) = of(core.handle(0, WorkerJoined(worker_id="a", slots=64)), Pin)
    core.handle(0, WorkerJoined(worker_id="b", slots=64))
    core.handle(0, WorkerLost(worker_id="b"))
    assert not core.fleet_ready and not core.scheduler.flights, "a has not loaded yet"
    leases = of(core.handle(0, VersionLoaded(worker_id="a", version=assign.version)), Lease)
    assert core.fleet_ready and leases and {x.worker_id for x in leases} == {"a"}, leases
