"""`dora plot RUN_DIR [--out DIR]`: a run's figures, drawn from what its broker wrote.

Reads ``metrics.jsonl`` (``broker.metrics_file``: one line per train step) and ``timeline.jsonl``
(``broker.timeline_file``: one line per worker event and per published version) in RUN_DIR and writes:

- ``reward.png``: the learner's mean reward per train step;
- ``staleness.png``: the share of trained trajectories at each staleness (learner version - dispatch
  version), with the bound K marked;
- ``eval.png`` (when the run has ``eval.jsonl``): held-out accuracy per version evaluated;
- ``health.png``: the run's health on one page: entropy, KL to the start model, mean reward and held-out
  accuracy over steps (a panel whose number the run did not record says so);
- ``timeline.png``: one row per rollout worker, spans coloured by the policy version it served, weight
  loads hatched, and a vertical line at each published version.

`dora run` calls the same function when a run ends. Nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dora.config import ConfigError

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.axis import Axis
    from matplotlib.figure import Figure

METRICS = "metrics.jsonl"
TIMELINE = "timeline.jsonl"
EVAL = "eval.jsonl"
"""Held-out evaluations of the run (`dora run` with [eval]): one line per version evaluated."""
HEALTH = (("entropy", "entropy (nats)", ""), ("kl_ref", "KL to the start model (k3)", " (learner.kl_coef is 0)"),
          ("reward_mean", "mean reward", ""))  # fmt: skip
"""The learner's numbers on health.png: key in metrics.jsonl, panel title, why a run may lack it."""
MAX_WORKERS = 64
"""Rows drawn in timeline.png (the first workers to join)."""


class PlotError(ConfigError):
    """The run directory cannot be drawn (missing, empty or unreadable): one line for the user."""


@dataclass(frozen=True, slots=True)
class Span:
    start: float
    end: float
    version: int
    loading: bool
    """Loading the version's weights (hatched) rather than serving it."""


def read_jsonl(path: pathlib.Path) -> list[dict[str, Any]]:
    """Every line of a JSON-lines file; a last line cut short (its writer was stopped mid-line) is left out."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise PlotError(f"cannot read {path}: {e}") from None
    lines = text.splitlines()
    rows = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            if n == len(lines) and not text.endswith("\n"):
                break
            raise PlotError(f"{path}:{n} is not a JSON line") from None
        if not isinstance(row, dict):
            raise PlotError(f"{path}:{n} is not a JSON object")
        rows.append(row)
    return rows


def load(rundir: pathlib.Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The train steps and the timeline events of a run directory (the timeline may be missing)."""
    if not rundir.is_dir():
        raise PlotError(f"{rundir}: no such directory")
    metrics = rundir / METRICS
    if not metrics.is_file():
        raise PlotError(f"{rundir} holds no {METRICS} (the broker writes it when broker.metrics_file is set)")
    rows = [r for r in read_jsonl(metrics) if isinstance(r.get("step"), int)]
    if not rows:
        raise PlotError(f"{metrics} holds no train step yet")
    timeline = rundir / TIMELINE
    events = read_jsonl(timeline) if timeline.is_file() else []
    return rows, [e for e in events if isinstance(e.get("t"), int | float) and isinstance(e.get("event"), str)]


def render(rundir: pathlib.Path, out: pathlib.Path | None = None) -> list[pathlib.Path]:
    """Write reward.png, staleness.png, health.png, (with a timeline) timeline.png and (with held-out rounds)
    eval.png into ``out`` (default: the run directory). Returns the files written; raises PlotError if the run
    directory cannot be drawn."""
    rows, events = load(rundir)
    out = out or rundir
    import matplotlib

    matplotlib.use("Agg")
    title = rundir.resolve().name
    try:
        out.mkdir(parents=True, exist_ok=True)
        paths = [reward(rows, out / "reward.png", title=title),
                 staleness(rows, events, out / "staleness.png", title=title)]  # fmt: skip
        if any("worker" in e for e in events):
            paths.append(timeline(events, rows, out / "timeline.png", title=title))
        held_out = read_jsonl(rundir / EVAL) if (rundir / EVAL).is_file() else []
        if held_out:
            paths.append(evaluation(held_out, out / "eval.png", title=title))
        paths.append(health(rows, held_out, out / "health.png", title=title))
    except OSError as e:
        raise PlotError(f"cannot write to {out}: {e}") from None
    return paths


# ---------------------------------------------------------------------- figures


def reward(rows: list[dict[str, Any]], path: pathlib.Path, *, title: str) -> pathlib.Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    points = [(r["step"], r["reward_mean"]) for r in rows if isinstance(r.get("reward_mean"), int | float)]
    if points:
        ax.plot([s for s, _ in points], [v for _, v in points], marker=".", lw=1)
    else:
        ax.text(0.5, 0.5, "the learner reported no reward_mean", ha="center", va="center", transform=ax.transAxes)
    _whole_steps(ax.xaxis)
    ax.set_xlabel("train step")
    ax.set_ylabel("mean reward")
    ax.grid(alpha=0.3)
    ax.set_title(f"reward — {title}", fontsize=10)
    return _save(fig, path)


