"""Convergence to held-out accuracy: sync vs dora K=1 vs dora K=3, with TRL's GRPOTrainer beside them.

    python bench/convergence.py [--config examples/arithmetic.toml] [--steps 150] [--seeds 0 1 2]
                                [--eval-every 10] [--eval-limit 200] [--no-trl | --trl-python PATH]
                                [--threads N] [--fresh-warm-start] [--out bench/out/convergence]
    python bench/convergence.py --report bench/out/convergence/convergence.json   # print again, run nothing

**Warm start.** Once per bench, `dora sft --config CFG --set sft.out=OUT/warm` (kept while OUT/warm/config.json
exists; ``--fresh-warm-start`` rebuilds it). Every variant and TRL start from OUT/warm; its accuracy on every
held-out row is the "before" figure.

**Runs.** Every dora variant is a real `dora run` (broker, torch rollout workers, torch GRPO learner) from the
warm start, with the config's data, reward, batch shape and ``--steps``; only ``core.mode`` and
``core.max_staleness`` differ, and ``run.seed`` = ``task.seed`` = the seed. TRL's GRPOTrainer
(`bench/trl_peer.py`) reads the same resolved config: same model, rows in the same order, same reward, group
size, prompts per step, completion length, temperature and optimizer. Runs are interleaved seed by seed, so
machine noise falls on every variant alike. Threads: `dora run` shares the machine's cores among its
processes (``run.threads`` = 0: cores // processes each); TRL's one process gets ``--threads`` torch threads
(default: every core).

**Accuracy.** Greedy exact match on [eval]'s held-out rows, scored by the configured reward.
- The curve: dora's evaluation rounds (``eval.every_steps`` = ``--eval-every``, ``eval.limit`` =
  ``--eval-limit`` rows, run by the rollout workers on exactly that version, recorded in the run's
  ``eval.jsonl``) plus `dora run`'s own before/after evaluations of version 0 and the last version (which
  honour ``eval.limit`` too, so they are on the same rows). Version v's accuracy is placed at v's publish time
  (its ``train_step`` line in broker.log), in seconds since the broker's ``fleet_ready``. TRL is evaluated by
  dora's evaluator on the same rows at the same steps, with its clock stopped meanwhile (``on_train_begin``
  is its zero). dora's rounds run on the rollout workers beside training, so their cost stays on dora's clock.
- The final accuracy: the last version on EVERY held-out row. `dora run`'s after-evaluation honours
  ``eval.limit``, so the bench evaluates the last published version itself, after the run, with
  ``dora.ops.evaluate.evaluate_model`` (what `dora eval --store --version` runs) on the run's resolved config
  (``run.toml``) with ``eval.limit`` unset.

Printed and written to OUT/convergence.json, with OUT/convergence.png (accuracy against seconds, reward
against steps; mean over seeds ± SE), the figures of ``bench/convergence_summary.py``: final accuracy ± SE,
parity with sync (within 2 SE of the difference), time to sync's final accuracy and its ratio to sync's own,
s/step, tokens/s. Targets: dora K=1 and K=3 at parity; dora reaches sync's final accuracy in <= 0.67 of
sync's time to it; dora's tokens/s >= 1.5x TRL's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from convergence_summary import plot, summarize  # noqa: E402

from dora.config import ConfigError, load  # noqa: E402
from dora.config.run import RunConfig  # noqa: E402

VARIANTS = {"sync": ("sync", 0), "dora-k1": ("dora", 1), "dora-k3": ("dora", 3)}


def ts(rec: dict[str, Any]) -> float:
    return datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()


def run_logged(argv: list[str], log: pathlib.Path, what: str) -> None:
    with open(log, "wb") as f:
        rc = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        raise RuntimeError(f"{what} exited {rc}; see {log}")


def all_rows(cfg: RunConfig, model: str, store: str | None = None, version: int | None = None) -> dict[str, Any]:
    """A model folder (or a store version in it) on every held-out row, with dora's evaluator."""
    from dora.ops.evaluate import evaluate_model

    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, limit=None))
    return evaluate_model(cfg, model, store, version)


def warm_start(args: argparse.Namespace, cfg: RunConfig, out: pathlib.Path) -> dict[str, Any]:
    """OUT/warm (built by `dora sft` unless it is there) and its accuracy on every held-out row."""
    warm = out / "warm"
    if args.fresh_warm_start or not (warm / "config.json").is_file():
        print(f"convergence: warm start: dora sft into {warm}", flush=True)
        argv = [sys.executable, "-m", "dora", "sft", "--config", args.config, "--set", f"sft.out={warm}"]
        run_logged(argv, out / "warm-sft.log", "dora sft")
    before = all_rows(cfg, str(warm))
    print(f"convergence: warm start: held-out accuracy {before['accuracy']:.3f} on {int(before['rows'])} rows",
          flush=True)  # fmt: skip
    return {"dir": str(warm), **before}


