"""Reported metrics of a simulated run (steady state: the steps after ``run.warmup_steps`` up to ``run.steps``; the
cooldown's steps after them are simulated so that the window does not end in the run's drain, and left out).

``ideal_step_time_s`` is ``dora.sim.bounds``'s lower bound for the run's own split, applied to the mean of
its window's batches: decode at the KV cache's limit (every sample weighed by the context it holds over its
decode steps) or at ``max_slots``, whichever needs more decode steps, spread perfectly over the replicas,
beside the trainer's own steps (``max(train, (D + E x train) / W)``, E elastic of W replicas). No prefill, no
straggler, no weight sync, no role switch: a real schedule can only be slower, and ``fraction_of_ideal = ideal
/ measured`` (a window can start with work done before it, so a short run can exceed 1 slightly).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from statistics import fmean
from typing import Any

from dora.config.sim import SimConfig
from dora.sim import lora
from dora.sim.bounds import decode_replica_s, step_bound
from dora.sim.outcome import Outcome, StepRecord, Totals
from dora.sim.trainer import publish_cost_s

LENGTH_BUCKETS = (0, 1024, 2048, 4096, 8192, 16384, 1 << 62)


@dataclass(frozen=True, slots=True)
class Window:
    """The steady state a run is measured on: its steps after the warm-up, up to ``run.steps``."""

    steps: list[StepRecord]
    warmup: int
    """Steps before it."""
    measured: int
    """Steps up to its end (the cooldown's after them left out)."""
    d: Totals
    """The time integrals over it."""

    @property
    def elapsed(self) -> float:
        return self.d.t or 1e-9


def steady_state(o: Outcome, cfg: SimConfig) -> Window:
    measured = min(cfg.run.steps, len(o.steps))
    warm = min(cfg.run.warmup_steps, measured - 1)
    start = o.totals_at_step[warm - 1] if warm else Totals()
    return Window(o.steps[warm:measured], warm, measured, o.totals_at_step[measured - 1].minus(start))


def summarize(o: Outcome, cfg: SimConfig) -> dict[str, Any]:
    cfg = lora.priced(cfg)  # the trainer's costs of an adapter run (unchanged for full weights)
    w = steady_state(o, cfg)
    return (_run(o, cfg, w) | _time(o, w) | _accounting(o, cfg) | _orchestration(o) | _bounds(o, cfg, w)
            | _episodes(o, w) | _versions(o, cfg))  # fmt: skip


def _run(o: Outcome, cfg: SimConfig, w: Window) -> dict[str, Any]:
    """What ran: the mode, its split of the cluster, the steps measured."""
    return {
        "mode": o.mode.value,
        "max_staleness": o.staleness_bound,
        "placement": o.placement,
        "rollout_workers": o.rollout_workers,
        "rollout_gpus": o.rollout_workers * cfg.cluster.gpus_per_worker,
        "trainer_gpus": o.trainer_gpus,
        "elastic_workers": o.elastic_workers,
        "yields": o.yields,
        "steps": w.measured,
        "warmup_steps": w.warmup,
        "cooldown_steps": len(o.steps) - w.measured,
    }


def _time(o: Outcome, w: Window) -> dict[str, Any]:
    """How fast, and where the time went."""
    d, elapsed = w.d, w.elapsed
    return {
        "wall_s": o.wall_s,
        "throughput_tokens_per_s": sum(s.tokens for s in w.steps) / elapsed,
        "step_time_s": elapsed / len(w.steps),
        "rollout_only_fraction": d.rollout_only_s / elapsed,
        "trainer_idle_fraction": 1.0 - d.trainer_busy_s / elapsed,
        "slot_utilization": d.slot_s / d.capacity_s if d.capacity_s else 0.0,
        "bubble": fmean(s.bubble for s in w.steps),
    }


def _accounting(o: Outcome, cfg: SimConfig) -> dict[str, Any]:
    """The promises: staleness at consumption (C3), one version per trajectory (C1), every group accounted for (C2)."""
    dropped = len(o.dropped_lengths) // max(cfg.core.group_size, 1)
    return {
        "staleness_histogram": {str(k): n for k, n in sorted(o.staleness.items())},
        "mean_staleness": _mean_hist(o.staleness),
        "max_staleness_consumed": max((k for k, n in o.staleness.items() if n), default=0),
        "c1_violations": o.c1_violations,
        "mixed_version_trajectories": o.mixed_version_trajectories,
        "groups_dispatched": o.groups_dispatched,
        "groups_trained": len(o.trained),
        "groups_in_flight_at_end": o.groups_in_flight,
        "groups_filtered": o.groups_filtered,
        "filtered_share": o.groups_filtered / max(1, o.groups_filtered + len(o.trained)),
        "filtered_tokens": o.filtered_tokens,
        "dropped_groups": dropped,
        "dropped_fraction_by_length": dropped_by_length(o),
    }


def _orchestration(o: Outcome) -> dict[str, Any]:
    """What keeping the fleet busy took: migrations, worker moves, re-runs, preemptions."""
    return {
        "migrations": o.migrated_groups,
        "migrated_requests": o.migrated_requests,
        "reprefill_tokens": o.reprefill_tokens,
        "orchestrator_actions": o.rebalances + o.worker_moves + o.migrated_groups,
        "worker_moves": o.worker_moves,
        "requeued_groups": o.requeued,
        "preemptions": o.preemptions,
        "max_live_versions": o.max_live_versions,
    }


def _bounds(o: Outcome, cfg: SimConfig, w: Window) -> dict[str, Any]:
    """The step time against its lower bounds: perfect packing of the work done, and ``dora.sim.bounds``'s."""
    step_time = w.elapsed / len(w.steps)
    ideal = ideal_step_time(o, cfg, w.steps)
    # The accelerator-seconds a step used (workers decoding, the trainer training), spread over every accelerator:
    # the step time if nothing ever idled, at the decode rates this run reached.
    train_busy_gpu_s = w.d.trainer_busy_s * o.trainer_gpus
    packing_bound = (w.d.busy_worker_s * cfg.cluster.gpus_per_worker + train_busy_gpu_s) / cfg.cluster.total_gpus
    return {
        "train_step_s": fmean(s.train_s for s in w.steps),
        "ideal_step_time_s": ideal,
        "fraction_of_ideal": ideal / step_time if step_time else 0.0,
        "packing_bound_s": packing_bound / len(w.steps),
        "fraction_of_packing_bound": packing_bound / w.elapsed,
    }


def _episodes(o: Outcome, w: Window) -> dict[str, Any]:
    """Agentic episodes and the engines' KV caches."""
    turns, episodes = sum(s.turns for s in w.steps), sum(s.episodes for s in w.steps)
    return {
        "turns_per_episode": turns / max(1, episodes) or 1.0,
        "mean_running": w.d.slot_s / w.elapsed,
        "mean_waiting_on_tools": w.d.tool_wait_s / w.elapsed,
        "resume_prefill_tokens": o.resume_prefill_tokens,
        "kv_evictions": o.kv_evictions,
    }


def _versions(o: Outcome, cfg: SimConfig) -> dict[str, Any]:
    """What a version costs (an adapter with LoRA, full weights otherwise) and the loads the workers made."""
    costs = lora.costs(cfg.for_mode(o.mode))
    return {
        "lora_rank": cfg.lora.rank,
        "train_cost_factor": costs.train_cost_factor,
        "versions_per_worker": costs.holds,
        "version_bytes": costs.load_bytes,
        "load_s_per_version": costs.load_s,
        "publish_s": cfg.trainer.write_s,
        "snapshot_s": cfg.trainer.snapshot_s if cfg.trainer.overlap_publish else 0.0,
        "overlap_publish": cfg.trainer.overlap_publish,
        "loads": o.loads,
        "load_s": o.load_s,
        "load_bytes": o.load_bytes,
        "keeping_assigns": o.keeping_assigns,
        "max_versions_held": o.max_versions_held,
        "tokens_decoded_while_loading": o.tokens_decoded_while_loading,
    }


def ideal_step_time(o: Outcome, cfg: SimConfig, window: list[StepRecord]) -> float:
    n = len(window)
    decode = decode_replica_s(cfg.engine, sum(s.response_tokens for s in window) / n,
                              sum(s.kv_token_steps for s in window) / n)  # fmt: skip
    train = fmean(s.train_s for s in window)
    train += publish_cost_s(cfg.trainer, train)
    return step_bound(decode, o.rollout_workers, o.elastic_workers, train)


def dropped_by_length(o: Outcome) -> dict[str, float]:
    """Share of finished samples that were dropped, per response-length bucket (drop_stale shows the bias)."""
    out = {}
    for lo, hi in itertools.pairwise(LENGTH_BUCKETS):
        dropped = sum(lo <= n < hi for n in o.dropped_lengths)
        kept = sum(lo <= n < hi for n in o.trained_lengths)
        if dropped + kept:
            label = f"{lo}-{hi}" if hi < 1 << 60 else f"{lo}+"
            out[label] = dropped / (dropped + kept)
    return out


def _mean_hist(hist: dict[int, int]) -> float:
    n = sum(hist.values())
    return sum(k * v for k, v in hist.items()) / n if n else 0.0
