"""The README's first command over several seeds: warm start, GRPO, held-out greedy exact match before and after.

    python bench/quickstart.py [--config examples/arithmetic.toml] [--seeds 0 1 2] [--out bench/out/quickstart]
    python bench/quickstart.py --report bench/out/quickstart/quickstart.json   # print again, run nothing
    python bench/quickstart.py --config C --warm-start DIR [--set SECTION.KEY=VALUE ...]  # one warm start for all

With ``--warm-start DIR`` no seed runs ``dora sft``: every seed's ``dora run`` starts from the model folder DIR
(one warm start, written once by ``dora sft --config C``), so the seeds differ in sampling, prompt order and
evaluation draws only, and the report says so. ``--set`` passes settings on to every ``dora run``.

Per seed, exactly what the README's first command runs, with the seed set everywhere it matters:
``dora sft --config CFG`` (``sft.seed``: the order of the rows, torch's initial state) writing its own
model folder, then ``dora run --config CFG`` from it (``run.seed``, ``task.seed``: sampling and the
order of the prompts). The held-out figures are the ones ``dora run`` itself records in the run's
``eval.jsonl`` (lines ``"by": "dora run"``): the warm start (version 0) and the final version, sampled as
[eval] says (greedy in examples/arithmetic.toml; at T = 1, 4 samples a row, in examples/envs/calculator.toml),
on the test rows of ``eval.dataset`` (all of them unless ``eval.limit`` says otherwise).

Printed and written to OUT/quickstart.json: per seed the accuracy before and after and the wall-clock of
each command; over seeds the mean ± SE (stdev / sqrt(n)) of before, after and the rise, and the rise in
units of the after-accuracy's seed-to-seed SE.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from convergence_summary import mean_se  # noqa: E402


def run(argv: list[str], log: pathlib.Path) -> float:
    """Run a dora command, its output into ``log``; its wall-clock seconds (a failure raises, naming the log)."""
    started = time.perf_counter()
    with open(log, "wb") as f:
        argv_ = [sys.executable, "-m", "dora", *argv]
        rc = subprocess.run(argv_, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT).returncode
    if rc != 0:
        raise RuntimeError(f"dora {argv[0]} exited {rc}; see {log}")
    return time.perf_counter() - started


def one_seed(cfg: str, seed: int, out: pathlib.Path, warm_start: pathlib.Path | None = None,
             extra: tuple[str, ...] = ()) -> dict[str, Any]:  # fmt: skip
    model, runs = warm_start or out / f"sft-s{seed}", out / f"runs-s{seed}"
    sft_s = 0.0
    if warm_start is None:
        sft = ["sft", "--config", cfg, "--set", f"sft.seed={seed}", "--set", f"sft.out={model}"]
        sft_s = run(sft, out / f"sft-s{seed}.log")
    sets = [*extra, f"rollout.model={model}", f"run.seed={seed}", f"task.seed={seed}", f"run.dir={runs}"]
    rl_s = run(["run", "--config", cfg, *(a for s in sets for a in ("--set", s))], out / f"run-s{seed}.log")
    rundir, before, after = held_out(runs)
    return {**weights(rundir), "seed": seed, "before": before["accuracy"], "after": after["accuracy"],
            "rows": int(after["rows"]), "final_version": after["version"], "mean_tokens_before": before["mean_tokens"],
            "mean_tokens_after": after["mean_tokens"], "sft_s": sft_s, "run_s": rl_s, "dir": str(rundir)}  # fmt: skip


def held_out(runs: pathlib.Path) -> tuple[pathlib.Path, dict[str, Any], dict[str, Any]]:
    """The newest run directory under ``runs`` and the held-out evaluations ``dora run`` recorded there (lines
    ``"by": "dora run"`` of its eval.jsonl): of version 0 and of the last version."""
    [rundir] = sorted(runs.iterdir())[-1:]
    lines = [json.loads(x) for x in (rundir / "eval.jsonl").read_text().splitlines()]
    mine = [x for x in lines if x.get("by") == "dora run"]
    if len(mine) != 2:
        raise RuntimeError(f"{rundir / 'eval.jsonl'}: expected dora run's before and after evaluations, got {mine}")
    return rundir, mine[0], mine[1]


def weights(rundir: pathlib.Path) -> dict[str, float]:
    """How heavy a version is on the run's weight path: the median seconds the learner took to publish one
    (``publish_s`` of metrics.jsonl), the median seconds a worker took to load one from the store (``took_s`` of
    its ``weights_loaded`` lines) and the bytes of the newest version's folder."""
    steps = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    loads = [r["took_s"] for log in sorted(rundir.glob("w*.log")) for r in map(json.loads, log_lines(log))
             if r.get("event") == "weights_loaded" and str(r.get("uri", "")).startswith("file://") and "took_s" in r
             ]  # fmt: skip
    versions = sorted((rundir / "weights").glob("v*"), key=lambda p: int(p.name[1:]))
    return {"publish_s": statistics.median(r["publish_s"] for r in steps),
            "load_s": statistics.median(loads) if loads else float("nan"),
            "version_bytes": sum(f.stat().st_size for f in versions[-1].iterdir()) if versions else 0}  # fmt: skip


