"""Lower bounds on a step's time (dora.sim.bounds): worked examples, and no simulated run ever beats its bound."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dora.config.sim import SimEngineSection, TrainerSection
from dora.ids import Mode
from dora.sim.bounds import (
    StepWork,
    completion_order,
    decode_replica_s,
    fleet_bounds,
    kv_token_steps,
    step_bound,
    step_work,
    train_step_s,
)
from dora.sim.des import Simulation
from dora.sim.workload import Workload
from tests.unit.simcfg import SIM_EXAMPLES, small

EXAMPLES = SIM_EXAMPLES // 3


def run_decode_bound(engine: SimEngineSection, lengths: list[int], prompt: int) -> float:
    """D for samples of these response ``lengths`` after prompts of ``prompt`` tokens each."""
    budget = engine.kv_budget_tokens
    return decode_replica_s(engine, float(sum(lengths)), sum(kv_token_steps(n, prompt, budget) for n in lengths))


def test_decode_is_bound_by_the_slots_or_by_the_kv_cache_whichever_needs_more_steps():
    # two samples of 10 tokens after prompts of 5: 20 tokens; KV held 5..14 each, 2 x (5 x 10 + 45) = 190
    assert kv_token_steps(10, 5) == 95
    # a cache of 10 tokens: contexts 5..10 count as they are (45), the four steps past it count 10 each (alone)
    assert kv_token_steps(10, 5, 10) == 85
    assert kv_token_steps(10, 12, 10) == 100
    slots_bound = SimEngineSection(tpot_base_s=0.01, tpot_per_seq_s=0.001, max_slots=4, kv_budget_tokens=100)
    # max(20 / 4, 190 / 100) = 5 decode steps of 0.01 s, plus 20 tokens x 0.001 s
    assert decode_replica_s(slots_bound, 20, 190) == pytest.approx(0.07)
    kv_bound = replace(slots_bound, kv_budget_tokens=20)
    # max(5, 190 / 20 = 9.5) steps: 0.095 + 0.02
    assert decode_replica_s(kv_bound, 20, 190) == pytest.approx(0.115)
    assert run_decode_bound(kv_bound, [10, 10], 5) == pytest.approx(0.115)
    assert decode_replica_s(replace(kv_bound, tpot_scale=2.0), 20, 190) == pytest.approx(0.23)


def test_a_step_is_bound_by_the_trainer_or_by_decode_shared_over_the_time_the_workers_roll_out():
    assert step_bound(100.0, 4, 0, 30.0) == 30.0  # disaggregated, trainer-bound: 100 / 4 = 25 < 30
    assert step_bound(100.0, 2, 0, 30.0) == 50.0  # disaggregated, decode-bound
    assert step_bound(100.0, 4, 2, 30.0) == 40.0  # two elastic workers idle 30 s: (100 + 60) / 4
    assert step_bound(100.0, 4, 4, 30.0) == 55.0  # colocated: 30 + 100 / 4


def test_the_best_split_is_found_over_every_placement():
    """4 one-GPU workers' worth of cluster (5 GPUs), a trainer of 10 s + 1 s per token per GPU; one batch of
    4 samples of 10 tokens after 1-token prompts."""
    cfg = small(workers=4)
    engine = replace(cfg.engine, tpot_base_s=1.0, tpot_per_seq_s=0.0, max_slots=4, tpot_scale=1.0)
    cfg = replace(cfg, trainer=TrainerSection(gpu_s_per_token=1.0, step_fixed_s=10.0, publish_s=0.0), engine=engine)
    work = StepWork(samples=4, response_tokens=40, kv_token_steps=4 * kv_token_steps(10, 1), batches=((11,) * 4,),
                     dispatched=((11,) * 4,))  # fmt: skip
    # D = 1 s x max(40 / 4, 220 / 2**40) = 10 replica-s; train on n GPUs = 10 + 44 / n
    assert decode_replica_s(cfg.engine, 40, work.kv_token_steps) == 10
    found = fleet_bounds(cfg, work)
    # disaggregated w workers, 5 - w trainer GPUs: max(10 + 44 / (5 - w), 10 / w): w = 1 gives 21
    assert (found["disaggregated"].rollout_gpus, found["disaggregated"].step_s) == (1, 21.0)
    # colocated: 5 workers, 5 trainer GPUs: 10 + 44 / 5 + 10 / 5 = 20.8
    assert found["colocated"].step_s == pytest.approx(20.8)
    # elastic, w workers, e elastic, 5 - w + e trainer GPUs; w = 5, e = 4: train 10 + 44 / 4 = 21 > (10 + 84) / 5
    # w = 5, e = 1: trainer 1 GPU (54 s); w = 4, e = 4 -> 5 GPUs: max(18.8, (10 + 4 x 18.8) / 4 = 21.3)
    assert found["elastic"].step_s == pytest.approx(min(
        step_bound(10, w, e, 10 + 44 / (5 - w + e)) for w in range(1, 6) for e in range(1, w + 1)
        if 5 - w + e >= 1 and not e == w == 5
    ))  # fmt: skip
    assert found["best"].step_s == min(found[k].step_s for k in ("disaggregated", "elastic", "colocated"))
    assert fleet_bounds(cfg, work, balanced=True)["best"].step_s <= found["best"].step_s


def test_the_configured_trainer_prices_a_batch_in_the_order_it_comes():
    """Two replicas of one GPU, two updates of two sequences, one per replica: each update lasts its longer
    sequence. Dispatch order long, short, long, short waits on a long one twice; completion order once."""
    trainer = TrainerSection(gpu_s_per_token=1.0, step_fixed_s=0.0, publish_s=0.0, data_parallel="count",
                             updates_per_step=2, model_parallel_gpus=1)  # fmt: skip
    work = StepWork(samples=4, response_tokens=0, kv_token_steps=0, batches=((10, 10, 90, 90),),
                    dispatched=((90, 10, 90, 10),))  # fmt: skip
    assert train_step_s(trainer, work, 2) == 10 + 90
    assert train_step_s(trainer, work, 2, "dispatch") == 90 + 90
    assert train_step_s(replace(trainer, data_parallel="fluid"), work, 2, "dispatch") == 200 / 2


def test_the_sampled_step_of_a_config_is_its_workload_batch_by_batch():
    cfg = small(train_groups=2, group_size=3, median=50.0, sigma=0.0, difficulty_sigma=0.0, cap=2000)
    cfg = replace(cfg, workload=replace(cfg.workload, prompt_sigma=0.0))
    work = step_work(cfg, batches=3)
    assert work.samples == 6 and len(work.batches) == 3
    assert work.response_tokens == 6 * 50
    assert work.kv_token_steps == 6 * (50 * 8 + 50 * 49 / 2)
    assert all(b == (58,) * 6 for b in work.batches)


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from([Mode.SYNC, Mode.ONE_STEP, Mode.PARTIAL, Mode.DORA, Mode.DORA]),
    placement=st.sampled_from(["disaggregated", "colocated", "elastic"]),
    elastic=st.integers(1, 6),
    k=st.integers(0, 3),
    train_groups=st.integers(1, 6),
    group_size=st.integers(1, 4),
    steps=st.integers(2, 8),
    workers=st.integers(1, 6),
    slot_groups=st.integers(1, 4),
    running_frac=st.floats(0.3, 1.0),
    kv=st.one_of(st.none(), st.integers(60, 600)),
    sigma=st.floats(0.3, 2.0),
    train_s=st.floats(0.1, 30.0),
    per_seq=st.floats(0.0, 0.01),
    seed=st.integers(0, 2**20),
)
def test_no_simulated_run_beats_the_bound_of_the_work_it_trained(
    mode, placement, elastic, k, train_groups, group_size, steps, workers, slot_groups, running_frac, kv, sigma,
    train_s, per_seq, seed,
):  # fmt: skip
    """Over a whole run the workers decode every trained sample (at most ``max_slots`` at once, their contexts
    within the KV cache, a decode step costing what the engine model says) and the trainer trains every step:
    the run lasts at least ``max(sum of train steps, (D + E x sum of train steps) / W)``."""
    credit = slot_groups * group_size
    cfg = small(
        workers=workers, credit=credit, max_running=max(1, round(credit * running_frac)), steps=steps, k=k,
        train_groups=train_groups, group_size=group_size, sigma=sigma, train_s=train_s, seed=seed,
        prefill_s_per_token=1e-3, kv_budget_tokens=kv or 1 << 40, placement={m.value: placement for m in Mode},
    )  # fmt: skip
    cfg = replace(
        cfg,
        cluster=replace(cfg.cluster, elastic_gpus=min(elastic, workers), host_link_bytes_per_s=1e9),
        engine=replace(cfg.engine, tpot_per_seq_s=per_seq, tpot_scale=1.3, weight_bytes=1e9, wake_s=0.5),
        trainer=replace(cfg.trainer, state_bytes=1e9),
        workload=replace(cfg.workload, prompt_sigma=0.0),  # every prompt 8 tokens
    )
    o = Simulation(cfg, mode).run()
    w = o.rollout_workers
    decode = run_decode_bound(cfg.engine, o.trained_lengths, 8)
    trained = sum(s.train_s for s in o.steps)
    assert len(o.trained_lengths) == steps * train_groups * group_size
    budget = cfg.engine.kv_budget_tokens  # each step records its batch's KV work, as the bound counts it
    assert sum(s.kv_token_steps for s in o.steps) == pytest.approx(
        sum(kv_token_steps(n, 8, budget) for n in o.trained_lengths)
    )
    bound = step_bound(decode, w, o.elastic_workers, trained)
    assert o.wall_s >= bound * (1 - 1e-9), (o.wall_s, bound, decode / w, trained)


def test_one_elastic_worker_in_sync_with_nothing_else_to_pay_runs_exactly_at_the_bound():
    """Equal samples, slots binding, no prefill, load or role-switch cost: the worker decodes its 4 samples 100
    steps, then yields while the trainer takes 5 s; the run lasts exactly train + D per step, as bound."""
    cfg = small(workers=1, credit=4, max_running=4, steps=3, k=0, train_groups=1, group_size=4, sigma=0.0,
                median=100.0, difficulty_sigma=0.0, train_s=5.0, load_s=0.0,
                placement={m.value: "elastic" for m in Mode})  # fmt: skip
    cfg = replace(cfg, workload=replace(cfg.workload, prompt_sigma=0.0), cluster=replace(cfg.cluster, elastic_gpus=1))
    o = Simulation(cfg, Mode.SYNC).run()
    assert (o.rollout_workers, o.elastic_workers) == (1, 1) and o.trained_lengths == [100] * 12
    decode = run_decode_bound(cfg.engine, o.trained_lengths, 8)
    assert decode == pytest.approx(3 * 100 * (0.02 + 4 * 0.0001))  # 300 decode steps of 4 sequences
    assert o.wall_s == pytest.approx(step_bound(decode, 1, 1, 3 * 5.0))


def test_an_episode_counts_as_one_sample_of_all_its_turns_and_the_trainer_also_trains_its_tool_results():
    cfg = small(train_groups=2, group_size=2, median=30.0, sigma=0.5)
    cfg = replace(cfg, workload=replace(cfg.workload, max_turns=4, turns=2.0, observation_tokens=7.0, tool_s=1.0))
    wl = Workload(cfg.workload, cfg.run.seed)
    episodes = [(wl.prompt_len(g), wl.episode(g, i, 1)) for g in range(2) for i in range(2)]
    assert any(len(ep.turns) > 1 and sum(ep.observations) > 0 for _, ep in episodes)
    work = step_work(cfg, batches=1)
    assert work.response_tokens == sum(ep.length for _, ep in episodes)
    assert work.kv_token_steps == sum(kv_token_steps(ep.length, p) for p, ep in episodes)
    by_group = [[(p + ep.length + sum(ep.observations), ep.length) for p, ep in episodes[k : k + 2]] for k in (0, 2)]
    by_group.sort(key=lambda members: max(n for _, n in members))  # the trainer gets groups in completion order
    assert work.batches == (tuple(seq for members in by_group for seq, _ in members),)


def test_sampled_batches_reach_the_trainer_in_the_order_a_run_delivers_them(monkeypatch):
    """A sync batch is one deadline's groups, delivered in completion order (dora.core.transfer); groups started
    together on one worker complete in the order of their longest response, which is the order ``step_work``
    gives its sampled batches (``completion_order``). The order prices the trainer's data-parallel barrier."""
    cfg = small(workers=1, credit=64, steps=2, k=0, train_groups=6, group_size=3, median=60.0, sigma=0.8, cap=4000)
    cfg = replace(cfg, workload=replace(cfg.workload, prompt_sigma=0.0))
    trained, expected, dispatched = [], [], []
    start = Simulation._start_training

    def record(sim, batch):
        groups = sorted(batch.groups, key=lambda g: g.group_id)  # dispatch order
        lengths = [[sum(n for _, n in s.segments) for s in g.samples] for g in groups]
        dispatched.append(tuple(8 + n for group in lengths for n in group))
        expected.append(completion_order([(max(n), [8 + x for x in n]) for n in lengths]))
        trained.append(tuple(8 + sum(n for _, n in s.segments) for g in batch.groups for s in g.samples))
        return start(sim, batch)

    monkeypatch.setattr(Simulation, "_start_training", record)
    Simulation(cfg, Mode.SYNC).run()
    assert len(trained) == 2 and trained == expected
    assert trained != dispatched  # the run reorders its groups
    assert any(t != tuple(sorted(t)) for t in trained)  # and keeps each whole: not a plain sort of the sequences
