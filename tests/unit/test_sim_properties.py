"""Property tests on whole simulated runs: heavy-tailed lengths, worker deaths and restarts, any mode and K.

Where the stateful machine lets hypothesis pick adversarial orders, these runs keep time realistic
(continuous batching, weight loads, migrations, learner steps) so that several versions really are
alive at once and the orchestrator really migrates. Each run must end (liveness), train every group
of the run exactly once (C2), keep staleness <= K (C3) and one version per trajectory (C1, except the
partial baseline, which must report its violations), with at most K + 1 versions alive.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dora.config import CoreConfig
from dora.ids import Mode
from dora.sim.des import Simulation, Timing
from dora.sim.world import Lengths

EXAMPLES = int(os.environ.get("DORA_SIM_EXAMPLES", "300"))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from([Mode.DORA, Mode.DORA, Mode.PARTIAL, Mode.ONE_STEP, Mode.SYNC]),
    k=st.integers(0, 3),
    train_groups=st.integers(1, 8),
    group_size=st.integers(1, 4),
    steps=st.integers(2, 10),
    workers=st.integers(1, 8),
    slot_groups=st.integers(1, 4),
    watermark=st.one_of(st.none(), st.integers(1, 12)),
    legacy_fill=st.booleans(),
    sigma=st.floats(0.3, 2.0),
    load_s=st.floats(0.0, 3.0),
    train_s=st.floats(0.1, 30.0),
    deaths=st.lists(st.tuples(st.floats(0.0, 200.0), st.integers(0, 99)), max_size=5),
    seed=st.integers(0, 2**20),
)
def test_simulated_runs_keep_every_invariant(
    mode, k, train_groups, group_size, steps, workers, slot_groups, watermark, legacy_fill, sigma, load_s,
    train_s, deaths, seed,
):  # fmt: skip
    cfg = CoreConfig(
        mode=mode, max_staleness=k, train_groups=train_groups, group_size=group_size, total_steps=steps,
        rollout_groups=watermark, legacy_fill=legacy_fill,
    )  # fmt: skip
    sim = Simulation(
        cfg, workers=workers, slots=slot_groups * group_size,
        timing=Timing(load_s=load_s, train_fixed_s=train_s, tick_s=1.5),
        lengths=Lengths(median=30, sigma=sigma, prompt_sigma=0.8, cap=2000, seed=seed),
        deaths=tuple(sorted(deaths)), restart_s=2.0, strict=True,
    )  # fmt: skip
    r = sim.run()
    assert r.steps == steps
    assert sorted(r.trained) == list(range(steps * train_groups)), "C2: every group trained exactly once"
    assert r.max_staleness <= cfg.staleness, "C3"
    assert r.max_live_versions <= cfg.staleness + 1
    if mode is not Mode.PARTIAL:
        assert r.c1_violations == 0, "C1"
    event(f"mode={mode.value}")
    event(f"migrated={'yes' if r.migrated_requests else 'no'}")
    event(f"re-run={'yes' if r.requeued else 'no'}")
    event(f"live versions={r.max_live_versions}")
    if mode is Mode.PARTIAL:
        event(f"partial C1 violations={'yes' if r.c1_violations else 'no'}")


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(1, 3),
    train_groups=st.integers(4, 12),
    group_size=st.integers(2, 6),
    workers=st.integers(4, 10),
    slot_groups=st.integers(2, 6),
    sigma=st.floats(1.0, 2.0),
    deaths=st.lists(st.tuples(st.floats(0.0, 300.0), st.integers(0, 99)), max_size=3),
    seed=st.integers(0, 2**20),
)
def test_dora_fleets_with_long_tails_migrate_and_keep_every_invariant(
    k, train_groups, group_size, workers, slot_groups, sigma, deaths, seed
):
    """Larger dora fleets, where versions overlap for long and residual groups get consolidated."""
    cfg = CoreConfig(mode=Mode.DORA, max_staleness=k, train_groups=train_groups, group_size=group_size,
                     total_steps=8)  # fmt: skip
    r = Simulation(
        cfg, workers=workers, slots=slot_groups * group_size, timing=Timing(train_fixed_s=5.0),
        lengths=Lengths(median=40, sigma=sigma, cap=4000, seed=seed), deaths=tuple(sorted(deaths)), strict=True,
    ).run()  # fmt: skip
    assert sorted(r.trained) == list(range(8 * train_groups))
    assert r.max_staleness <= k and r.c1_violations == 0 and r.max_live_versions <= k + 1
    event(f"migrated={'yes' if r.migrated_requests else 'no'}")
    event(f"live versions={r.max_live_versions}")
