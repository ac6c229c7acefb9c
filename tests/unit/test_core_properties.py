"""Stateful property tests of the pure core against the world model.

Hypothesis chooses, step by step, which worker decodes and how far (so lengths and completion
orders are arbitrary on top of heavy-tailed draws), when workers die, restart or rejoin under the
same id, when a lease's command is lost on the way, when the learner asks, trains, publishes or
crashes (and whether it writes a version in the background while it asks for and trains the next
batch), when old results are replayed, when the orchestrator's timer and load triggers fire, and
which workers are elastic (yield their accelerators for each train step) and when their yields end,
and how many versions each worker holds at once (1: full weights; more: a LoRA engine's adapters, which
takes a new version while groups of older ones still run on it, and serves those until they end);
in every mode, for K in {0, 1, 2, 3}, with fixed and adaptive deadlines, with groups whose rewards are all
equal filtered and replaced (a share of them drawn per group, up to all of them: then every step's cap binds),
and with migration on or off (off: no group ever moves between workers, as agent episodes need).

Checked after every step: the core's own invariants from scratch (strict mode), at most K + 1
live versions, and liveness (something can still move). At the end the run is driven to completion:
every group of the run must be trained exactly once or filtered exactly once (C2), in exact batches, a
uniform group trained only where its step filtered its cap, with staleness <= K
(C3) and one version per trajectory (C1) as seen by the learner model, independently of the core.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from dora.config import CoreConfig
from dora.core.events import LoadReported, Tick, WorkerJoined
from dora.core.scheduler import GroupState
from dora.ids import Mode
from dora.sim.workload import Workload
from tests.unit.machine import Harness, together

EXAMPLES = int(os.environ.get("DORA_PROPERTY_EXAMPLES", "200"))


class CoreMachine(RuleBasedStateMachine):
    h: Harness

    @initialize(
        mode=st.sampled_from([Mode.DORA, Mode.PARTIAL, Mode.ONE_STEP, Mode.SYNC, Mode.DORA]),
        k=st.integers(0, 3),
        train_groups=st.integers(1, 3),
        group_size=st.integers(1, 3),
        steps=st.integers(2, 6),
        workers=st.integers(1, 5),
        slot_groups=st.integers(1, 3),
        watermark=st.one_of(st.none(), st.integers(1, 8)),
        seed=st.integers(0, 2**16),
        sigma=st.floats(0.2, 2.0),
        elastic=st.lists(st.booleans(), min_size=5, max_size=5),
        holds=st.lists(st.sampled_from([1, 1, 2, 3, 4]), min_size=5, max_size=5),
        deadlines=st.sampled_from(["fixed", "adaptive"]),
        drain_load=st.sampled_from([0, 0, 1, 2, 4]),
        filtering=st.sampled_from([False, False, True]),
        max_filtered=st.sampled_from([None, 1, 2, 5]),
        uniform_share=st.sampled_from([0.0, 0.3, 0.7, 1.0]),
        migrate=st.sampled_from([True, True, False]),
    )
    def setup(
        self, mode, k, train_groups, group_size, steps, workers, slot_groups, watermark, seed, sigma, elastic,
        holds, deadlines, drain_load, filtering, max_filtered, uniform_share, migrate,
    ):  # fmt: skip
        cfg = CoreConfig(
            deadlines=deadlines,
            drain_load=drain_load,
            mode=mode,
            max_staleness=k,
            train_groups=train_groups,
            group_size=group_size,
            total_steps=steps,
            rollout_groups=watermark,
            filter_uniform=filtering,
            max_filtered=max_filtered,
            migrate=migrate,
        )
        self.h = Harness(
            cfg=cfg,
            slots=slot_groups * group_size,
            workload=Workload.lognormal(
                median=8,
                sigma=sigma,
                difficulty_sigma=0.7,
                cap=200,
                seed=seed,
                prompt_tokens=4,
                uniform_share=uniform_share,
            ),
        )
        for i in range(workers):
            self.h.feed(self.h.world.join(self.h.slots, elastic=elastic[i], holds=holds[i]))

    # ------------------------------------------------------------------ fleet

    @rule(pick=st.integers(0, 10**6), tokens=st.integers(1, 40))
    def decode(self, pick, tokens):
        live = [w for w in self.h.world.alive_workers() if w.requests]
        if live:
            self.h.feed_all(self.h.world.decode(live[pick % len(live)].worker_id, tokens))

    @rule(pick=st.integers(0, 10**6), tokens=st.integers(1, 40))
    def decode_and_report(self, pick, tokens):
        """The same, the worker reporting what finished in one message, as the broker hands it on (one event)."""
        live = [w for w in self.h.world.alive_workers() if w.requests]
        if live:
            done = self.h.world.decode(live[pick % len(live)].worker_id, tokens)
            if done:
                self.h.feed(together(done))

    @rule(pick=st.integers(0, 10**6))
    def finish_load(self, pick):
        loading = [w for w in self.h.world.alive_workers() if w.loading is not None]
        if loading:
            self.h.feed(self.h.world.finish_load(loading[pick % len(loading)].worker_id))

    @rule(pick=st.integers(0, 10**6))
    def finish_export(self, pick):
        exporting = [w for w in self.h.world.alive_workers() if w.exporting]
        if exporting:
            w = exporting[pick % len(exporting)]
            self.h.feed(self.h.world.finish_export(w.worker_id, next(iter(w.exporting))))

    @rule(pick=st.integers(0, 10**6))
    def finish_yield(self, pick):
        yielding = [w for w in self.h.world.alive_workers() if w.yield_pending]
        if yielding:
            self.h.feed(self.h.world.finish_yield(yielding[pick % len(yielding)].worker_id))

    @precondition(lambda self: len(self.h.world.alive_workers()) > 0)
    @rule(pick=st.integers(0, 10**6))
    def kill_worker(self, pick):
        live = self.h.world.alive_workers()
        self.h.feed(self.h.world.kill(live[pick % len(live)].worker_id))

    @precondition(lambda self: len(self.h.world.alive_workers()) < 6)
    @rule(elastic=st.booleans(), holds=st.sampled_from([1, 1, 2, 4]))
    def join_worker(self, elastic, holds):
        self.h.feed(self.h.world.join(self.h.slots, elastic=elastic, holds=holds))

    @precondition(lambda self: len(self.h.world.alive_workers()) > 0)
    @rule(pick=st.integers(0, 10**6))
    def restart_same_id(self, pick):
        """A worker process restarts and says hello under the same id before it was declared dead."""
        live = self.h.world.alive_workers()
        w = live[pick % len(live)]
        w.engine.clear()
        w.exporting.clear()
        w.loaded = w.loading = None
        w.kept.clear()
        w.yielded = w.yield_pending = False
        w.resume_debt = 0
        self.h.feed(WorkerJoined(worker_id=w.worker_id, slots=w.slots, elastic=w.elastic, holds=w.holds))

    @precondition(lambda self: len(self.h.world.sent) > 0)
    @rule(pick=st.integers(0, 10**6))
    def replay_old_result(self, pick):
        """A late, duplicated or reordered result arrives again; it must never be trained twice."""
        self.h.feed(self.h.world.sent[pick % len(self.h.world.sent)])

    @precondition(lambda self: len(self.h.world.sent) > 0)
    @rule(picks=st.lists(st.integers(0, 10**6), min_size=1, max_size=6))
    def replay_old_report(self, picks):
        """Old results of one worker arrive again together, in any order and with copies, in one report."""
        sent = self.h.world.sent
        worker = sent[picks[0] % len(sent)].worker_id
        mine = [r for r in sent if r.worker_id == worker]
        self.h.feed(together([mine[p % len(mine)] for p in picks]))

    @rule(pick=st.integers(0, 10**6), replay=st.booleans())
    def lose_lease(self, pick, replay):
        """A Generate, ImportGroup or export answer is lost on the way: the worker's heartbeat says it holds
        nothing of that lease (``replay``: the same report again, once the group was re-queued)."""
        held = [(w.worker_id, r.group_id, r.attempt) for w in self.h.world.alive_workers() for r in w.requests]
        held += [(w.worker_id, g, a) for w in self.h.world.alive_workers() for g, (a, _) in w.exporting.items()]
        if held:
            worker, group, attempt = sorted(set(held))[pick % len(set(held))]
            lost = self.h.world.lose_lease(worker, group, attempt)
            self.h.feed(lost)
            if replay:
                self.h.feed(lost)

    @rule()
    def tick(self):
        self.h.feed(Tick())

    @precondition(lambda self: len(self.h.world.alive_workers()) > 0)
    @rule(pick=st.integers(0, 10**6), kv=st.floats(0.0, 1.0))
    def load_report(self, pick, kv):
        live = self.h.world.alive_workers()
        self.h.feed(LoadReported(worker_id=live[pick % len(live)].worker_id, kv_use=kv))

    # ------------------------------------------------------------------ learner

    @precondition(
        lambda self: (
            not self.h.world.learner.waiting
            and self.h.world.learner.batch is None
            and not self.h.world.learner.finished
        )
    )
    @rule()
    def learner_requests(self):
        self.h.feed(self.h.world.request_batch())

    @precondition(lambda self: self.h.world.learner.batch is not None or self.h.world.learner.writing is not None)
    @rule()
    def learner_publishes(self):
        self.h.feed(self.h.world.publish())

    @precondition(lambda self: self.h.world.learner.batch is not None and self.h.world.learner.writing is None)
    @rule()
    def learner_writes_in_the_background(self):
        """The learner trained its batch and writes the version while it asks for, and trains, the next one."""
        self.h.world.finish_training()

    @precondition(lambda self: self.h.world.learner.batch is not None or self.h.world.learner.writing is not None)
    @rule()
    def learner_crashes(self):
        self.h.feed(self.h.world.crash_learner())

    # ------------------------------------------------------------------ invariants

    @invariant()
    def live_versions_bounded(self):
        assert len(self.h.core.ledger.alive()) <= self.h.cfg.staleness + 1

    @invariant()
    def no_deadline_moved_to_pause_a_group(self):
        """A deadline moves only where the elastic workers yielding for the batch it lets go hold no running
        group paused: each one they held went to a standalone worker of its version."""
        core = self.h.core
        if core.extended > getattr(self, "extended", 0):
            sched = core.scheduler
            paused = [g for w in sched.workers.values() if w.elastic and w.yielded for g in w.groups
                      if sched.flights[g].state is GroupState.RUNNING]  # fmt: skip
            assert not paused, f"groups {paused} paused on yielded workers by a moved deadline"
        self.extended = core.extended

    @invariant()
    def no_group_moves_without_migration(self):
        """With migration off no worker is ever asked to export a group: each runs where it was leased (or
        re-runs whole elsewhere if its worker is lost), as an agent episode bound to one endpoint must."""
        if not self.h.cfg.migrate:
            exporting = [w.worker_id for w in self.h.world.workers.values() if w.exporting]
            assert not exporting, f"workers {exporting} asked to export a group with migration off"
            assert not self.h.core.scheduler.stats_migrated_groups

    @invariant()
    def something_can_move(self):
        if self.h.world.alive_workers():
            assert self.h.progress_possible(), "deadlock: learner waits and no worker can make progress"

    def teardown(self):
        if hasattr(self, "h"):
            self.h.drain()
            self.h.check_end()
            core = self.h.core
            event(f"mode={self.h.cfg.mode.value} K={self.h.cfg.staleness} deadlines={self.h.cfg.deadlines}")
            event(f"drain_load={'bounded' if self.h.cfg.drain_load else 'free slots'}")
            event(f"deadlines extended={'yes' if core.extended else 'no'}")
            event(f"events={min(self.h.events // 100 * 100, 1000)}+")
            event(f"requeued={'yes' if core.scheduler.stats_requeued else 'no'}")
            event(f"migrate={'on' if self.h.cfg.migrate else 'off'}")
            event(f"migrated={'yes' if core.scheduler.stats_migrated_groups else 'no'}")
            event(f"elastic workers={sum(w.elastic for w in self.h.world.workers.values())}")
            event(f"multi-version workers={'yes' if any(w.holds > 1 for w in self.h.world.workers.values()) else 'no'}")
            event(f"versions kept={'yes' if self.h.kept_max > 1 else 'no'}")
            event(f"migrated to a keeper={'yes' if core.scheduler.stats_migrated_to_keepers else 'no'}")
            event(f"max live versions={self.h.max_alive}")
            filtered = len(core.transfer.filtered)
            event(f"filtered={'off' if not self.h.cfg.filter_uniform else 'some' if filtered else 'none'}")
            if filtered and filtered == self.h.cfg.filter_cap * self.h.cfg.total_steps:
                event("filtered up to every step's cap")
            for reason in core.refusals:
                event(f"refused {reason.split()[0]}")


CoreMachine.TestCase.settings = settings(
    max_examples=EXAMPLES,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCoreMachine = CoreMachine.TestCase
