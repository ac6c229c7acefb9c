"""Property tests on whole simulated runs: heavy-tailed lengths, worker deaths and restarts, any mode and K.

Where the stateful machine lets hypothesis pick adversarial orders, these runs keep time realistic
(continuous batching with slot and KV limits, preemption, prefill, weight loads, migrations, learner
steps, every placement: elastic workers yield to the trainer, paying role switches, with their KV
offloaded or dropped) so that several versions really are alive at once and the orchestrator
really migrates; with a share of groups whose rewards are all equal filtered and replaced, or not; with each
version written in line or in the background (the learner asking for the next batch meanwhile). Each run
must end (liveness), train every group of the run exactly once or filter it exactly once (C2),
keep staleness <= K (C3) and one version per trajectory (C1, except the partial baseline, which
must report its violations), with at most K + 1 versions alive.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dora.ids import Mode
from dora.sim.des import Simulation
from tests.unit.simcfg import SIM_EXAMPLES, small

EXAMPLES = SIM_EXAMPLES
KEEPERS = [Mode.DORA, Mode.DORA, Mode.PARTIAL, Mode.ONE_STEP, Mode.SYNC]


def check_run(o, cfg, mode: Mode) -> None:
    # every step of the run: the measured ones, then the cooldown's (the core still dispatching)
    steps, b, k = cfg.for_mode(mode).core.total_steps, cfg.core.train_groups, cfg.for_mode(mode).core.staleness
    assert steps == cfg.run.steps + cfg.run.cooldown(k)
    assert len(o.steps) == steps
    f = o.groups_filtered  # with filtering, groups whose rewards were all equal: consumed, never trained
    assert len(set(o.trained)) == len(o.trained) == steps * b, "C2: no group trained twice, exact batches"
    assert len(o.trained) + f == o.groups_dispatched == steps * b + f, "C2: every group trained or filtered"
    assert o.groups_in_flight == 0, "conservation: nothing dispatched is left at the end"
    assert f <= steps * cfg.core.filter_cap
    assert max(o.staleness, default=0) <= k, "C3"
    assert o.max_live_versions <= k + 1
    if mode is not Mode.PARTIAL:
        assert o.c1_violations == 0, "C1"


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(KEEPERS),
    placement=st.sampled_from(["disaggregated", "colocated", "elastic"]),
    elastic=st.integers(1, 8),
    yield_kv=st.sampled_from(["offload", "drop"]),
    deadlines=st.sampled_from(["fixed", "adaptive"]),
    drain_load=st.sampled_from([0, 0, 1, 3, 8]),
    k=st.integers(0, 3),
    train_groups=st.integers(1, 8),
    group_size=st.integers(1, 4),
    steps=st.integers(2, 10),
    workers=st.integers(1, 8),
    slot_groups=st.integers(1, 4),
    running_frac=st.floats(0.3, 1.0),
    kv=st.one_of(st.none(), st.integers(40, 400)),
    watermark=st.one_of(st.none(), st.integers(1, 12)),
    legacy_fill=st.booleans(),
    sigma=st.floats(0.3, 2.0),
    load_s=st.floats(0.0, 3.0),
    train_s=st.floats(0.1, 30.0),
    deaths=st.lists(st.tuples(st.floats(0.0, 200.0), st.integers(0, 99)), max_size=5),
    seed=st.integers(0, 2**20),
    uniform=st.sampled_from([None, None, 0.3, 0.8]),
    overlap=st.booleans(),
    write_s=st.floats(0.0, 40.0),
)
def test_simulated_runs_keep_every_invariant(
    mode, placement, elastic, yield_kv, deadlines, drain_load, k, train_groups, group_size, steps, workers,
    slot_groups, running_frac, kv, watermark, legacy_fill, sigma, load_s, train_s, deaths, seed, uniform, overlap,
    write_s,
):  # fmt: skip
    """``uniform``: that share of groups get equal rewards and are filtered and replaced (None: no filtering).
    ``overlap``: each version (1 GB, written in ``write_s``) is written in the background."""
    credit = slot_groups * group_size
    cfg = small(
        workers=workers, credit=credit, max_running=max(1, round(credit * running_frac)), steps=steps, k=k,
        train_groups=train_groups, group_size=group_size, watermark=watermark, legacy_fill=legacy_fill, sigma=sigma,
        load_s=load_s, train_s=train_s, tick_s=1.5, restart_s=2.0, seed=seed, prefill_s_per_token=1e-3,
        kv_budget_tokens=kv or 1 << 40, placement={m.value: placement for m in Mode}, cooldown_steps=None,
    )  # fmt: skip
    cfg = replace(  # role switches cost about a second: offloads, wake-up, trainer state
        cfg,
        core=replace(cfg.core, deadlines=deadlines, drain_load=drain_load, filter_uniform=uniform is not None),
        workload=replace(cfg.workload, uniform_share=uniform or 0.0),
        cluster=replace(cfg.cluster, elastic_gpus=min(elastic, workers), host_link_bytes_per_s=1e9),
        engine=replace(cfg.engine, weight_bytes=1e9, wake_s=0.5, kv_bytes_per_token=1e6, yield_kv=yield_kv),
        trainer=replace(cfg.trainer, state_bytes=1e9, weights_gb=1.0, write_s_per_gb=write_s, overlap_publish=overlap),
    )
    o = Simulation(cfg, mode, deaths=tuple(sorted(deaths)), strict=True).run()
    check_run(o, cfg, mode)
    if placement != "disaggregated" and not deaths:
        total = cfg.for_mode(mode).core.total_steps
        assert o.yields == o.elastic_workers * total, "every elastic worker yields for every step"
    event(f"mode={mode.value} placement={placement} deadlines={deadlines}")
    event(f"drain_load={'bounded' if drain_load else 'free slots'}")
    event(f"migrated={'yes' if o.migrated_requests else 'no'}")
    event(f"re-run={'yes' if o.requeued else 'no'}")
    event(f"preempted={'yes' if o.preemptions else 'no'}")
    event(f"live versions={o.max_live_versions}")
    event(f"filtered={'off' if uniform is None else 'some' if o.groups_filtered else 'none'}")
    early = any(b.delivered_s < a.published_s for a, b in itertools.pairwise(o.steps))
    event(f"publish={'in line' if not overlap else 'a batch trained while a write ran' if early else 'overlapped'}")
    if early:  # K = 0 and a fleet with elastic workers alive wait for the publish
        assert overlap and cfg.for_mode(mode).core.staleness > 0 and (o.elastic_workers == 0 or deaths)


@settings(max_examples=max(EXAMPLES // 3, 10), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(1, 3),
    train_groups=st.integers(4, 12),
    group_size=st.integers(2, 6),
    workers=st.integers(4, 10),
    slot_groups=st.integers(2, 6),
    sigma=st.floats(1.0, 2.0),
    kv_transfer=st.booleans(),
    deaths=st.lists(st.tuples(st.floats(0.0, 300.0), st.integers(0, 99)), max_size=3),
    seed=st.integers(0, 2**20),
)
def test_dora_fleets_with_long_tails_migrate_and_keep_every_invariant(
    k, train_groups, group_size, workers, slot_groups, sigma, kv_transfer, deaths, seed
):
    """Larger dora fleets, where versions overlap for long and residual groups get consolidated."""
    cfg = small(
        workers=workers,
        credit=slot_groups * group_size,
        steps=8,
        k=k,
        train_groups=train_groups,
        group_size=group_size,
        sigma=sigma,
        cap=4000,
        train_s=5.0,
        seed=seed,
        prefill_s_per_token=1e-3,
    )
    cfg = replace(cfg, engine=replace(cfg.engine, kv_transfer=kv_transfer))
    o = Simulation(cfg, Mode.DORA, deaths=tuple(sorted(deaths)), strict=True).run()
    check_run(o, cfg, Mode.DORA)
    event(f"migrated={'yes' if o.migrated_requests else 'no'}")
    event(f"live versions={o.max_live_versions}")
