"""Compact simulator configurations for tests."""

from __future__ import annotations

import os

from dora.config import CoreConfig
from dora.config.sim import (
    ClusterSection,
    RunSection,
    SimConfig,
    SimEngineSection,
    TrainerSection,
    WorkloadSection,
)
from dora.ids import Mode

ALL_DISAGGREGATED = {m.value: "disaggregated" for m in Mode}

SIM_EXAMPLES = int(os.environ.get("DORA_SIM_EXAMPLES", "100"))
"""The scale of the property tests over whole simulated runs (each test runs a share of it). 100 by default: at
300 those runs took 190 s of a loaded suite; the mutation check (tests/mutation.py) and a soak run set
DORA_SIM_EXAMPLES=300."""


def small(
    *,
    workers: int = 3,
    credit: int = 9,
    max_running: int | None = None,
    steps: int = 4,
    k: int = 1,
    train_groups: int = 4,
    group_size: int = 3,
    watermark: int | None = None,
    legacy_fill: bool = True,
    median: float = 40.0,
    sigma: float = 1.0,
    cap: int = 2000,
    difficulty_sigma: float = 0.5,
    load_s: float = 1.0,
    train_s: float = 2.0,
    tick_s: float = 2.0,
    restart_s: float = 1.0,
    seed: int = 0,
    prefill_s_per_token: float = 0.0,
    kv_budget_tokens: int = 1 << 40,
    placement: dict[str, str] | None = None,
    cooldown_steps: int | None = 0,
) -> SimConfig:
    """``workers`` rollout workers of one GPU each and a one-GPU trainer taking ``train_s`` per step. No cooldown
    by default: the run is exactly ``steps`` steps (``cooldown_steps=None``: the simulator's default, K + 2)."""
    return SimConfig(
        run=RunSection(steps=steps, warmup_steps=0, tick_s=tick_s, restart_s=restart_s, seed=seed,
                       cooldown_steps=cooldown_steps),
        core=CoreConfig(max_staleness=k, train_groups=train_groups, group_size=group_size, rollout_groups=watermark,
                        legacy_fill=legacy_fill),
        cluster=ClusterSection(total_gpus=workers + 1, gpus_per_worker=1, rollout_gpus=workers,
                               placement=placement or ALL_DISAGGREGATED),
        engine=SimEngineSection(tpot_base_s=0.02, tpot_per_seq_s=0.0001, max_slots=max_running or credit,
                             credit_slots=credit, kv_budget_tokens=kv_budget_tokens,
                             prefill_s_per_token=prefill_s_per_token, load_s=load_s),
        trainer=TrainerSection(gpu_s_per_token=0.0, step_fixed_s=train_s, publish_s=0.0),
        workload=WorkloadSection(median=median, sigma=sigma, cap=cap, difficulty_sigma=difficulty_sigma,
                                 prompt_tokens=8.0),
    )  # fmt: skip
