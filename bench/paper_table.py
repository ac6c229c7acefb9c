"""DORA's Table A, reproduced on the production core, beside the paper's numbers; plus the sweeps.

    python bench/paper_table.py                 # both paper configs + every sweep -> bench/out/
    python bench/paper_table.py --only table    # just the two paper configs
    python bench/paper_table.py --only sweeps --steps 8
    python bench/paper_table.py --only pareto --table bench/out_table/paper_table.json --out bench/out_table
    python bench/paper_table.py --only table --variants sync,dora --set trainer.weights_gb=65.5 \
        --set trainer.overlap_publish=true      # some rows, with a setting changed in every run

Each run is the same `dora.core.core.Core` the broker runs, driven by the simulator. Only the
64-GPU synchronous run was calibrated (bench/calibrate.py); everything else printed is a prediction.
Disaggregated modes get their best rollout/trainer split, and the elastic variant its best number of
elastic workers (searched, then stated). Sweeps reuse each
mode's split fraction from the 64-GPU table so that only the swept condition changes.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from dora.config import load
from dora.config.sim import SimConfig
from dora.ids import Mode
from dora.sim.plots import pareto, staleness, throughput_bars, timeline, xy_plot
from dora.sim.runner import ModeResult, simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {64: ROOT / "examples/sim/paper-64gpu.toml", 128: ROOT / "examples/sim/paper-128gpu.toml"}

# DORA paper (arXiv 2604.26256v1), Table A. None = not reported. Derived cells are marked in paper.md.
PAPER = {
    64: {"sync": (22.91, 14143, 0.65), "one_step": (22.94, 14141, 0.33), "partial": (17.38, 19872, 0.46),
         "dora": (14.67, 23327, 0.12)},
    128: {"sync": (20.23, 16070, 0.73), "one_step": (14.0, 23200, None), "partial": (13.95, 30750, None),
          "dora": (10.46, 34135, 0.24)},
}  # fmt: skip

VARIANTS: list[tuple[str, Mode, list[str]]] = [
    ("sync", Mode.SYNC, []),
    ("one_step", Mode.ONE_STEP, []),
    ("partial", Mode.PARTIAL, []),
    ("dora", Mode.DORA, []),
    ("dora colocated", Mode.DORA, ["cluster.placement.dora=colocated"]),
    ("dora elastic", Mode.DORA, ["cluster.placement.dora=elastic"]),
    ("dora elastic adaptive", Mode.DORA, ["cluster.placement.dora=elastic", "core.deadlines=adaptive"]),
    ("dora no legacy fill", Mode.DORA, ["core.legacy_fill=false"]),
    ("drop_stale", Mode.DROP_STALE, []),
]


def run(cfg_path: pathlib.Path, mode: Mode, overrides: list[str], *, timeline_on: bool = False) -> ModeResult:
    cfg = load(SimConfig, path=str(cfg_path), overrides=overrides)
    return simulate(cfg, mode, timeline=timeline_on)


def _row(gpus: int, name: str, mode: Mode, overrides: list[str]) -> ModeResult:
    """One variant of the table (a process pool's task)."""
    t0 = time.perf_counter()
    r = run(CONFIGS[gpus], mode, overrides, timeline_on=name in ("sync", "dora", "partial"))
    r.metrics["variant"] = name
    r.metrics["sim_seconds"] = time.perf_counter() - t0
    r.metrics["decision_s_per_step"] = r.outcome.decision_s / max(1, len(r.outcome.steps))  # wall clock
    return r


def table(gpus: int, out: pathlib.Path, extra: list[str], jobs: int = 1, variants: list[str] | None = None
          ) -> dict[str, Any]:  # fmt: skip
    """The table's rows (``variants``: those only; None: every one), each run with the ``extra`` overrides."""
    rows: dict[str, dict[str, Any]] = {}
    results: dict[str, ModeResult] = {}
    chosen = [v for v in VARIANTS if variants is None or v[0] in variants]
    with ProcessPoolExecutor(jobs) as pool:
        futures = {name: pool.submit(_row, gpus, name, mode, overrides + extra) for name, mode, overrides in chosen}
        for name, future in futures.items():
            r = future.result()
            rows[name], results[name] = r.metrics, r
            print(f"  {gpus} GPUs {name:>20}: {r.metrics['step_time_s'] / 60:6.2f} min/step "
                  f"({r.metrics['sim_seconds']:.0f}s to simulate)", file=sys.stderr, flush=True)  # fmt: skip
    print_table(gpus, rows)
    picks = [results[n] for n in ("sync", "one_step", "partial", "dora", "drop_stale") if n in results]
    throughput_bars([r.metrics for r in results.values()], out / f"throughput_{gpus}gpu.png",
                    title=f"paper-{gpus}gpu", label="variant")  # fmt: skip
    staleness(picks, out / f"staleness_{gpus}gpu.png", title=f"paper-{gpus}gpu")
    for name in ("sync", "partial", "dora"):
        if name in results:
            timeline(results[name], out / f"timeline_{gpus}gpu_{name}.png", title=f"paper-{gpus}gpu")
    return rows


FRONTIER_SEEDS = 3
"""Seeds per point of the frontier: a 20-step run's throughput moves by several percent with the workload's seed
(more than the gap between neighbouring K), so each point is the mean over seeds, each seed's run kept beside it."""
POLICIES: list[tuple[str, list[str]]] = [(f"fixed K={k}", [f"core.max_staleness={k}"]) for k in (1, 2, 3)] + [
    ("adaptive K=3", ["core.max_staleness=3", "core.deadlines=adaptive"])
]
KEPT = ("throughput_tokens_per_s", "mean_staleness", "step_time_s", "max_staleness_consumed", "c1_violations",
        "dropped_groups")  # fmt: skip


def _metrics(cfg_path: pathlib.Path, mode: Mode, overrides: list[str]) -> dict[str, Any]:
    """One run's kept metrics (a process pool's task: the outcome itself stays in the worker)."""
    m = run(cfg_path, mode, overrides).metrics
    return {k: m[k] for k in KEPT}


def frontier(gpus: int, elastic: dict[str, Any], out: pathlib.Path, extra: list[str], *, seeds: int = FRONTIER_SEEDS,
             jobs: int = 1) -> dict[str, Any]:  # fmt: skip
    """Throughput against mean consumed staleness: fixed K = 1, 2, 3 and adaptive deadlines with K = 3, all on
    the elastic placement the table found (the same workers, so only the deadline policy changes), each the
    mean of ``seeds`` runs (``run.seed`` 0, 1, ...; seed 0 is the table's own workload)."""
    g = elastic["rollout_gpus"] // elastic["rollout_workers"]
    place = ["cluster.placement.dora=elastic", f"cluster.elastic_gpus={elastic['elastic_workers'] * g}", *extra]
    tasks = [(name, seed, [*place, *ov, f"run.seed={seed}"]) for name, ov in POLICIES for seed in range(seeds)]
    with ProcessPoolExecutor(max(1, jobs)) as pool:
        done = list(pool.map(_metrics, *zip(*[(CONFIGS[gpus], Mode.DORA, ov) for _, _, ov in tasks], strict=True)))
    points: dict[str, dict[str, Any]] = {}
    for name, _ in POLICIES:
        runs = [m for (n, _, _), m in zip(tasks, done, strict=True) if n == name]
        points[name] = {
            "throughput_tokens_per_s": statistics.fmean(r["throughput_tokens_per_s"] for r in runs),
            "mean_staleness": statistics.fmean(r["mean_staleness"] for r in runs),
            "step_time_s": statistics.fmean(r["step_time_s"] for r in runs),
            "max_staleness_consumed": max(r["max_staleness_consumed"] for r in runs),
            "c1_violations": sum(r["c1_violations"] for r in runs),
            "dropped_groups": sum(r["dropped_groups"] for r in runs),
            "per_seed": runs,
        }
    print(f"\n#### {gpus} GPUs: throughput vs staleness (dora, {elastic['elastic_workers'] * g} of "
          f"{elastic['rollout_gpus']} GPUs elastic; mean of {seeds} seeds, min-max beside)\n")  # fmt: skip
    print("| policy | tokens/s | mean staleness | max staleness | C1 viol. | dropped |")
    print("|---|---|---|---|---|---|")
    for name, m in points.items():
        tps = [r["throughput_tokens_per_s"] for r in m["per_seed"]]
        st = [r["mean_staleness"] for r in m["per_seed"]]
        print(f"| {name} | {m['throughput_tokens_per_s']:,.0f} ({min(tps):,.0f}-{max(tps):,.0f}) | "
              f"{m['mean_staleness']:.2f} ({min(st):.2f}-{max(st):.2f}) | {m['max_staleness_consumed']} | "
              f"{m['c1_violations']} | {m['dropped_groups']} |")  # fmt: skip
    a, k2, k3 = points["adaptive K=3"], points["fixed K=2"], points["fixed K=3"]
    dominates = (a["throughput_tokens_per_s"] >= k3["throughput_tokens_per_s"]
                 and a["mean_staleness"] <= k2["mean_staleness"])  # fmt: skip
    paired = sum(
        x["throughput_tokens_per_s"] >= y["throughput_tokens_per_s"] and x["mean_staleness"] <= z["mean_staleness"]
        for x, y, z in zip(a["per_seed"], k3["per_seed"], k2["per_seed"], strict=True)
    )
    print(f"\nadaptive K=3 dominates (tokens/s >= fixed K=3's and staleness <= fixed K=2's), on the means: "
          f"{'yes' if dominates else 'no'} ({a['throughput_tokens_per_s'] / k3['throughput_tokens_per_s']:.3f}x "
          f"K=3's tokens/s at {a['mean_staleness']:.2f} vs K=2's {k2['mean_staleness']:.2f}); "
          f"seed by seed: {paired} of {seeds}")  # fmt: skip
    pareto(points, out / f"pareto_{gpus}gpu.png", title=f"paper-{gpus}gpu, mean of {seeds} seeds")
    return {**points, "dominance": {"on_means": dominates, "seeds_dominated": paired, "seeds": seeds}}


def print_table(gpus: int, rows: dict[str, dict[str, Any]]) -> None:
    """The rows beside the paper's; ratios to sync where sync ran, the summary where sync, partial and dora did."""
    sync = rows["sync"]["throughput_tokens_per_s"] if "sync" in rows else None
    print(f"\n### {gpus} GPUs: ours beside the paper's Table A (steady state, steps after warm-up)\n")
    print("| variant | GPUs (rollout+trainer) | step min: ours / paper | tokens/s: ours / paper | "
          "rollout-only: ours / paper | vs sync (ours) | max staleness | C1 viol. | dropped |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, m in rows.items():
        paper = PAPER[gpus].get(m["mode"]) if name == m["mode"] else None
        p_step, p_tps, p_ro = paper or (None, None, None)
        where = _where(m)
        print(f"| {name} | {where} | {m['step_time_s'] / 60:.2f} / {_fmt(p_step, '.2f')} | "
              f"{m['throughput_tokens_per_s']:,.0f} / {_fmt(p_tps, ',.0f')} | "
              f"{m['rollout_only_fraction']:.0%} / {_fmt(p_ro, '.0%')} | "
              f"{_ratio(m['throughput_tokens_per_s'], sync)} | "
              f"{m['max_staleness_consumed']} | {m['c1_violations']} | {m['dropped_groups']} |")  # fmt: skip
    if {"sync", "partial", "dora"} <= rows.keys():
        _summary(gpus, rows)


def _summary(gpus: int, rows: dict[str, dict[str, Any]]) -> None:
    sync = rows["sync"]["throughput_tokens_per_s"]
    d, p = rows["dora"]["throughput_tokens_per_s"], rows["partial"]["throughput_tokens_per_s"]
    best = max((m for n, m in rows.items() if n.startswith("dora")), key=lambda m: m["throughput_tokens_per_s"])
    print(f"\ndora / sync = {d / sync:.2f}x (paper {PAPER[gpus]['dora'][1] / PAPER[gpus]['sync'][1]:.2f}x), "
          f"dora / partial = {d / p:.2f}x (paper {PAPER[gpus]['dora'][1] / PAPER[gpus]['partial'][1]:.2f}x); "
          f"best dora variant ({best['variant']}) / sync = {best['throughput_tokens_per_s'] / sync:.2f}x")  # fmt: skip
    ro = best["rollout_only_fraction"]
    target = {64: 1.65, 128: 2.12}[gpus]
    print(
        f"targets: best dora / sync {best['throughput_tokens_per_s'] / sync:.2f}x (>= {target}), "
        f"/ partial {best['throughput_tokens_per_s'] / p:.2f}x (>= 1.1), rollout-only {ro:.0%} (<= 12%)"
    )
    ds = rows.get("drop_stale")
    if ds:
        buckets = ", ".join(f"{k}: {v:.0%}" for k, v in ds["dropped_fraction_by_length"].items())
        print(f"drop_stale dropped {ds['dropped_groups']} groups; share of samples dropped by length: {buckets}")


# The paper's 64 -> 128 GPU throughput ratios (paper.md, Table A): sync 1.13x, partial 1.25x, DORA 1.46x.
PAPER_SCALING = {"sync": 1.13, "partial": 1.25, "dora": 1.46}


def scaling(small: dict[str, dict[str, Any]], big: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Throughput 64 -> 128 GPUs per variant beside the paper's, and what orchestration cost per step: the
    wall-clock seconds the core spent deciding, measured on the production core at each fleet size."""
    print("\n### 64 -> 128 GPUs\n")
    print("| variant | throughput 128 / 64: ours / paper | step min 64 -> 128 | core decisions s/step 64 -> 128 |")
    print("|---|---|---|---|")
    out: dict[str, Any] = {}
    for name, m in small.items():
        if name not in big:
            continue
        b = big[name]
        ratio = b["throughput_tokens_per_s"] / m["throughput_tokens_per_s"]
        out[name] = {"throughput_ratio": ratio, "paper": PAPER_SCALING.get(name),
                     "decision_s_per_step": (m["decision_s_per_step"], b["decision_s_per_step"])}  # fmt: skip
        print(f"| {name} | {ratio:.2f}x / {_fmt(PAPER_SCALING.get(name), '.2f')}{'x' if name in PAPER_SCALING else ''}"
              f" | {m['step_time_s'] / 60:.2f} -> {b['step_time_s'] / 60:.2f} | "
              f"{m['decision_s_per_step']:.3f} -> {b['decision_s_per_step']:.3f} |")  # fmt: skip
    return out


def _where(m: dict[str, Any]) -> str:
    """The placement in GPUs: colocated, rollout+trainer, or standalone + elastic (the trainer's GPUs)."""
    if m["placement"] == "colocated":
        return "colocated"
    if m["placement"] == "elastic":
        elastic = m["elastic_workers"] * m["rollout_gpus"] // m["rollout_workers"]
        return f"{m['rollout_gpus'] - elastic} standalone + {elastic} elastic"
    return f"{m['rollout_gpus']}+{m['trainer_gpus']}"


def _ratio(value: float, sync: float | None) -> str:
    return "n/r" if sync is None else f"{value / sync:.2f}x"


def _fmt(value: float | None, spec: str) -> str:
    return "n/r" if value is None else format(value, spec)


def split_fractions(rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    return {n: m["rollout_gpus"] / (m["rollout_gpus"] + m["trainer_gpus"]) for n, m in rows.items()
            if m["placement"] == "disaggregated"}  # fmt: skip


def fixed_split(cfg_path: pathlib.Path, name: str, fractions: dict[str, float], overrides: list[str]) -> list[str]:
    """Pin a disaggregated mode's split to its table fraction (rounded to whole workers)."""
    if name not in fractions:
        return []
    cfg = load(SimConfig, path=str(cfg_path), overrides=overrides)
    g, total = cfg.cluster.gpus_per_worker, cfg.cluster.total_gpus
    workers = min(max(1, round(fractions[name] * total / g)), total // g - 1)
    return [f"cluster.rollout_gpus={workers * g}"]


def sweeps(out: pathlib.Path, steps: int, fractions: dict[str, float]) -> dict[str, Any]:
    cfg = CONFIGS[64]
    base = [f"run.steps={steps}", f"run.warmup_steps={min(2, steps - 2)}"]
    res: dict[str, Any] = {}

    def point(name: str, mode: Mode, extra: list[str]) -> dict[str, Any]:
        ov = base + extra
        m = run(cfg, mode, ov + fixed_split(cfg, name, fractions, ov)).metrics
        keep = ("step_time_s", "throughput_tokens_per_s", "rollout_only_fraction", "mean_staleness",
                "max_staleness_consumed", "fraction_of_ideal", "rollout_gpus", "trainer_gpus", "c1_violations",
                "dropped_groups", "reprefill_tokens", "migrations")  # fmt: skip
        return {k: m[k] for k in keep}

    colo = ["cluster.placement.dora=colocated"]
    modes = [("sync", Mode.SYNC, []), ("partial", Mode.PARTIAL, []), ("dora", Mode.DORA, []),
             ("dora colocated", Mode.DORA, colo)]  # fmt: skip

    def each(extra: list[str]) -> dict[str, dict[str, Any]]:
        return {n: point(n, m, [*extra, *ov]) for n, m, ov in modes}

    res["staleness_k"] = {k: {"dora": point("dora", Mode.DORA, [f"core.max_staleness={k}"]),
                              "dora colocated": point("dora colocated", Mode.DORA, [f"core.max_staleness={k}", *colo])}
                          for k in range(5)}  # fmt: skip
    _report_modes("K (max staleness)", res["staleness_k"])
    res["length_sigma"] = {s: each([f"workload.sigma={s}"]) for s in (0.6, 1.2, 1.8)}
    _report_modes("length sigma", res["length_sigma"])
    res["workers"] = {}
    for workers in (16, 32, 64, 128, 256, 512, 1024):
        res["workers"][workers] = each([f"cluster.total_gpus={workers * 4}"])
    _report_modes("rollout workers x 4 GPUs (TBS fixed at 8,192)", res["workers"])
    res["prefill_cost"] = {}
    for f in (1, 4, 16):  # re-prefill is what partial pays at every version (MoE / long context make it dear)
        cost = [f"engine.prefill_s_per_token={3.29e-5 * f}"]
        res["prefill_cost"][f] = {
            "partial": point("partial", Mode.PARTIAL, cost),
            "dora": point("dora", Mode.DORA, cost),
            "dora colocated": point("dora colocated", Mode.DORA, [*cost, "cluster.placement.dora=colocated"]),
        }
    _report_modes("prefill (and re-prefill) cost x", res["prefill_cost"])
    res["kv_budget"] = {f: each([f"engine.kv_budget_tokens={833_000 * f}"]) for f in (1, 2, 4)}
    _report_modes("KV budget x (host-memory offload)", res["kv_budget"])
    for key, xlabel in (
        ("length_sigma", "output-length sigma"),
        ("workers", "rollout workers (4 GPUs each)"),
        ("prefill_cost", "prefill cost multiplier"),
        ("kv_budget", "KV budget multiplier"),
    ):
        xy_plot(res[key], out / f"sweep_{key}.png", xlabel=xlabel, ylabel="tokens / s",
                value="throughput_tokens_per_s", logx=key == "workers")  # fmt: skip
    xy_plot(res["staleness_k"], out / "sweep_staleness_k.png", xlabel="K (max staleness)", ylabel="tokens / s",
            value="throughput_tokens_per_s")  # fmt: skip
    return res


def _report_modes(title: str, series: dict[Any, dict[str, dict[str, Any]]]) -> None:
    names = list(next(iter(series.values())))
    print(f"\n### sweep: {title} (tokens/s; step minutes)\n")
    others = [n for n in names if not n.startswith("dora")]
    print("| value | " + " | ".join(names) + " | best dora ÷ " + " / ".join(others or ["-"]) + " |")
    print("|---" * (len(names) + 2) + "|")
    for x, row in series.items():
        cells = " | ".join(
            f"{row[n]['throughput_tokens_per_s']:,.0f} ({row[n]['step_time_s'] / 60:.1f})" for n in names
        )
        best = max((n for n in names if n.startswith("dora")), key=lambda n: row[n]["throughput_tokens_per_s"])
        ratios = " / ".join(f"{row[best]['throughput_tokens_per_s'] / row[n]['throughput_tokens_per_s']:.2f}"
                            for n in names if not n.startswith("dora"))  # fmt: skip
        print(f"| {x} | {cells} | {ratios} |")


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--only",
        choices=["table", "pareto", "sweeps"],
        help="pareto: only the frontier, on the elastic placements of an earlier table (--table)",
    )
    p.add_argument("--table", help="with --only pareto: that table's paper_table.json (default: OUT's), updated")
    p.add_argument("--seeds", type=int, default=FRONTIER_SEEDS, help="workload seeds per frontier point")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1), help="table and frontier runs at once")
    p.add_argument("--steps", type=int, help="steps per table run (default: the configs' 20)")
    p.add_argument("--sweep-steps", type=int, default=8)
    p.add_argument("--sizes", default="64,128", help="with --only table: the paper configs to run (GPUs)")
    p.add_argument("--variants", help="with --only table: these rows only, comma-separated (e.g. sync,dora); the "
                   "frontier runs only with the dora elastic row")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", dest="overrides",
                   help="a config override for every table and frontier run (repeatable)")  # fmt: skip
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {}
    t0 = time.perf_counter()
    fractions: dict[str, float] = {"dora": 0.5625, "one_step": 0.5625, "drop_stale": 0.5}
    if args.seeds < 1 or args.jobs < 1:
        p.error("--seeds and --jobs must be at least 1")
    extra = ([f"run.steps={args.steps}"] if args.steps else []) + args.overrides
    variants = args.variants.split(",") if args.variants else None
    sizes = sorted({int(g) for g in args.sizes.split(",")})
    if set(sizes) - set(CONFIGS):
        p.error(f"--sizes: the paper configs are {sorted(CONFIGS)}")
    if variants and set(variants) - {name for name, _, _ in VARIANTS}:
        p.error(f"--variants: unknown {sorted(set(variants) - {name for name, _, _ in VARIANTS})}")
    if args.only == "pareto":
        path = pathlib.Path(args.table) if args.table else out / "paper_table.json"
        try:
            report = json.loads(path.read_text())
            placements = {gpus: report[f"paper_{gpus}gpu"]["dora elastic"] for gpus in (64, 128)}
        except (OSError, ValueError, KeyError) as e:
            p.error(f"--only pareto needs a table run's paper_table.json with its dora elastic rows ({path}: {e})")
        for gpus, elastic in placements.items():
            report[f"pareto_{gpus}gpu"] = frontier(gpus, elastic, out, extra, seeds=args.seeds, jobs=args.jobs)
    elif args.only != "sweeps":
        report["overrides"] = args.overrides
        for gpus in sizes:
            report[f"paper_{gpus}gpu"] = rows = table(gpus, out, extra, args.jobs, variants)
            if "dora elastic" in rows:
                report[f"pareto_{gpus}gpu"] = frontier(gpus, rows["dora elastic"], out, extra, seeds=args.seeds,
                                                       jobs=args.jobs)  # fmt: skip
        if sizes == [64, 128]:
            report["scaling"] = scaling(report["paper_64gpu"], report["paper_128gpu"])
        if 64 in sizes:
            fractions = split_fractions(report["paper_64gpu"])
    if args.only in (None, "sweeps"):
        report["sweeps"] = sweeps(out, args.sweep_steps, fractions)
    (out / "paper_table.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}/paper_table.json and PNGs in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