def common_sets(args: argparse.Namespace, seed: int, warm: str) -> list[str]:
    sets = [f"core.total_steps={args.steps}", f"run.seed={seed}", f"task.seed={seed}", f"rollout.model={warm}",
            f"eval.every_steps={args.eval_every}"]  # fmt: skip
    return sets + ([f"eval.limit={args.eval_limit}"] if args.eval_limit else [])


def dora_run(args: argparse.Namespace, variant: str, seed: int, out: pathlib.Path, warm: str) -> dict[str, Any]:
    mode, k = VARIANTS[variant]
    rundir = out / "runs" / f"{variant}-s{seed}"
    shutil.rmtree(rundir, ignore_errors=True)
    sets = [*common_sets(args, seed, warm), f"core.mode={mode}", f"core.max_staleness={k}", f"run.dir={rundir}"]
    argv = [sys.executable, "-m", "dora", "run", "--config", args.config, *(a for s in sets for a in ("--set", s))]
    run_logged(argv, out / f"{variant}-s{seed}.log", f"{variant} seed {seed}: dora run")
    [run] = sorted(rundir.iterdir())
    events = [json.loads(x) for x in (run / "broker.log").read_text().splitlines() if x.startswith("{")]
    t0 = ts(next(e for e in events if e.get("event") == "fleet_ready"))
    steps, published = [], {0: 0.0}
    for e in (e for e in events if e.get("event") == "train_step"):
        lr = e["learner"]
        published[e["version"]] = ts(e) - t0
        steps.append({"step": e["step"], "version": e["version"], "reward_mean": lr["reward_mean"],
                      "tokens": lr["tokens"], "elapsed_s": ts(e) - t0,
                      "staleness_max": max(int(s) for s in e["staleness"])})  # fmt: skip
    evals: dict[int, dict[str, Any]] = {}
    for line in (run / "eval.jsonl").read_text().splitlines():  # rounds and dora run's before/after; first wins
        e = json.loads(line)
        if e["version"] in published and e["version"] not in evals:
            v = e["version"]
            evals[v] = {"version": v, "elapsed_s": published[v], "accuracy": e["accuracy"], "rows": e["rows"],
                        "by": e.get("by", "round")}  # fmt: skip
    last = steps[-1]["version"]
    cfg = load(RunConfig, path=str(run / "run.toml"))
    final = all_rows(cfg, cfg.rollout.model, cfg.learner.store, last)
    return {"steps": steps, "evals": sorted(evals.values(), key=lambda e: e["version"]),
            "final": {**final, "elapsed_s": published[last]}, "dir": str(run)}  # fmt: skip


def trl_run(args: argparse.Namespace, python: str, seed: int, out: pathlib.Path, warm: str) -> dict[str, Any]:
    path = out / f"trl-s{seed}.json"
    sets = common_sets(args, seed, warm)
    argv = [python, str(ROOT / "bench" / "trl_peer.py"), "--config", args.config,
            *(a for s in sets for a in ("--set", s)), "--steps", str(args.steps), "--seed", str(seed),
            "--eval-every", str(args.eval_every), "--eval-limit", str(args.eval_limit), "--threads", str(args.threads),
            "--out", str(path)]  # fmt: skip
    run_logged(argv, out / f"trl-s{seed}.log", f"TRL seed {seed}")
    got = json.loads(path.read_text())
    got["evals"] = [{"version": e.pop("step"), **e} for e in got["evals"]]
    got["final"]["version"] = got["final"].pop("step")
    return got


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(ROOT / "examples" / "arithmetic.toml"))
    p.add_argument("--steps", type=int, help="train steps per run (default: the config's core.total_steps)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--eval-every", type=int, default=10, help="versions between held-out evaluation rounds")
    p.add_argument("--eval-limit", type=int, default=200, help="held-out rows per round (0: all); final: all rows")
    p.add_argument("--no-trl", action="store_true", help="leave out the TRL GRPOTrainer peer")
    p.add_argument("--trl-python", help="a Python with trl installed (default: this one)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="TRL's torch threads (default: all cores)")
    p.add_argument("--fresh-warm-start", action="store_true", help="rebuild OUT/warm even if it is there")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "convergence"))
    p.add_argument("--report", metavar="JSON", help="print the report of an earlier convergence.json; run nothing")
    args = p.parse_args(argv)
    if args.report:
        saved = json.loads(pathlib.Path(args.report).read_text())
        report(summarize(saved["runs"]), saved["settings"], saved["warm_start"])
        return 0
    if "sync" not in args.variants:
        p.error("--variants must include sync (everything is measured against it)")
    if args.eval_every < 1 or args.eval_limit < 0:
        p.error("--eval-every must be >= 1 and --eval-limit >= 0")
    args.config = str(pathlib.Path(args.config).resolve())
    out = pathlib.Path(args.out).resolve()
    os.chdir(ROOT)  # the config's relative paths are the repository's, as for every process the runs start
    try:
        cfg = load(RunConfig, path=args.config)
        if cfg.eval.dataset is None:
            raise ConfigError("the config has no eval.dataset (held-out rows)")
    except ConfigError as e:
        print(f"convergence: {e}", file=sys.stderr)
        return 2
    args.steps = args.steps or cfg.core.total_steps
    trl_python = None
    if not args.no_trl:
        trl_python = args.trl_python or sys.executable
        if args.trl_python is None and importlib.util.find_spec("trl") is None:
            print("convergence: trl is not installed here: `pip install -e '.[peers]'`, pass --trl-python, or "
                  "--no-trl", file=sys.stderr)  # fmt: skip
            return 2
    out.mkdir(parents=True, exist_ok=True)
    settings = {"config": args.config, "steps": args.steps, "seeds": args.seeds, "eval_every": args.eval_every,
                "eval_limit": args.eval_limit, "trl_threads": args.threads, "cores": os.cpu_count(),
                "workers": cfg.run.workers, "run_threads": cfg.run.threads}  # fmt: skip
    warm = warm_start(args, cfg, out)
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants} | ({"trl": []} if trl_python else {})
    started = time.monotonic()
    for seed in args.seeds:
        for variant in runs:
            if variant == "trl":
                runs["trl"].append(trl_run(args, trl_python, seed, out, warm["dir"]))
            else:
                runs[variant].append(dora_run(args, variant, seed, out, warm["dir"]))
            r = runs[variant][-1]
            print(f"[{time.monotonic() - started:6.0f} s] {variant} seed {seed}: {len(r['steps'])} steps in "
                  f"{r['steps'][-1]['elapsed_s']:.1f} s, final held-out accuracy {r['final']['accuracy']:.3f}",
                  flush=True)  # fmt: skip
    summary = summarize(runs)
    report(summary, settings, warm)
    saved = {"settings": settings, "warm_start": warm, "summary": summary, "runs": runs}
    (out / "convergence.json").write_text(json.dumps(saved, indent=1))
    plot(runs, out / "convergence.png")
    print(f"wrote {out / 'convergence.json'} and {out / 'convergence.png'}")
    return 0


