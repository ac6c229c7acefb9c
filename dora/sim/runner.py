"""Run one mode on one configuration, choosing the rollout/trainer split where the config leaves it open."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from dora.config.sim import SimConfig
from dora.ids import Mode
from dora.sim.des import Outcome, Simulation
from dora.sim.metrics import summarize


@dataclass(slots=True)
class ModeResult:
    mode: Mode
    metrics: dict[str, Any]
    outcome: Outcome
    split_search: list[tuple[int, float]]
    """(rollout GPUs, steady-state tokens/s) of every split tried, when the split was searched."""


def simulate(cfg: SimConfig, mode: Mode, *, timeline: bool = False, strict: bool = False) -> ModeResult:
    searched: list[tuple[int, float]] = []
    rollout_gpus = cfg.cluster.rollout_gpus
    if cfg.cluster.placement_of(mode) == "disaggregated" and rollout_gpus is None:
        rollout_gpus, searched = best_split(cfg, mode)
    o = Simulation(cfg, mode, rollout_gpus=rollout_gpus, strict=strict, timeline=timeline).run()
    m = summarize(o, cfg)
    if searched:
        m["split_search"] = [{"rollout_gpus": g, "throughput_tokens_per_s": t} for g, t in searched]
    return ModeResult(mode=mode, metrics=m, outcome=o, split_search=searched)


def best_split(cfg: SimConfig, mode: Mode, grid: int = 7) -> tuple[int, list[tuple[int, float]]]:
    """The rollout pool size with the best steady-state throughput, on short runs: a coarse grid over
    the whole range, then every worker count next to the best point (the curve is noisy, so no
    bracketing search is trusted). Every split tried is returned, so the choice can be reported."""
    g = cfg.cluster.gpus_per_worker
    steps = min(cfg.run.steps, max(cfg.run.warmup_steps + 3, 5))
    probe = replace(cfg, run=replace(cfg.run, steps=steps, warmup_steps=min(cfg.run.warmup_steps, steps - 2)))
    top = cfg.cluster.total_gpus // g - 1
    seen: dict[int, float] = {}

    def rate(workers: int) -> float:
        if workers not in seen:
            o = Simulation(probe, mode, rollout_gpus=workers * g).run()
            seen[workers] = summarize(o, probe)["throughput_tokens_per_s"]
        return seen[workers]

    coarse = sorted({max(1, min(top, round(1 + i * (top - 1) / (grid - 1)))) for i in range(grid)})
    best = max(coarse, key=rate)
    step = max(1, (top - 1) // (grid - 1))
    while step >= 1:
        best = max(range(max(1, best - step), min(top, best + step) + 1, max(1, step // 2) or 1), key=rate)
        if step == 1:
            break
        step //= 2
    return best * g, sorted((w * g, t) for w, t in seen.items())
