"""Convergence parity: sync vs dora K=1 vs dora K=3 on the quickstart task, with TRL's GRPOTrainer beside them.

    python bench/convergence.py [--config examples/quickstart.toml] [--steps 200] [--seeds 0 1 2]
                                [--no-trl | --trl-python PATH] [--out bench/out/convergence]
    python bench/convergence.py --report bench/out/convergence/convergence.json   # print again, run nothing

Every run is a real `dora run` (broker, torch rollout workers, torch GRPO learner) on the same tiny
model, task, seed, batch shape and number of steps; only ``core.mode`` and ``core.max_staleness``
differ. TRL's GRPOTrainer (`bench/trl_peer.py`) runs the same model, prompts, reward, group size,
prompts per step, completion length and optimizer settings. Runs are interleaved seed by seed, so
machine noise falls on every variant alike.

Clocks start when the fleet is ready (dora: the broker's ``fleet_ready``; TRL: ``on_train_begin``),
so process start-up and model loading are left out of both.

Printed and written to OUT/convergence.json, with OUT/convergence.png (reward per step and per
second, mean over seeds with a ±1 SE band):
- final reward: mean over the last 20% of steps, per seed; mean ± SE over seeds. Parity holds when a
  variant's final reward is within 2 SE of sync's (SE of the difference of the two means);
- seconds per step and tokens/s (sampled completion tokens trained per second);
- time to 50%, 90% and 99% of sync's final reward: the first time the variant's trailing mean reward
  (window: 5% of the steps) gets there, mean over seeds. The 99% time is set against sync's whole
  wall-clock (target for dora K=3: <= 1/1.5) and against sync's own time to 99% (the fairer figure:
  it does not grow with the number of steps run after the plateau);
- dora tokens/s over TRL's (target >= 2).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import pathlib
import subprocess
import sys
import time
from datetime import datetime
from statistics import fmean, stdev
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.config import ConfigError, load  # noqa: E402
from dora.config.run import RunConfig  # noqa: E402

VARIANTS = {"sync": ("sync", 0), "dora-k1": ("dora", 1), "dora-k3": ("dora", 3)}


def ts(rec: dict[str, Any]) -> float:
    return datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()


def dora_run(cfg_path: str, variant: str, seed: int, steps: int, out: pathlib.Path) -> dict[str, Any]:
    mode, k = VARIANTS[variant]
    rundir = out / "runs" / f"{variant}-s{seed}"
    sets = [f"core.mode={mode}", f"core.max_staleness={k}", f"core.total_steps={steps}", f"run.seed={seed}",
            f"task.seed={seed}", f"run.dir={rundir}"]  # fmt: skip
    argv = [sys.executable, "-m", "dora", "run", "--config", cfg_path, *(a for s in sets for a in ("--set", s))]
    with open(out / f"{variant}-s{seed}.log", "wb") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        raise RuntimeError(f"{variant} seed {seed}: dora run exited {rc}; see {out / f'{variant}-s{seed}.log'}")
    [run] = sorted(rundir.iterdir())
    events = [json.loads(x) for x in (run / "broker.log").read_text().splitlines() if x.startswith("{")]
    t0 = ts(next(e for e in events if e.get("event") == "fleet_ready"))
    rows = []
    for e in (e for e in events if e.get("event") == "train_step"):
        lr = e["learner"]
        rows.append({"step": e["step"], "reward_mean": lr["reward_mean"], "tokens": lr["tokens"],
                     "elapsed_s": ts(e) - t0, "staleness_max": max(int(s) for s in e["staleness"])})  # fmt: skip
    return {"steps": rows, "dir": str(run)}


def trl_run(python: str, cfg: RunConfig, seed: int, steps: int, out: pathlib.Path) -> dict[str, Any]:
    path = out / f"trl-s{seed}.json"
    model = cfg.rollout.model or "runs/tiny-model"
    if not (ROOT / model / "config.json").is_file() and not pathlib.Path(model, "config.json").is_file():
        from dora.tasks.model import build_model

        build_model(model)
    argv = [python, str(ROOT / "bench" / "trl_peer.py"), "--model", model, "--steps", str(steps), "--seed", str(seed),
            "--groups", str(cfg.core.train_groups), "--group-size", str(cfg.core.group_size),
            "--max-tokens", str(cfg.run.max_tokens), "--temperature", str(cfg.run.temperature),
            "--lr", str(cfg.learner.lr), "--micro-batch", str(cfg.learner.micro_batch), "--task", cfg.task.name,
            "--out", str(path), *(["--reward", cfg.task.reward] if cfg.task.reward else [])]  # fmt: skip
    with open(out / f"trl-s{seed}.log", "wb") as log:
        rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        raise RuntimeError(f"TRL seed {seed} exited {rc}; see {out / f'trl-s{seed}.log'}")
    return json.loads(path.read_text())


def trailing(xs: list[float], window: int) -> list[float]:
    return [fmean(xs[max(0, i + 1 - window) : i + 1]) for i in range(len(xs))]


def mean_se(xs: list[float]) -> tuple[float, float]:
    return fmean(xs), (stdev(xs) / math.sqrt(len(xs)) if len(xs) > 1 else float("nan"))


LEVELS = (0.5, 0.9, 0.99)
"""Time-to-reward levels, as fractions of sync's final reward."""