def evaluation(rows: list[dict[str, Any]], path: pathlib.Path, *, title: str) -> pathlib.Path:
    """Held-out accuracy (and pass@k when several samples were taken) per version evaluated."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    rows = sorted(rows, key=lambda r: r["step"])
    steps = [r["step"] for r in rows]
    ax.plot(steps, [r["accuracy"] for r in rows], marker="o", lw=1.5, label="accuracy")
    for key in sorted({k for r in rows for k in r if k.startswith("pass@") and k != "pass@1"}):
        ax.plot(steps, [r.get(key, float("nan")) for r in rows], marker=".", lw=1, label=key)
    for s, r in zip(steps, rows, strict=True):
        ax.annotate(f"{r['accuracy']:.3f}", (s, r["accuracy"]), textcoords="offset points", xytext=(0, 6),
                    ha="center", fontsize=8)  # fmt: skip
    _whole_steps(ax.xaxis)
    ax.set_ylim(0, 1)
    ax.set_xlabel("policy version (train step)")
    ax.set_ylabel("held-out")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"held-out evaluation ({int(rows[-1]['rows'])} rows) — {title}", fontsize=10)
    return _save(fig, path)


def health(rows: list[dict[str, Any]], held_out: list[dict[str, Any]], path: pathlib.Path, *,
           title: str) -> pathlib.Path:  # fmt: skip
    """Four panels over steps: entropy, KL to the start model, mean reward (metrics.jsonl) and held-out accuracy
    (eval.jsonl). A collapsing run shows entropy falling towards 0 first; a drifting one, a rising KL."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(11, 6.5))
    for ax, (key, label, why) in zip(axes.flat, HEALTH, strict=False):
        _panel(ax, _points(rows, key), label, "train step", f"no {key} in {METRICS}{why}")
    accuracy = sorted(_points(held_out, "accuracy"))
    _panel(axes.flat[3], accuracy, "held-out accuracy", "policy version (train step)", f"no held-out rounds ({EVAL})")
    if accuracy:
        axes.flat[3].set_ylim(0, 1)
    fig.suptitle(f"health over {len(rows)} steps — {title}", fontsize=10)
    return _save(fig, path)


