"""Run one mode on one configuration, choosing the rollout/trainer split (disaggregated) or the number of
elastic workers (elastic) where the config leaves it open."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Literal

from dora.config import ConfigError
from dora.config.sim import SimConfig
from dora.ids import Mode
from dora.sim.des import Simulation
from dora.sim.metrics import summarize
from dora.sim.outcome import Outcome

Pool = Literal["rollout_gpus", "elastic_gpus"]
"""The accelerators a split search sizes: the rollout pool (disaggregated) or the elastic workers (elastic)."""


@dataclass(slots=True)
class ModeResult:
    mode: Mode
    metrics: dict[str, Any]
    outcome: Outcome
    split_search: list[tuple[int, float]]
    """(GPUs, steady-state tokens/s) of every split tried, when it was searched: rollout GPUs of a
    disaggregated placement, elastic GPUs of an elastic one."""


def simulate(cfg: SimConfig, mode: Mode, *, timeline: bool = False, strict: bool = False,
             progress: Callable[[str], None] | None = None) -> ModeResult:  # fmt: skip
    """``progress`` gets a line per split the search tries (a search runs many short simulations)."""
    searched: list[tuple[int, float]] = []
    cl = cfg.cluster
    rollout_gpus, elastic_gpus = cl.rollout_gpus, cl.elastic_gpus
    key: Pool = "rollout_gpus"
    if cl.placement_of(mode) == "disaggregated" and rollout_gpus is None:
        rollout_gpus, searched = best_split(cfg, mode, progress=progress)
    elif cl.placement_of(mode) == "elastic" and elastic_gpus is None:
        elastic_gpus, searched = best_split(cfg, mode, key := "elastic_gpus", progress=progress)
    o = Simulation(cfg, mode, rollout_gpus=rollout_gpus, elastic_gpus=elastic_gpus, strict=strict,
                   timeline=timeline).run()  # fmt: skip
    m = summarize(o, cfg)
    if searched:
        m["split_search"] = [{key: g, "throughput_tokens_per_s": t} for g, t in searched]
    return ModeResult(mode=mode, metrics=m, outcome=o, split_search=searched)


def best_split(
    cfg: SimConfig, mode: Mode, key: Pool = "rollout_gpus", grid: int = 7,
    progress: Callable[[str], None] | None = None,
) -> tuple[int, list[tuple[int, float]]]:  # fmt: skip
    """The rollout pool size (``key = "rollout_gpus"``) or the number of elastic accelerators
    (``"elastic_gpus"``) with the best steady-state throughput, on short runs (``run.search_steps`` measured
    steps each): a coarse grid over the whole range, then every worker count next to the best point (the
    curve is noisy, so no bracketing search is trusted). Every split tried is returned, so the choice can be
    reported."""
    g = cfg.cluster.gpus_per_worker
    steps = min(cfg.run.steps, cfg.run.warmup_steps + cfg.run.search_steps)
    probe = replace(cfg, run=replace(cfg.run, steps=steps))
    if key == "rollout_gpus":
        top = cfg.cluster.total_gpus // g - 1
    else:  # elastic: from one elastic worker to all of the rollout workers
        top = (cfg.cluster.rollout_gpus or cfg.cluster.total_gpus) // g
    seen: dict[int, float] = {}

    what = "rollout" if key == "rollout_gpus" else "elastic"

    def split(workers: int) -> str:
        return f"{workers * g} {what} GPU{'s' if workers * g != 1 else ''}"

    def rate(workers: int) -> float:
        if workers not in seen:
            t0 = time.perf_counter()
            try:
                rollout, elastic = (workers * g, None) if key == "rollout_gpus" else (None, workers * g)
                o = Simulation(probe, mode, rollout_gpus=rollout, elastic_gpus=elastic).run()
            except ConfigError as e:  # e.g. too few trainer accelerators for one data-parallel replica
                seen[workers] = 0.0
                if progress is not None:
                    progress(f"split search: {split(workers)}: not a placement ({e})")
            else:
                seen[workers] = summarize(o, probe)["throughput_tokens_per_s"]
                if progress is not None:
                    progress(f"split search: {split(workers)}: {seen[workers]:,.0f} tokens/s over "
                             f"{steps - probe.run.warmup_steps} steps ({time.perf_counter() - t0:.1f}s)")  # fmt: skip
        return seen[workers]

    coarse = sorted({max(1, min(top, round(1 + i * (top - 1) / (grid - 1)))) for i in range(grid)})
    best = max(coarse, key=rate)
    step = max(1, (top - 1) // (grid - 1))
    while step >= 1:
        around = range(max(1, best - step), min(top, best + step) + 1, max(1, step // 2) or 1)
        best = max([best, *around], key=rate)  # the best so far stays a candidate
        if step == 1:
            break
        step //= 2
    return best * g, sorted((w * g, t) for w, t in seen.items())
