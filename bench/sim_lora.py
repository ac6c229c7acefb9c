"""LoRA against full fine-tuning in `dora sim`: sync, partial and dora, each with full weights and with adapters,
side by side on the paper configs and the agentic config, in one run.

    python bench/sim_lora.py                       # every config, the configs' own steps -> bench/out/
    python bench/sim_lora.py --steps 8             # shorter (noisier) runs
    python bench/sim_lora.py --configs paper-64gpu --rank 64

A LoRA run (``lora.rank``; ``dora.sim.lora`` derives its costs from ``[model]``, Qwen2.5-32B) loads and publishes
adapters, trains at ``train_cost_factor`` of the full cost per token, and its dora workers hold K + 1 versions, so
they load a new one while decoding the older ones. sync-LoRA and partial-LoRA are sync and partial with the same
adapter loads and training cost, each worker holding one version (sync never has two; partial swaps weights
under running requests). Nothing in the configs is changed: same workloads, same calibration.

Splits: sync and partial are colocated. dora (disaggregated) runs at the rollout/trainer split the paper table's
search found for full weights (bench/out_table; agentic: docs/benchmarks.md), and dora-LoRA twice: at that split,
and at the split whose trainer pool is scaled by the training cost factor (rounded to whole data-parallel
replicas), because a cheaper trainer needs fewer accelerators. No split is searched here (a search runs dozens of
simulations per row).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from dora.config import load
from dora.config.models import LoraSection
from dora.config.sim import SimConfig
from dora.ids import Mode
from dora.sim import lora
from dora.sim.report import kept
from dora.sim.runner import simulate

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = {name: ROOT / f"examples/sim/{name}.toml" for name in ("paper-64gpu", "paper-128gpu", "agentic")}
DORA_ROLLOUT_GPUS = {"paper-64gpu": 32, "paper-128gpu": 64, "agentic": 32}
"""dora's best full-weight splits, as searched by bench/paper_table.py and bench/sim_agentic.py (docs/benchmarks.md)."""
KEEP = ("throughput_tokens_per_s", "step_time_s", "train_step_s", "publish_s", "trainer_idle_fraction",
        "mean_staleness", "max_staleness_consumed", "max_staleness", "c1_violations", "dropped_groups",
        "groups_dispatched", "groups_trained", "groups_in_flight_at_end", "rollout_gpus", "trainer_gpus",
        "placement", "mode", "lora_rank", "train_cost_factor", "versions_per_worker", "version_bytes",
        "load_s_per_version", "loads", "load_s", "load_bytes", "keeping_assigns", "max_versions_held",
        "tokens_decoded_while_loading", "steps", "warmup_steps")  # fmt: skip


def variants(name: str, cfg: SimConfig) -> list[tuple[str, Mode, list[str]]]:
    """(label, mode, overrides) of one config's rows; ``cfg`` is the config with adapters."""
    g = max(cfg.cluster.gpus_per_worker, cfg.trainer.model_parallel_gpus)
    full = DORA_ROLLOUT_GPUS[name]
    trainer = cfg.cluster.total_gpus - full
    scaled = max(g, round(trainer * lora.costs(cfg).train_cost_factor / g) * g)
    split = cfg.cluster.total_gpus - scaled
    rows = [
        ("sync", Mode.SYNC, []), ("partial", Mode.PARTIAL, []),
        ("dora", Mode.DORA, [f"cluster.rollout_gpus={full}"]),
        ("sync-LoRA", Mode.SYNC, ["+lora"]), ("partial-LoRA", Mode.PARTIAL, ["+lora"]),
        ("dora-LoRA", Mode.DORA, ["+lora", f"cluster.rollout_gpus={full}"]),
    ]  # fmt: skip
    if split != full:
        rows.append((f"dora-LoRA, split {split}+{scaled}", Mode.DORA, ["+lora", f"cluster.rollout_gpus={split}"]))
    return rows


