"""PNG figures of simulated runs: per-worker version timelines, staleness histograms, throughput bars."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from dora.sim.runner import ModeResult

MAX_TIMELINE_WORKERS = 64


def write_plots(results: Sequence[ModeResult], out: pathlib.Path, *, title: str) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [throughput_bars([r.metrics for r in results], out / "throughput.png", title=title),
             staleness(results, out / "staleness.png", title=title)]  # fmt: skip
    for r in results:
        if r.outcome.timeline:
            paths.append(timeline(r, out / f"timeline_{r.mode.value}.png", title=title))
    return paths


def throughput_bars(rows: list[dict[str, Any]], path: pathlib.Path, *, title: str, label: str = "mode") -> pathlib.Path:
    fig, ax = plt.subplots(figsize=(max(7, 1.3 * len(rows)), 3.5))
    names = [r[label] for r in rows]
    values = [r["throughput_tokens_per_s"] for r in rows]
    bars = ax.bar(names, values, color=["#1f77b4" if n.startswith("dora") else "#888" for n in names])
    ax.tick_params(axis="x", labelsize=8)
    for bar, r in zip(bars, rows, strict=True):
        ax.annotate(f"{r['step_time_s'] / 60:.1f} min/step", (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    ha="center", va="bottom", fontsize=8)  # fmt: skip
    ax.set_ylabel("tokens / s (steady state)")
    ax.set_title(f"throughput — {title}", fontsize=10)
    return _save(fig, path)


def staleness(results: Sequence[ModeResult], path: pathlib.Path, *, title: str) -> pathlib.Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(len(results), 1)
    top = 0
    for i, r in enumerate(results):
        hist = {int(k): v for k, v in r.metrics["staleness_histogram"].items()}
        total = sum(hist.values()) or 1
        xs = sorted(hist)
        top = max([top, *xs])
        offset = (i - (len(results) - 1) / 2) * width  # each staleness value is one centred group of bars
        ax.bar([x + offset for x in xs], [hist[x] / total for x in xs], width=width, label=r.mode.value)
    ax.set_xticks(range(top + 1))
    ax.set_xlabel("staleness at consumption (learner version - dispatch version)")
    ax.set_ylabel("share of trajectories")
    ax.legend(fontsize=8)
    ax.set_title(f"staleness — {title}", fontsize=10)
    return _save(fig, path)


def timeline(r: ModeResult, path: pathlib.Path, *, title: str) -> pathlib.Path:
    """One row per worker; busy spans coloured by the policy version they serve, loads hatched grey."""
    lines = sorted(r.outcome.timeline.items(), key=lambda kv: int(kv[0].lstrip("w") or 0))[:MAX_TIMELINE_WORKERS]
    fig, ax = plt.subplots(figsize=(11, 0.25 * len(lines) + 1.5))
    cmap = plt.get_cmap("tab10")
    for row, (_, spans) in enumerate(lines):
        for t0, t1, version, kind in spans:
            if kind == "busy":
                ax.barh(row, t1 - t0, left=t0, color=cmap(version % 10), height=0.8)
            elif kind == "load":
                ax.barh(row, t1 - t0, left=t0, color="#ccc", hatch="//", height=0.8)
    for s in r.outcome.steps:
        ax.axvline(s.published_s, color="k", lw=0.4, alpha=0.4)
    ax.set_yticks(range(len(lines)), [w for w, _ in lines], fontsize=6)
    ax.set_xlabel("virtual time (s); vertical lines: versions published; colour: policy version served")
    ax.set_title(f"{r.mode.value} worker timeline — {title}", fontsize=10)
    return _save(fig, path)


def xy_plot(
    series: dict[Any, dict[str, dict[str, Any]]],
    path: pathlib.Path,
    *,
    xlabel: str,
    ylabel: str,
    value: str,
    logx: bool = False,
) -> pathlib.Path:
    """One line per mode: ``series[x][mode][value]``."""
    fig, ax = plt.subplots(figsize=(6.5, 3.5))
    xs = list(series)
    for name in next(iter(series.values())):
        ax.plot(xs, [series[x][name][value] for x in xs], marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def pareto(points: dict[str, dict[str, Any]], path: pathlib.Path, *, title: str) -> pathlib.Path:
    """Throughput against mean consumed staleness, one labelled point per policy (up and left is better); where a
    point is a mean over runs (``per_seed``), each run is drawn small beside it."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, m in points.items():
        x, y = m["mean_staleness"], m["throughput_tokens_per_s"]
        color = "#d62728" if "adaptive" in name else "#1f77b4"
        runs = m.get("per_seed", ())
        if runs:
            ax.scatter([r["mean_staleness"] for r in runs], [r["throughput_tokens_per_s"] for r in runs], s=10,
                       color=color, alpha=0.35)  # fmt: skip
        ax.scatter([x], [y], s=40, color=color)
        ax.annotate(name, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("mean staleness at consumption (versions)")
    ax.set_ylabel("tokens / s (steady state)")
    ax.set_title(f"throughput vs staleness — {title}", fontsize=10)
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _save(fig: Any, path: pathlib.Path) -> pathlib.Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