def summarize(runs: dict[str, list[dict[str, Any]]], steps: int) -> dict[str, Any]:
    tail = max(1, steps // 5)
    window = max(1, steps // 20)
    out: dict[str, Any] = {}
    for name, seeds in runs.items():
        finals = [fmean(r["reward_mean"] for r in run["steps"][-tail:]) for run in seeds]
        walls = [run["steps"][-1]["elapsed_s"] for run in seeds]
        tokens = [sum(r["tokens"] for r in run["steps"]) for run in seeds]
        final, se = mean_se(finals)
        out[name] = {
            "final_reward": final,
            "final_reward_se": se,
            "final_reward_per_seed": finals,
            "wall_s": fmean(walls),
            "s_per_step": fmean(w / len(run["steps"]) for w, run in zip(walls, seeds, strict=True)),
            "tokens_per_s": fmean(t / w for t, w in zip(tokens, walls, strict=True)),
            "max_staleness": max((r.get("staleness_max", 0) for run in seeds for r in run["steps"]), default=0),
        }
    sync = out["sync"]
    for name, seeds in runs.items():
        s = out[name]
        diff_se = math.sqrt(sync["final_reward_se"] ** 2 + s["final_reward_se"] ** 2)
        s["parity"] = abs(s["final_reward"] - sync["final_reward"]) <= 2 * diff_se
        s["diff_se"] = diff_se
        s["time_to_level_s"] = {}
        for level in LEVELS:
            reach = []
            for run in seeds:  # the first time the trailing mean reward gets to the level
                smooth = trailing([r["reward_mean"] for r in run["steps"]], window)
                target = level * sync["final_reward"]
                reach.append(next((r["elapsed_s"] for r, v in zip(run["steps"], smooth, strict=True) if v >= target),
                                  None))  # fmt: skip
            s["time_to_level_s"][str(level)] = None if None in reach else fmean(reach)
    return out


def plot(runs: dict[str, list[dict[str, Any]]], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for name, seeds in runs.items():
        n = min(len(run["steps"]) for run in seeds)
        curves = [[r["reward_mean"] for r in run["steps"][:n]] for run in seeds]
        window = max(1, n // 20)
        mean = trailing([fmean(c[i] for c in curves) for i in range(n)], window)
        se = trailing([stdev(c[i] for c in curves) / math.sqrt(len(curves)) if len(curves) > 1 else 0.0
                       for i in range(n)], window)  # fmt: skip
        x = list(range(n))
        secs = [fmean(run["steps"][i]["elapsed_s"] for run in seeds) for i in range(n)]
        for ax, xs in ((a, x), (b, secs)):
            ax.plot(xs, mean, label=f"{name} ({len(seeds)} seeds)")
            ax.fill_between(xs, [m - e for m, e in zip(mean, se, strict=True)],
                            [m + e for m, e in zip(mean, se, strict=True)], alpha=0.2)  # fmt: skip
    a.set_xlabel("train step")
    b.set_xlabel("seconds since the fleet was ready")
    for ax in (a, b):
        ax.set_ylabel(f"mean reward (trailing mean of {max(1, n // 20)} steps)")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "examples" / "quickstart.toml"))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--no-trl", action="store_true", help="leave out the TRL GRPOTrainer peer")
    p.add_argument("--trl-python", help="a Python with trl installed (default: this one)")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "convergence"))
    p.add_argument("--report", metavar="JSON", help="print the report of an earlier convergence.json; run nothing")
    args = p.parse_args(argv)
    if args.report:
        runs = json.loads(pathlib.Path(args.report).read_text())["runs"]
        steps = len(runs["sync"][0]["steps"])
        report(summarize(runs, steps), steps, len(runs["sync"]))
        return 0
    if "sync" not in args.variants:
        p.error("--variants must include sync (everything is measured against it)")
    try:
        cfg = load(RunConfig, path=args.config)
    except ConfigError as e:
        print(f"convergence: {e}", file=sys.stderr)
        return 2
    trl_python = None
    if not args.no_trl:
        trl_python = args.trl_python or sys.executable
        if args.trl_python is None and importlib.util.find_spec("trl") is None:
            print("convergence: trl is not installed here: `pip install -e '.[peers]'`, pass --trl-python, or "
                  "--no-trl", file=sys.stderr)  # fmt: skip
            return 2
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
    if trl_python:
        runs["trl"] = []
    started = time.monotonic()
    for seed in args.seeds:
        for variant in args.variants:
            runs[variant].append(dora_run(args.config, variant, seed, args.steps, out))
            print(f"[{time.monotonic() - started:6.0f} s] {variant} seed {seed}: {runs[variant][-1]['steps'][-1]}",
                  flush=True)  # fmt: skip
        if trl_python:
            runs["trl"].append(trl_run(trl_python, cfg, seed, args.steps, out))
            print(f"[{time.monotonic() - started:6.0f} s] trl seed {seed}: {runs['trl'][-1]['steps'][-1]}", flush=True)
    summary = summarize(runs, args.steps)
    report(summary, args.steps, len(args.seeds))
    (out / "convergence.json").write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    plot(runs, out / "convergence.png")
    print(f"wrote {out / 'convergence.json'} and {out / 'convergence.png'}")
    return 0


