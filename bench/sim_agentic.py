"""Agentic (multi-turn, tool-using) RL in `dora sim`: the paradigms on examples/sim/agentic.toml, then a sweep of
the mean tool latency, side by side in one run.

    python bench/sim_agentic.py                          # the table (every mode) + the sweep -> bench/out/
    python bench/sim_agentic.py --steps 8 --sweep-steps 8       # shorter (noisier) runs
    python bench/sim_agentic.py --table-json T.json      # reuse `dora sim ... --json T.json` for the table

The cluster, engine and trainer are the calibrated 64-GPU paper config's; the workload is fixed in the TOML
(nothing here is tuned). Disaggregated modes get their best rollout/trainer split in the table (searched, then
printed); the sweep keeps each mode's split from the table so only the tool latency changes. The sweep sets the
*mean* tool latency (the config's ``tool_s`` is a lognormal median: median = mean / exp(sigma^2 / 2)); the turns,
tokens and observations of every episode stay the same across the sweep (common random numbers).
Target of the issue: dora >= 1.6x sync and >= 1.0x partial (throughput) at K = 2.
"""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys
import time
from typing import Any

from dora.config import load
from dora.config.sim import SimConfig
from dora.ids import Mode
from dora.sim.report import broken_promises, print_table
from dora.sim.runner import simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG = ROOT / "examples/sim/agentic.toml"
TABLE_MODES = [Mode.SYNC, Mode.ONE_STEP, Mode.PARTIAL, Mode.DORA, Mode.DROP_STALE]
SWEEP_MODES = [Mode.SYNC, Mode.PARTIAL, Mode.DORA]
COLOCATED = ["cluster.placement.dora=colocated"]
"""The "dora colocated" variant (not the config's placement): a diagnostic of what the disaggregated split costs."""
MEAN_TOOL_S = (0.0, 0.1, 1.0, 5.0)
KEEP = ("step_time_s", "throughput_tokens_per_s", "rollout_only_fraction", "trainer_idle_fraction",
        "slot_utilization", "fraction_of_ideal", "mean_running", "mean_waiting_on_tools", "turns_per_episode",
        "resume_prefill_tokens", "kv_evictions", "c1_violations", "mixed_version_trajectories", "dropped_groups",
        "max_staleness_consumed", "mean_staleness", "rollout_gpus", "trainer_gpus", "migrated_requests")  # fmt: skip


def config(overrides: list[str]) -> SimConfig:
    return load(SimConfig, path=str(CONFIG), overrides=overrides)


def table(steps: int | None) -> list[dict[str, Any]]:
    extra = [f"run.steps={steps}"] if steps else []
    rows = []
    for mode in TABLE_MODES:
        t0 = time.perf_counter()
        m = simulate(config(extra), mode).metrics
        rows.append(m)
        print(f"  table {mode.value:>10}: {m['step_time_s']:.0f} s/step, {m['rollout_gpus']}+{m['trainer_gpus']} GPUs "
              f"({time.perf_counter() - t0:.0f}s to simulate)", file=sys.stderr, flush=True)  # fmt: skip
    return rows


def colocated(steps: int | None) -> dict[str, Any]:
    t0 = time.perf_counter()
    m = simulate(config(([f"run.steps={steps}"] if steps else []) + COLOCATED), Mode.DORA).metrics
    print(f"  variant dora colocated: {m['step_time_s']:.0f} s/step ({time.perf_counter() - t0:.0f}s to simulate)",
          file=sys.stderr, flush=True)  # fmt: skip
    return m


def sweep(rows: list[dict[str, Any]], steps: int | None) -> dict[float, dict[str, dict[str, Any]]]:
    base = [f"run.steps={steps}", f"run.warmup_steps={min(3, steps - 2)}"] if steps else []
    sigma = config([]).workload.tool_sigma
    splits = {m["mode"]: m["rollout_gpus"] for m in rows if m["placement"] == "disaggregated"}
    out: dict[float, dict[str, dict[str, Any]]] = {}
    for mean in MEAN_TOOL_S:
        tool = [f"workload.tool_s={mean / math.exp(sigma**2 / 2)}"]
        out[mean] = {}
        for name, mode, extra in [*((m.value, m, []) for m in SWEEP_MODES), ("dora colocated", Mode.DORA, COLOCATED)]:
            split = [f"cluster.rollout_gpus={splits[name]}"] if name in splits else []
            t0 = time.perf_counter()
            m = simulate(config(base + tool + split + extra), mode).metrics
            out[mean][name] = {k: m[k] for k in KEEP} | {"broken": broken_promises(m)}
            print(f"  sweep mean tool {mean:>4} s {name:>14}: {m['step_time_s']:.0f} s/step "
                  f"({time.perf_counter() - t0:.0f}s to simulate)", file=sys.stderr, flush=True)  # fmt: skip
    return out


