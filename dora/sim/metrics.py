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
from statistics import fmean
from typing import Any

from dora.config.sim import SimConfig
from dora.sim import lora
from dora.sim.bounds import decode_replica_s, step_bound
from dora.sim.outcome import Outcome, Totals

LENGTH_BUCKETS = (0, 1024, 2048, 4096, 8192, 16384, 1 << 62)


def summarize(o: Outcome, cfg: SimConfig) -> dict[str, Any]:
    cfg = lora.priced(cfg)  # the trainer's costs of an adapter run (unchanged for full weights)
    costs = lora.costs(cfg.for_mode(o.mode))
    measured = min(cfg.run.steps, len(o.steps))  # the cooldown's steps after them are left out
    warm = min(cfg.run.warmup_steps, measured - 1)
    window = o.steps[warm:measured]
    start = o.totals_at_step[warm - 1] if warm else Totals()
    end = o.totals_at_step[measured - 1]
    d = end.minus(start)
    elapsed = d.t or 1e-9
    tokens = sum(s.tokens for s in window)
    step_time = elapsed / len(window)
    ideal = ideal_step_time(o, cfg, window)
    # The accelerator-seconds a step used (workers decoding, the trainer training), spread over every accelerator:
    # the step time if nothing ever idled, at the decode rates this run reached.
    train_busy_gpu_s = d.trainer_busy_s * o.trainer_gpus
    packing_bound = (d.busy_worker_s * cfg.cluster.gpus_per_worker + train_busy_gpu_s) / cfg.cluster.total_gpus
    dropped = len(o.dropped_lengths) // max(cfg.core.group_size, 1)
    return {
        "mode": o.mode.value,
        "max_staleness": o.staleness_bound,
        "placement": o.placement,
        "rollout_workers": o.rollout_workers,
        "rollout_gpus": o.rollout_workers * cfg.cluster.gpus_per_worker,
        "trainer_gpus": o.trainer_gpus,
        "elastic_workers": o.elastic_workers,
        "yields": o.yields,
        "steps": measured,
        "warmup_steps": warm,
        "cooldown_steps": len(o.steps) - measured,
        "wall_s": o.wall_s,
        "throughput_tokens_per_s": tokens / elapsed,
        "step_time_s": step_time,
        "rollout_only_fraction": d.rollout_only_s / elapsed,
        "trainer_idle_fraction": 1.0 - d.trainer_busy_s / elapsed,
        "slot_utilization": d.slot_s / d.capacity_s if d.capacity_s else 0.0,
        "bubble": fmean(s.bubble for s in window),
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
        "migrations": o.migrated_groups,
        "migrated_requests": o.migrated_requests,
        "reprefill_tokens": o.reprefill_tokens,
        "orchestrator_actions": o.rebalances + o.worker_moves + o.migrated_groups,
        "worker_moves": o.worker_moves,
        "requeued_groups": o.requeued,
        "preemptions": o.preemptions,
        "max_live_versions": o.max_live_versions,
        "train_step_s": fmean(s.train_s for s in window),
        "ideal_step_time_s": ideal,
        "fraction_of_ideal": ideal / step_time if step_time else 0.0,
        "packing_bound_s": packing_bound / len(window),
        "fraction_of_packing_bound": packing_bound / elapsed,
        "turns_per_episode": sum(s.turns for s in window) / max(1, sum(s.episodes for s in window)) or 1.0,
        "mean_running": d.slot_s / elapsed,
        "mean_waiting_on_tools": d.tool_wait_s / elapsed,
        "resume_prefill_tokens": o.resume_prefill_tokens,
        "kv_evictions": o.kv_evictions,
        "lora_rank": cfg.lora.rank,
        "train_cost_factor": costs.train_cost_factor,
        "versions_per_worker": costs.holds,
        "version_bytes": costs.load_bytes,
        "load_s_per_version": costs.load_s,
        "publish_s": cfg.trainer.publish_s,
        "loads": o.loads,
        "load_s": o.load_s,
        "load_bytes": o.load_bytes,
        "keeping_assigns": o.keeping_assigns,
        "max_versions_held": o.max_versions_held,
        "tokens_decoded_while_loading": o.tokens_decoded_while_loading,
    }


def ideal_step_time(o: Outcome, cfg: SimConfig, window: list) -> float:
    n = len(window)
    decode = decode_replica_s(cfg.engine, sum(s.response_tokens for s in window) / n,
                              sum(s.kv_token_steps for s in window) / n)  # fmt: skip
    train = fmean(s.train_s for s in window) + cfg.trainer.publish_s
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