def _points(rows: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of the rows that hold ``key`` as a number."""
    return [(r["step"], r[key]) for r in rows if isinstance(r.get("step"), int) and isinstance(r.get(key), int | float)]


def _panel(ax: Axes, points: list[tuple[int, float]], label: str, xlabel: str, missing: str) -> None:
    """One panel: the points as a line, or, without any, a note saying what is missing."""
    if points:
        ax.plot([s for s, _ in points], [v for _, v in points], marker="." if len(points) < 50 else None, lw=1)
        _whole_steps(ax.xaxis)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.grid(alpha=0.3)
    else:
        ax.text(0.5, 0.5, missing, ha="center", va="center", color="#666", transform=ax.transAxes)
        ax.set_xticks([])
        ax.set_yticks([])
    ax.set_title(label, fontsize=9)


def max_staleness(rows: list[dict[str, Any]], events: list[dict[str, Any]]) -> int | None:
    """K, as the broker recorded it (a metrics line, or the timeline's start)."""
    for source in (reversed(rows), (e for e in events if e["event"] == "started")):
        for r in source:
            if isinstance(r.get("max_staleness"), int):
                return r["max_staleness"]
    return None


def staleness(rows: list[dict[str, Any]], events: list[dict[str, Any]], path: pathlib.Path, *,
              title: str) -> pathlib.Path:  # fmt: skip
    """Share of trained trajectories per staleness value: the latest line's histogram is the run's so far."""
    import matplotlib.pyplot as plt

    hist = {int(k): int(v) for k, v in (rows[-1].get("staleness") or {}).items()}
    k = max_staleness(rows, events)
    total = sum(hist.values())
    top = max([*hist, k if k is not None else 0])
    xs = list(range(top + 1))
    shares = [hist.get(x, 0) / total if total else 0.0 for x in xs]
    fig, ax = plt.subplots(figsize=(7, 3.5))
    bars = ax.bar(xs, shares, color="#1f77b4", width=0.7)
    for bar, share in zip(bars, shares, strict=True):
        ax.annotate(f"{100 * share:.1f}%", (bar.get_x() + bar.get_width() / 2, share), ha="center", va="bottom",
                    fontsize=8)  # fmt: skip
    if k is not None:
        ax.axvline(k + 0.5, color="#d62728", ls="--", lw=1)
        ax.text(k + 0.5, 0.97, f" K = {k}", color="#d62728", fontsize=8, va="top", transform=ax.get_xaxis_transform())
    ax.set_xticks(xs)
    ax.set_xlim(-0.6, top + 1)
    ax.set_ylim(0, max([*shares, 0.01]) * 1.15)
    ax.set_xlabel("staleness at consumption (learner version - dispatch version)")
    ax.set_ylabel("share of trained trajectories")
    ax.set_title(f"staleness of {total:,} trajectories over {len(rows)} steps — {title}", fontsize=10)
    return _save(fig, path)


def spans(events: list[dict[str, Any]], end: float) -> dict[str, list[Span]]:
    """Each worker's load and serve spans, from its joined / assigned / ready / lost events (in join order)."""
    out: dict[str, list[Span]] = {}
    open_: dict[str, tuple[float, int, bool]] = {}

    def close(worker: str, t: float) -> None:
        if worker in open_:
            start, version, loading = open_.pop(worker)
            out[worker].append(Span(start, max(t, start), version, loading))

    for e in sorted(events, key=lambda e: e["t"]):
        worker = e.get("worker")
        if not isinstance(worker, str):
            continue
        out.setdefault(worker, [])
        match e["event"]:
            case "assigned" | "ready" if isinstance(e.get("version"), int):
                close(worker, e["t"])
                open_[worker] = (e["t"], e["version"], e["event"] == "assigned")
            case "joined" | "lost":
                close(worker, e["t"])
    for worker in list(open_):
        close(worker, end)
    return out


def timeline(events: list[dict[str, Any]], rows: list[dict[str, Any]], path: pathlib.Path, *,
             title: str) -> pathlib.Path:  # fmt: skip
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    times = [e["t"] for e in events] + [r["t"] for r in rows if isinstance(r.get("t"), int | float)]
    t0, end = min(times), max(times)
    lanes = spans(events, end)
    names = list(lanes)[:MAX_WORKERS]
    fig, ax = plt.subplots(figsize=(11, 0.35 * len(names) + 1.8))
    cmap = plt.get_cmap("tab10")
    width = max(end - t0, 1e-9)
    for row, worker in enumerate(names):
        for s in lanes[worker]:
            colour = cmap(s.version % 10)
            if s.loading:
                ax.barh(row, s.end - s.start, left=s.start - t0, height=0.7, color=colour, alpha=0.35,
                        hatch="////", edgecolor="#333", lw=0)  # fmt: skip
            else:
                ax.barh(row, s.end - s.start, left=s.start - t0, height=0.7, color=colour)
                if (s.end - s.start) / width > 0.025:
                    ax.text((s.start + s.end) / 2 - t0, row, f"v{s.version}", ha="center", va="center", fontsize=7)
    published = sorted((e["t"], e.get("version")) for e in events if e["event"] == "published")
    for t, _ in published:
        ax.axvline(t - t0, color="k", lw=0.5, alpha=0.5)
    ax.set_yticks(range(len(names)), [_short(w, names) for w in names], fontsize=7)
    ax.set_ylim(len(names) - 0.4, -0.6)
    ax.set_xlim(0, width)
    ax.set_xlabel("seconds since the broker started")
    ax.legend(handles=[Patch(color="#888", label="serving (colour: version)"),
                       Patch(facecolor="#ccc", hatch="////", edgecolor="#333", label="loading weights"),
                       Line2D([], [], color="k", lw=0.5, label="version published")],
              fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # fmt: skip
    shown = f" (first {MAX_WORKERS} of {len(lanes)})" if len(lanes) > len(names) else ""
    ax.set_title(f"worker timeline{shown}: {len(published)} versions published — {title}", fontsize=10)
    return _save(fig, path)


def _short(worker: str, names: list[str]) -> str:
    """``rollout/w0/1234`` as ``w0``, unless another row would get the same name."""

    def short(name: str) -> str:
        parts = name.split("/")
        return parts[1] if len(parts) >= 3 else name

    return short(worker) if [short(n) for n in names].count(short(worker)) == 1 else worker


def _whole_steps(axis: Axis) -> None:
    """Ticks only at whole steps: matplotlib's default locator, told that the values are integers."""
    from matplotlib.ticker import AutoLocator

    locator = AutoLocator()
    locator.set_params(integer=True)
    axis.set_major_locator(locator)


def _save(fig: Figure, path: pathlib.Path) -> pathlib.Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str]) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="dora plot", description=__doc__, formatter_class=fmt)
    p.add_argument("rundir", metavar="RUN_DIR", type=pathlib.Path)
    p.add_argument("--out", metavar="DIR", type=pathlib.Path, help="where the PNGs go (default: RUN_DIR)")
    args = p.parse_args(argv)
    try:
        paths = render(args.rundir, args.out)
    except PlotError as e:
        print(f"dora plot: {e}", file=sys.stderr)
        return 2
    print(f"dora plot: wrote {', '.join(x.name for x in paths)} in {paths[0].parent}", file=sys.stderr)
    return 0