def report(summary: dict[str, Any], steps: int, seeds: int) -> None:
    tail, window = max(1, steps // 5), max(1, steps // 20)
    print(
        f"\n{steps} steps x {seeds} seeds; final reward = mean of the last {tail} steps; time to a level = first "
        f"time the trailing mean of {window} steps reaches that share of sync's final\n"
    )
    sync = summary["sync"]
    levels = " | ".join(f"to {int(100 * x)}%" for x in LEVELS)
    print(f"| run | final reward (± SE) | parity with sync (±2 SE) | s/step | tokens/s | {levels} | max staleness |")
    print("|---|---|---|---|---|" + "---|" * len(LEVELS) + "---|")
    for name, s in summary.items():
        times = " | ".join("never" if (t := s["time_to_level_s"][str(x)]) is None else f"{t:.1f} s" for x in LEVELS)
        delta = abs(s["final_reward"] - sync["final_reward"])
        print(f"| {name} | {s['final_reward']:.4f} ± {s['final_reward_se']:.4f} | "
              f"{'yes' if s['parity'] else 'NO'} (|Δ| {delta:.4f} vs {2 * s['diff_se']:.4f}) | {s['s_per_step']:.3f} | "
              f"{s['tokens_per_s']:,.0f} | {times} | {s['max_staleness']} |")  # fmt: skip
    print()
    top = str(LEVELS[-1])
    for name, s in summary.items():
        if name == "sync":
            continue
        mine, theirs = s["time_to_level_s"][top], sync["time_to_level_s"][top]
        frac = "-" if mine is None else f"{mine / sync['wall_s']:.2f}"
        ratio = "-" if None in (mine, theirs) else f"{mine / theirs:.2f}"
        print(f"{name}: {int(100 * LEVELS[-1])}% of sync's final reward in {frac} of sync's wall-clock"
              f"{' (target for dora K=3: <= 0.67)' if name == 'dora-k3' else ''}, in {ratio} of the time sync takes to "
              f"get there; {sync['s_per_step'] / s['s_per_step']:.2f}x sync's steps per second")  # fmt: skip
    if "trl" in summary:
        trl = summary["trl"]["tokens_per_s"]
        for name in (n for n in ("dora-k1", "dora-k3", "sync") if n in summary):
            ratio = summary[name]["tokens_per_s"] / trl
            print(f"{name} tokens/s ÷ TRL GRPOTrainer's: {ratio:.2f}x (target for dora: >= 2)")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
