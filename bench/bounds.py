"""How fast *any* schedule could run the paper configs: lower bounds on the step time from the work itself.

    python bench/bounds.py [--table bench/out_table/paper_table.json] [--batches 16]
    python bench/bounds.py --config examples/sim/agentic.toml       # any sim config, without targets

For each paper config (64 and 128 GPUs) it samples batches of the workload and prints (``dora.sim.bounds``):
the replica-seconds of decode a step needs at the least (continuous batching at the KV cache's limit, each
sample weighed by its context over its life), the train step per trainer size, and for every split of the
cluster the simulator accepts (disaggregated, elastic, colocated) the bound ``max(train, (D + E x train) / W)``,
best split per placement. The trainer perfectly balanced gives the strict bound (no split of a batch over
replicas trains faster). The trainer as configured waits at each update for its busiest replica, and which
sequences share a replica depends on the order the batch reaches it; so with it the figure is an estimate,
given for the sampled batches in completion order (how one deadline's groups are delivered) and in dispatch
order. A run's own trainer falls between the two.

Beside them, the step times the targets ask for (sync / 1.65 and / 2.12, partial / 1.1). Sync and partial are
simulated in the same run, or read from a paper table's JSON with ``--table``, which also prints each dora row
of that table against the bound for its own batches at its own split (the run's ``ideal_step_time_s``), the
strict bound at that split, and its train step beside the two estimates.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from dataclasses import asdict, replace
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.config import load  # noqa: E402
from dora.config.sim import SimConfig  # noqa: E402
from dora.ids import Mode  # noqa: E402
from dora.sim.bounds import decode_replica_s, fleet_bounds, step_bound, step_work, train_step_s  # noqa: E402
from dora.sim.runner import simulate  # noqa: E402

CONFIGS = {64: ROOT / "examples/sim/paper-64gpu.toml", 128: ROOT / "examples/sim/paper-128gpu.toml"}
TARGET = {64: 1.65, 128: 2.12}  # dora / sync, the paper's; dora / partial >= 1.1 at both


def baselines(label: str, cfg: SimConfig, rows: dict[str, Any] | None) -> dict[str, float]:
    if rows is not None:
        return {name: rows[name]["step_time_s"] for name in ("sync", "partial")}
    out = {}
    for name in ("sync", "partial"):
        t0 = time.perf_counter()
        out[name] = simulate(cfg, Mode(name)).metrics["step_time_s"]
        print(f"  {label} {name}: {out[name] / 60:.2f} min/step ({time.perf_counter() - t0:.0f} s to simulate)",
              file=sys.stderr, flush=True)  # fmt: skip
    return out


def report(label: str, path: pathlib.Path, target: float | None, batches: int, rows: dict[str, Any] | None
           ) -> dict[str, Any]:  # fmt: skip
    try:
        cfg = load(SimConfig, path=str(path))
    except (OSError, ValueError) as e:
        raise SystemExit(f"bounds.py: error: {path}: {e}") from None
    work = step_work(cfg, batches)
    d = decode_replica_s(cfg.engine, work.response_tokens, work.kv_token_steps)
    e, g = cfg.engine, cfg.cluster.gpus_per_worker
    kv_slots = e.kv_budget_tokens * work.response_tokens / work.kv_token_steps
    print(f"\n{label}: a step trains {work.samples:,} samples, {work.response_tokens / 1e6:.2f}M response "
          f"tokens (mean of {batches} sampled batches)")  # fmt: skip
    tpot_ms = e.tpot_scale * (e.tpot_base_s + e.tpot_per_seq_s * min(kv_slots, e.max_slots)) * 1e3
    print(
        f"  decode needs >= {d:,.0f} replica-s a step ({d * g:,.0f} GPU-s): the KV cache holds {kv_slots:.0f} "
        f"sequences on average over their lives (max_slots {e.max_slots}): {tpot_ms:.1f} ms a decode step"
    )
    base = baselines(label, cfg, rows)
    need = {f"{target}x sync": base["sync"] / target, "1.1x partial": base["partial"] / 1.1} if target else {}
    print(
        f"  sync {base['sync'] / 60:.2f} min/step, partial {base['partial'] / 60:.2f}"
        + ("; the targets need " + ", ".join(f"{k}: <= {v / 60:.2f}" for k, v in need.items()) if need else "")
    )
    out: dict[str, Any] = {"decode_replica_s": d, "response_tokens": work.response_tokens,
                           "kv_sequences": kv_slots, "baselines": base, "needed_s": need, "bounds": {}}  # fmt: skip
    print(f"  {'trainer':<22} {'placement':<14} {'best split (rollout/elastic/trainer GPUs)':>42} "
          f"{'train s':>8} {'decode s':>9} {'bound min':>10} {'/ sync':>7} {'/ partial':>9}")  # fmt: skip
    trainers = (("configured, completion", False, "completion"), ("configured, dispatch", False, "dispatch"),
                ("perfectly balanced", True, "completion"))  # fmt: skip
    for trainer, balanced, order in trainers:
        found = fleet_bounds(cfg, work, balanced=balanced, order=order)
        out["bounds"][trainer] = {k: asdict(b) for k, b in found.items()}
        for key in ("disaggregated", "elastic", "colocated", "best"):
            b = found[key]
            split = f"{b.rollout_gpus}/{b.elastic_gpus}/{b.trainer_gpus}"
            print(f"  {trainer:<22} {key:<14} {split:>42} {b.train_s:8.0f} {b.decode_s:9.0f} {b.step_s / 60:10.2f} "
                  f"{base['sync'] / b.step_s:6.2f}x {base['partial'] / b.step_s:8.2f}x")  # fmt: skip
    if rows is not None:
        print("  the table's dora rows at their own split: the bound for the run's own batches (its trainer's "
              "steps), the strict bound; the run's train step against the configured trainer's estimates:")  # fmt: skip
        fluid = replace(cfg.trainer, data_parallel="fluid")
        for name, row in rows.items():
            if row["mode"] != "dora":
                continue
            w, el, gpus = row["rollout_gpus"] // g, row["elastic_workers"], row["trainer_gpus"]
            took, own = row["step_time_s"], row["ideal_step_time_s"]
            strict = step_bound(d, w, el, train_step_s(fluid, work, gpus))
            est = {o: train_step_s(cfg.trainer, work, gpus, o) - cfg.trainer.publish_s
                   for o in ("completion", "dispatch")}  # fmt: skip
            trained = f"trains {row['train_step_s']:.0f} s a step" if "train_step_s" in row else "its train step: -"
            print(f"    {name:<24} {row['rollout_gpus']}/{el * g}/{gpus}: {took / 60:6.2f} min/step; bound "
                  f"{own / 60:6.2f} ({own / took:.0%}), strict {strict / 60:6.2f} ({strict / took:.0%}); {trained} "
                  f"(estimates {est['completion']:.0f}-{est['dispatch']:.0f})")  # fmt: skip
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--table", type=pathlib.Path, help="a paper_table.json: its sync and partial, and its dora rows")
    ap.add_argument("--batches", type=int, default=16, help="workload batches sampled for the mean step")
    ap.add_argument("--json", type=pathlib.Path, help="write the figures here")
    ap.add_argument("--config", type=pathlib.Path, help="bound this sim config instead of the paper's two (sync and "
                    "partial simulated on it; no targets)")  # fmt: skip
    args = ap.parse_args(argv)
    if args.batches < 1:
        ap.error("--batches must be >= 1")
    table = None
    if args.table is not None:
        try:
            table = json.loads(args.table.read_text())
        except (OSError, ValueError) as e:
            ap.error(f"cannot read --table {args.table}: {e}")
        rows = {n: table.get(f"paper_{n}gpu") if isinstance(table, dict) else None for n in CONFIGS}
        missing = [f"paper_{n}gpu.{row}" for n in CONFIGS for row in ("sync", "partial")
                   if not isinstance(rows[n], dict) or row not in rows[n]]  # fmt: skip
        if not isinstance(table, dict) or missing:
            ap.error(f"--table {args.table} is not a paper table (python bench/paper_table.py writes one): "
                     f"it lacks {', '.join(missing) or 'its rows'}")  # fmt: skip
    if args.config is not None:
        if table is not None:
            ap.error("--table goes with the paper configs, not --config")
        figures = {str(args.config): report(str(args.config), args.config, None, args.batches, None)}
    else:
        figures = {f"paper-{n}gpu": report(f"paper-{n}gpu", CONFIGS[n], TARGET[n], args.batches,
                                           table[f"paper_{n}gpu"] if table is not None else None)
                   for n in CONFIGS}  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
