"""The convergence benchmark's figures, from its runs: held-out accuracy, parity, time to accuracy, throughput.

Pure functions over the runs `bench/convergence.py` records (no process, no clock), so they can be tested
on hand-made runs. One run (one variant, one seed) is a dict:

- ``steps``: per train step ``{"step", "reward_mean", "tokens", "elapsed_s"}`` (dora also ``staleness_max``);
- ``evals``: the accuracy curve, ``{"version", "elapsed_s", "accuracy", "rows"}`` per evaluated version, on
  the first ``eval.limit`` held-out rows; ``elapsed_s`` is when that version existed (its publish time);
- ``final``: the last version on every held-out row, ``{"version", "accuracy", "rows", ...}``.

Figures per variant, over seeds (SE = stdev / sqrt(n)):
- final accuracy: ``final`` (every row), mean ± SE; parity with sync: |Δ| ≤ 2 SE of the difference (None with
  one seed);
- time to sync's final accuracy: the target is sync's final version's accuracy on the curve's rows, mean over
  sync's seeds (the curve and its target on the same rows); per seed the first ``elapsed_s`` of the curve
  whose accuracy is at least the target, None if never. ``time_to_target_s`` is the mean over the seeds that
  got there, ``reached`` how many did, ``time_ratio`` that time over sync's own;
- wall-clock (the last step's ``elapsed_s``), s/step, tokens/s (sampled completion tokens trained per second),
  final reward (mean reward of the last 20% of steps), largest staleness trained.
"""

from __future__ import annotations

import math
from statistics import fmean, stdev
from typing import Any

Run = dict[str, Any]


def mean_se(xs: list[float]) -> tuple[float, float]:
    return fmean(xs), (stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


def trailing(xs: list[float], window: int) -> list[float]:
    return [fmean(xs[max(0, i + 1 - window) : i + 1]) for i in range(len(xs))]


def curve(run: Run) -> list[dict[str, Any]]:
    """The run's accuracy curve, in time order."""
    return sorted(run["evals"], key=lambda e: (e["elapsed_s"], e["version"]))


def time_to(run: Run, target: float) -> float | None:
    """The first time the run's curve is at least ``target``; None if it never is."""
    return next((e["elapsed_s"] for e in curve(run) if e["accuracy"] >= target - 1e-12), None)


def target_accuracy(sync: list[Run]) -> float:
    """Sync's final accuracy on the curve's rows: its last evaluated version's, mean over seeds."""
    return fmean(curve(run)[-1]["accuracy"] for run in sync)


def summarize(runs: dict[str, list[Run]]) -> dict[str, Any]:
    """The figures of every variant (``runs["sync"]`` is the reference), and the target accuracy."""
    target = target_accuracy(runs["sync"])
    out: dict[str, Any] = {}
    for name, seeds in runs.items():
        finals = [run["final"]["accuracy"] for run in seeds]
        final, se = mean_se(finals)
        walls = [run["steps"][-1]["elapsed_s"] for run in seeds]
        tail = max(1, len(seeds[0]["steps"]) // 5)
        reached = [t for t in (time_to(run, target) for run in seeds) if t is not None]
        out[name] = {
            "final_accuracy": final,
            "final_accuracy_se": se,
            "final_accuracy_per_seed": finals,
            "final_rows": seeds[0]["final"]["rows"],
            "time_to_target_s": fmean(reached) if reached else None,
            "reached": len(reached),
            "seeds": len(seeds),
            "wall_s": fmean(walls),
            "s_per_step": fmean(w / len(run["steps"]) for w, run in zip(walls, seeds, strict=True)),
            "tokens_per_s": fmean(sum(r["tokens"] for r in run["steps"]) / w for run, w in zip(seeds, walls,
                                                                                               strict=True)),
            "final_reward": fmean(fmean(r["reward_mean"] for r in run["steps"][-tail:]) for run in seeds),
            "max_staleness": max((r.get("staleness_max", 0) for run in seeds for r in run["steps"]), default=0),
        }  # fmt: skip
    sync = out["sync"]
    for s in out.values():
        s["diff_se"] = math.sqrt(sync["final_accuracy_se"] ** 2 + s["final_accuracy_se"] ** 2)
        within = abs(s["final_accuracy"] - sync["final_accuracy"]) <= 2 * s["diff_se"]
        s["parity"] = None if math.isnan(s["diff_se"]) else within  # None: one seed, no SE
        mine, theirs = s["time_to_target_s"], sync["time_to_target_s"]
        s["time_ratio"] = None if mine is None or not theirs else mine / theirs
    return {"target_accuracy": target, "target_rows": curve(runs["sync"][0])[-1]["rows"], "variants": out}


def plot(runs: dict[str, list[Run]], path: Any) -> None:
    """Held-out accuracy against seconds and mean reward against steps, mean over seeds with a ±1 SE band."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, seeds in runs.items():
        label = f"{name} ({len(seeds)} seeds)"
        versions = sorted(set.intersection(*({e["version"] for e in run["evals"]} for run in seeds)))
        at = [{e["version"]: e for e in run["evals"]} for run in seeds]
        secs = [fmean(x[v]["elapsed_s"] for x in at) for v in versions]
        acc = [mean_se([x[v]["accuracy"] for x in at]) for v in versions]
        band(a, secs, [m for m, _ in acc], [0.0 if math.isnan(e) else e for _, e in acc], label)
        n = min(len(run["steps"]) for run in seeds)
        window = max(1, n // 20)
        per_step = [mean_se([run["steps"][i]["reward_mean"] for run in seeds]) for i in range(n)]
        band(b, list(range(n)), trailing([m for m, _ in per_step], window),
             trailing([0.0 if math.isnan(e) else e for _, e in per_step], window), label)  # fmt: skip
    rows = int(curve(runs["sync"][0])[-1]["rows"])
    a.set(xlabel="seconds since the fleet was ready (TRL: training time)",
          ylabel=f"held-out greedy exact match ({rows} rows)")  # fmt: skip
    b.set(xlabel="train step", ylabel="mean sampled reward (trailing 5% of steps)")
    for ax in (a, b):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def band(ax: Any, xs: list[float], mean: list[float], se: list[float], label: str) -> None:
    ax.plot(xs, mean, label=label, marker="." if len(xs) < 40 else None)
    ax.fill_between(xs, [m - e for m, e in zip(mean, se, strict=True)], [m + e for m, e in zip(mean, se, strict=True)],
                    alpha=0.2)  # fmt: skip