def _run(name: str, label: str, mode: Mode, overrides: list[str]) -> dict[str, Any]:
    """One row (a process pool's task)."""
    t0 = time.perf_counter()
    cfg = load(SimConfig, path=str(CONFIGS[name]), overrides=overrides)
    m = simulate(cfg, mode).metrics
    row = {k: m[k] for k in KEEP}
    row.update(config=name, variant=label, invariants_kept=sorted(kept(m)), sim_seconds=time.perf_counter() - t0)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    p.add_argument("--steps", type=int, help="train steps per run (default: each config's run.steps)")
    p.add_argument("--warmup", type=int, help="warm-up steps left out (default: the config's, at most steps - 2)")
    p.add_argument("--rank", type=int, default=LoraSection().rank, help="adapter rank (default: [learner.lora]'s)")
    p.add_argument("--jobs", type=int, default=1, help="simulations at once")
    p.add_argument("--out", default=str(ROOT / "bench/out"))
    args = p.parse_args(argv)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    tasks = []
    for name in args.configs:
        extra = [f"run.steps={args.steps}"] if args.steps else []
        base = load(SimConfig, path=str(CONFIGS[name]), overrides=extra)
        warm = min(base.run.warmup_steps if args.warmup is None else args.warmup, base.run.steps - 2)
        extra.append(f"run.warmup_steps={max(0, warm)}")
        with_lora = load(SimConfig, path=str(CONFIGS[name]), overrides=[*extra, f"lora.rank={args.rank}"])
        for label, mode, ov in variants(name, with_lora):
            ov = [f"lora.rank={args.rank}" if o == "+lora" else o for o in ov]
            tasks.append((name, label, mode, [*extra, *ov]))
    with ProcessPoolExecutor(max(1, args.jobs)) as pool:
        futures = [pool.submit(_run, *t) for t in tasks]
        rows = []
        for f in futures:
            rows.append(f.result())
            r = rows[-1]
            print(f"  {r['config']:>12} {r['variant']:>26}: {r['step_time_s']:.0f} s/step "
                  f"({r['sim_seconds']:.0f}s to simulate)", file=sys.stderr, flush=True)  # fmt: skip
    text = render(rows, args.rank, time.perf_counter() - t0)
    print(text)
    (out / "sim_lora.json").write_text(json.dumps(rows, indent=1))
    (out / "sim_lora.md").write_text(text)
    return 0 if all(set(r["invariants_kept"]) >= promised(r) for r in rows) else 1


def promised(r: dict[str, Any]) -> set[str]:
    return {"C2", "C3"} if r["mode"] == "partial" else {"C1", "C2", "C3"}


def render(rows: list[dict[str, Any]], rank: int, wall_s: float) -> str:
    head = ("| variant | split | tok/s | step (s) | vs sync of its kind | train (s) | publish (s) | train cost "
            "| staleness mean / max | C1 viol. | versions held | loads | load s (per load) | load bytes "
            "| kept loads | tokens decoded while loading |")  # fmt: skip
    out = []
    for name in dict.fromkeys(r["config"] for r in rows):
        mine = [r for r in rows if r["config"] == name]
        sync = {r["variant"].endswith("LoRA"): r for r in mine if r["mode"] == "sync"}
        measured = mine[0]["steps"] - mine[0]["warmup_steps"]
        out += [
            f"\n#### {name} (LoRA rank {rank}; {measured} measured steps)\n",
            head,
            "|---" * (head.count("|") - 1) + "|",
        ]
        for r in mine:
            base = sync.get("LoRA" in r["variant"])
            vs = r["throughput_tokens_per_s"] / base["throughput_tokens_per_s"] if base else float("nan")
            where = "colocated" if r["placement"] == "colocated" else f"{r['rollout_gpus']}+{r['trainer_gpus']}"
            per = r["load_s"] / r["loads"] if r["loads"] else 0.0
            out.append(
                f"| {r['variant']} | {where} | {r['throughput_tokens_per_s']:,.0f} | {r['step_time_s']:,.0f} | "
                f"{vs:.2f}x | {r['train_step_s']:,.0f} | {r['publish_s']:.3f} | {r['train_cost_factor']:.3f} | "
                f"{r['mean_staleness']:.2f} / {r['max_staleness_consumed']} | {r['c1_violations']:,} | "
                f"{r['max_versions_held']} of {r['versions_per_worker']} | {r['loads']} | {r['load_s']:,.1f} "
                f"({per:.2f}) | {r['load_bytes'] / 1e9:,.1f} GB | {r['keeping_assigns']} | "
                f"{r['tokens_decoded_while_loading']:,.0f} |"
            )  # fmt: skip
    out.append(f"\n({len(rows)} simulations, {wall_s / 60:.1f} min of wall clock.)")
    return "\n".join(out).lstrip("\n") + "\n"


if __name__ == "__main__":
    sys.exit(main())