PARITY = {True: "yes", False: "NO", None: "n/a (one seed)"}


def seconds(t: float | None) -> str:
    return "never" if t is None else f"{t:.1f} s"


def report(summary: dict[str, Any], settings: dict[str, Any], warm: dict[str, Any]) -> None:
    v, target = summary["variants"], summary["target_accuracy"]
    rows = int(summary["target_rows"])
    print(f"\n{settings['steps']} steps x {len(settings['seeds'])} seed(s) from the warm start (held-out accuracy "
          f"{warm['accuracy']:.3f} on {int(warm['rows'])} rows); final accuracy = the last version on every "
          f"held-out row; evaluation every {settings['eval_every']} versions on {rows} rows; time to sync's final "
          f"accuracy on those rows ({target:.3f}) = first evaluation at or above it, mean over the seeds that "
          f"reach it. Threads: dora run's {settings['workers']} workers + learner share {settings['cores']} cores "
          f"(run.threads {settings['run_threads']}), TRL {settings['trl_threads']} torch thread(s).\n")  # fmt: skip
    sync = v["sync"]
    print("| run | final accuracy (± SE) | parity with sync (±2 SE) | time to sync's final | ÷ sync's | s/step | "
          "tokens/s | final reward | max staleness |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, s in v.items():
        delta = abs(s["final_accuracy"] - sync["final_accuracy"])
        ratio = "-" if s["time_ratio"] is None else f"{s['time_ratio']:.2f}"
        print(f"| {name} | {s['final_accuracy']:.3f} ± {s['final_accuracy_se']:.3f} | "
              f"{PARITY[s['parity']]} (Δ {delta:.3f}, 2 SE {2 * s['diff_se']:.3f}) | "
              f"{seconds(s['time_to_target_s'])} ({s['reached']}/{s['seeds']}) | {ratio} | {s['s_per_step']:.3f} | "
              f"{s['tokens_per_s']:,.0f} | {s['final_reward']:.3f} | {s['max_staleness']} |")  # fmt: skip
    print()
    trl = v.get("trl")
    for name in (n for n in ("dora-k1", "dora-k3") if n in v):
        s = v[name]
        ratio = s["time_ratio"]
        every = s["reached"] == s["seeds"] and sync["reached"] == sync["seeds"]
        partial = "" if every else " (not every seed got there)"
        line = (f"{name}: final accuracy within 2 SE of sync's: {PARITY[s['parity']]} (target: yes); "
                f"sync's final accuracy in {'-' if ratio is None else f'{ratio:.2f}'} of sync's time to it{partial} "
                f"(target <= 0.67)")  # fmt: skip
        if trl:
            line += f"; tokens/s {s['tokens_per_s'] / trl['tokens_per_s']:.2f}x TRL's (target >= 1.5)"
        print(line)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