def print_summary(rows: list[dict[str, Any]], colo: dict[str, Any]) -> None:
    by = {m["mode"]: m for m in rows}
    d = by["dora"]["throughput_tokens_per_s"]
    vs_sync, vs_partial = d / by["sync"]["throughput_tokens_per_s"], d / by["partial"]["throughput_tokens_per_s"]
    print(f"\nagentic.toml (K = {by['dora']['max_staleness']}): dora / sync = {vs_sync:.2f}x (target >= 1.6x: "
          f"{'met' if vs_sync >= 1.6 else 'missed'}), dora / partial = {vs_partial:.2f}x (target >= 1.0x: "
          f"{'met' if vs_partial >= 1.0 else 'missed'})")  # fmt: skip
    print(
        "\n| mode | GPUs | step s | tokens/s | vs sync | rollout-only | trainer idle | of ideal | C1 viol. | broken |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in rows:
        where = "colocated" if m["placement"] == "colocated" else f"{m['rollout_gpus']}+{m['trainer_gpus']}"
        print(f"| {m['mode']} | {where} | {m['step_time_s']:.0f} | {m['throughput_tokens_per_s']:,.0f} | "
              f"{m['throughput_tokens_per_s'] / by['sync']['throughput_tokens_per_s']:.2f}x | "
              f"{m['rollout_only_fraction']:.0%} | {m['trainer_idle_fraction']:.0%} | {m['fraction_of_ideal']:.0%} | "
              f"{m['c1_violations']} | {', '.join(broken_promises(m)) or '-'} |")  # fmt: skip
    c = colo["throughput_tokens_per_s"]
    print(f"\nvariant dora colocated (placement overridden; not the config's): {colo['step_time_s']:.0f} s/step, "
          f"{c / by['sync']['throughput_tokens_per_s']:.2f}x sync, {c / by['partial']['throughput_tokens_per_s']:.2f}x "
          f"partial, trainer waits {colo['rollout_only_fraction']:.0%}, of ideal {colo['fraction_of_ideal']:.0%}, "
          f"C1 violations {colo['c1_violations']}")  # fmt: skip


def print_sweep(res: dict[float, dict[str, dict[str, Any]]]) -> None:
    print("\n### sweep: mean tool latency (same episodes; disaggregated splits fixed from the table)\n")
    print("| mean tool s | sync step s | partial step s | dora step s | dora/sync | dora/partial | "
          "C1 viol. sync / partial / dora | dora trainer waits | dora of ideal | dora waiting on tools | "
          "dora colocated step s | dora colocated / sync | dora colocated / partial |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for mean, row in res.items():
        s, p, d, c = row["sync"], row["partial"], row["dora"], row["dora colocated"]
        ratio = d["throughput_tokens_per_s"] / s["throughput_tokens_per_s"]
        vs_p = d["throughput_tokens_per_s"] / p["throughput_tokens_per_s"]
        print(f"| {mean:g} | {s['step_time_s']:.0f} | {p['step_time_s']:.0f} | {d['step_time_s']:.0f} | "
              f"{ratio:.2f}x | {vs_p:.2f}x | {s['c1_violations']} / {p['c1_violations']} / {d['c1_violations']} | "
              f"{d['rollout_only_fraction']:.0%} | {d['fraction_of_ideal']:.0%} | "
              f"{d['mean_waiting_on_tools']:.0f} | {c['step_time_s']:.0f} | "
              f"{c['throughput_tokens_per_s'] / s['throughput_tokens_per_s']:.2f}x | "
              f"{c['throughput_tokens_per_s'] / p['throughput_tokens_per_s']:.2f}x |")  # fmt: skip
    print(
        "\ndora/sync, dora/partial: ratios of steady-state tokens/s (= inverse ratios of time per trained token). "
        "trainer waits: share of time the trainer waits for a batch; of ideal: perfect-packing bound / step; "
        "waiting on tools: mean episodes waiting on a tool call, whole fleet. dora colocated: the variant with "
        "placement overridden (a diagnostic, not the config)."
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="steps per table run (default: the config's)")
    p.add_argument("--sweep-steps", type=int, help="steps per sweep run (default: the config's)")
    p.add_argument("--table-json", help="take the table from `dora sim --config ... --mode all --json FILE`")
    p.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    rows = json.loads(pathlib.Path(args.table_json).read_text()) if args.table_json else table(args.steps)
    colo = colocated(args.steps)
    print_table(rows)
    print_summary(rows, colo)
    res = sweep(rows, args.sweep_steps)
    print_sweep(res)
    report = {"table": rows, "dora_colocated": colo, "sweep": res}
    (out / "sim_agentic.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"\nwrote {out}/sim_agentic.json in {time.perf_counter() - t0:.0f}s", file=sys.stderr)
    broken = {m["mode"]: b for m in rows if (b := broken_promises(m))}
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
