"""The simulator's trainer: optimizer updates ended by a barrier across data-parallel replicas, so a step lasts
as long as each update's busiest replica; the fluid model is the limit with no barrier."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.config import ConfigError
from dora.config.sim import TrainerSection
from dora.sim.trainer import batch_train_s, replica_loads
from dora.ids import Mode
from dora.sim.des import Simulation
from dora.sim.metrics import summarize
from tests.unit.simcfg import small


def trainer(split: str, updates: int = 1, mp: int = 1) -> TrainerSection:
    return TrainerSection(gpu_s_per_token=1.0, step_fixed_s=0.0, publish_s=0.0, data_parallel=split,
                          updates_per_step=updates, model_parallel_gpus=mp)  # fmt: skip


def test_a_count_split_hands_out_consecutive_equal_shares_and_a_token_split_balances():
    assert replica_loads([10, 1, 1, 1], 2, "count") == [11, 2]
    assert sorted(replica_loads([10, 1, 1, 1], 2, "tokens")) == [3, 10]
    assert replica_loads([5, 4, 3], 4, "count") == [0, 5, 4, 3]  # more replicas than sequences: some idle
    # one update on 2 replicas: the busiest holds 11 of 13 tokens; two updates ([10, 1] then [1, 1]): 10 + 1
    assert batch_train_s(trainer("count"), [10, 1, 1, 1], 2) == 11.0
    assert batch_train_s(trainer("count", updates=2), [10, 1, 1, 1], 2) == 11.0
    assert batch_train_s(trainer("tokens", updates=2), [1, 1, 10, 1], 2) == 11.0  # [1, 1] then [10, 1]: 1 + 10
    assert batch_train_s(trainer("fluid"), [10, 1, 1, 1], 2) == 6.5


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 30_000), min_size=1, max_size=80), st.integers(1, 9), st.integers(1, 4),
       st.integers(1, 40), st.sampled_from(["count", "stride", "tokens"]), st.integers(1, 8))  # fmt: skip
def test_a_barrier_never_beats_the_fluid_step_and_one_replica_is_the_fluid_step(seqs, updates, mp, gpus, split,
                                                                                 group):  # fmt: skip
    t = trainer(split, updates, mp)
    if gpus < mp:
        with pytest.raises(ConfigError, match="data-parallel replica"):
            batch_train_s(t, seqs, gpus, group)
        return
    dp = gpus // mp
    fluid = batch_train_s(trainer("fluid"), seqs, dp * mp)
    step = batch_train_s(t, seqs, gpus, group)
    assert step >= fluid - 1e-9 * fluid  # the replicas' work can only wait
    assert step <= sum(seqs) / mp + 1e-9  # never worse than one replica doing it all
    if dp == 1:
        assert step == pytest.approx(fluid)
    if split == "tokens" and updates == 1:  # longest-first greedy, groups whole only within it: one sequence off
        assert step <= (sum(seqs) / dp + max(seqs)) / mp + 1e-9


def test_the_simulated_step_is_the_busiest_replicas_and_a_trainer_too_small_for_a_replica_is_refused():
    cfg = small(workers=3, steps=3, train_groups=4, group_size=3, sigma=1.2)
    cfg = replace(cfg, cluster=replace(cfg.cluster, total_gpus=7), trainer=replace(
        cfg.trainer, gpu_s_per_token=0.01, step_fixed_s=0.0))  # fmt: skip
    fluid = Simulation(cfg, Mode.SYNC).run()
    barrier = Simulation(replace(cfg, trainer=replace(cfg.trainer, data_parallel="count", updates_per_step=2,
                                                      model_parallel_gpus=2)), Mode.SYNC).run()  # fmt: skip
    for f, b in zip(fluid.steps, barrier.steps, strict=True):
        assert b.tokens == f.tokens and f.train_s == pytest.approx(f.tokens * 0.01 / 4)  # 4 trainer GPUs
        assert b.train_s >= f.train_s  # the same batch, two replicas of two GPUs each, two barriers
    assert summarize(barrier, cfg)["step_time_s"] > summarize(fluid, cfg)["step_time_s"]
    with pytest.raises(ConfigError, match="no data-parallel replica"):
        Simulation(replace(cfg, trainer=replace(cfg.trainer, data_parallel="count", model_parallel_gpus=5)), Mode.SYNC)


def test_the_split_search_skips_splits_that_leave_the_trainer_without_a_replica():
    from dora.sim.runner import best_split

    cfg = small(workers=5, credit=9, steps=4, k=2, train_groups=4, sigma=1.2, train_s=20.0)
    cfg = replace(cfg, cluster=replace(cfg.cluster, total_gpus=8, rollout_gpus=None),
                  trainer=replace(cfg.trainer, data_parallel="count", model_parallel_gpus=3))  # fmt: skip
    best, tried = best_split(cfg, Mode.DORA)
    assert {g: t for g, t in tried if 8 - g < 3} and all(t == 0.0 for g, t in tried if 8 - g < 3)
    assert 8 - best >= 3 and dict(tried)[best] > 0


def test_the_split_search_measures_search_steps_after_the_warmup(monkeypatch):
    from dora.sim import runner

    cfg = small(workers=4, steps=12, k=1)
    cfg = replace(cfg, run=replace(cfg.run, warmup_steps=2, search_steps=6),
                  cluster=replace(cfg.cluster, rollout_gpus=None))  # fmt: skip
    probes: list[tuple[int, int]] = []
    real = runner.Simulation

    def probe(c, mode, **kw):
        probes.append((c.run.steps, c.run.warmup_steps))
        return real(c, mode, **kw)

    monkeypatch.setattr(runner, "Simulation", probe)
    runner.best_split(cfg, Mode.DORA)
    assert probes and set(probes) == {(8, 2)}  # 2 warmup + 6 measured (the cooldown comes on top)
    probes.clear()
    runner.best_split(replace(cfg, run=replace(cfg.run, search_steps=20)), Mode.DORA)
    assert set(probes) == {(12, 2)}  # never longer than the run itself
    with pytest.raises(ConfigError, match="search_steps"):
        replace(cfg.run, search_steps=0)


def test_the_live_sim_trainer_takes_the_same_model_as_the_simulator():
    from types import SimpleNamespace

    import numpy as np

    from dora.config import load
    from dora.config.run import RunConfig
    from dora.learner.trainers.sim import SimTrainer

    cfg = load(RunConfig, overrides=["run.time_scale=0.001", "learner.sim_gpus=4", "trainer.data_parallel=count",
                                     "trainer.model_parallel_gpus=2", "trainer.updates_per_step=2",
                                     "trainer.gpu_s_per_token=1.0", "trainer.step_fixed_s=0"])  # fmt: skip

    def sample(n: int) -> SimpleNamespace:
        return SimpleNamespace(token_ids=np.zeros(n, np.int32))

    batch = SimpleNamespace(groups=[SimpleNamespace(samples=[sample(10), sample(1)]),
                                    SimpleNamespace(samples=[sample(1), sample(1)])])  # fmt: skip
    # updates [10, 1] and [1, 1] on two replicas of two accelerators: (10 + 1) / 2 seconds, scaled
    assert SimTrainer(cfg).train(batch)["train_s"] == pytest.approx(5.5 * 0.001)