def log_lines(path: pathlib.Path) -> list[str]:
    return [x for x in path.read_text().splitlines() if x.startswith("{")]


def report(seeds: list[dict[str, Any]]) -> dict[str, Any]:
    print("| seed | before | after | rise | mean tokens before → after | sft s | run s | total s |")
    print("|---|---|---|---|---|---|---|---|")
    for s in seeds:
        print(f"| {s['seed']} | {s['before']:.3f} | {s['after']:.3f} | {s['after'] - s['before']:+.3f} | "
              f"{s['mean_tokens_before']:.1f} → {s['mean_tokens_after']:.1f} | {s['sft_s']:.0f} | {s['run_s']:.0f} | "
              f"{s['sft_s'] + s['run_s']:.0f} |")  # fmt: skip
    (b, b_se), (a, a_se) = mean_se([s["before"] for s in seeds]), mean_se([s["after"] for s in seeds])
    rise, rise_se = mean_se([s["after"] - s["before"] for s in seeds])
    summary = {"before": b, "before_se": b_se, "after": a, "after_se": a_se, "rise": rise, "rise_se": rise_se,
               "rise_in_after_se": rise / a_se if a_se > 0 else float("inf"),
               "total_s_max": max(s["sft_s"] + s["run_s"] for s in seeds)}  # fmt: skip
    print(
        f"\n{len(seeds)} seeds, {seeds[0]['rows']} held-out rows: before {b:.3f} ± {b_se:.3f}, "
        f"after {a:.3f} ± {a_se:.3f}, rise {rise:+.3f} ± {rise_se:.3f} = {summary['rise_in_after_se']:.1f} x "
        f"the after-accuracy's seed-to-seed SE; slowest seed {summary['total_s_max']:.0f} s for both commands"
    )
    if all("publish_s" in s for s in seeds):
        summary.update({k: statistics.median(s[k] for s in seeds) for k in ("publish_s", "load_s", "version_bytes")})
        print(f"a version: {summary['version_bytes'] / 1e6:.2f} MB, published in {summary['publish_s']:.3f} s and "
              f"loaded by a worker in {summary['load_s']:.3f} s (medians)")  # fmt: skip
    return summary


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="examples/arithmetic.toml")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "quickstart"))
    p.add_argument("--report", metavar="JSON", help="print the report of an earlier quickstart.json; run nothing")
    p.add_argument("--warm-start", metavar="DIR", help="one model folder every seed's dora run starts from (no sft)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="passed to dora run")
    args = p.parse_args(argv)
    if args.report:
        report(json.loads(pathlib.Path(args.report).read_text())["seeds"])
        return 0
    out = pathlib.Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    seeds = []
    warm = pathlib.Path(args.warm_start).resolve() if args.warm_start else None
    if warm is not None and not (warm / "config.json").is_file():
        p.error(f"--warm-start {args.warm_start}: not a model folder (no config.json)")
    for seed in args.seeds:
        seeds.append(one_seed(args.config, seed, out, warm, tuple(args.set)))
        s = seeds[-1]
        print(f"seed {seed}: {s['before']:.3f} -> {s['after']:.3f} in {s['sft_s'] + s['run_s']:.0f} s", flush=True)
    summary = report(seeds)
    if warm is not None:
        print(f"one warm start for every seed: {warm} (the seeds' sft s are 0)")
    record = {"config": args.config, "warm_start": str(warm) if warm else None, "sets": args.set,
              "summary": summary, "seeds": seeds}  # fmt: skip
    (out / "quickstart.json").write_text(json.dumps(record, indent=1))
    print(f"wrote {out / 'quickstart.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
