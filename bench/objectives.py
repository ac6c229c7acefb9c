"""The learner's options against each other on the same work: held-out accuracy, mean ± SE over seeds, same budget.

    python bench/objectives.py [--seeds 0 1 2] [--rows default mb4 ...] [--out bench/out/objectives]
    python bench/objectives.py --env [--seeds 0 1 2]          # the calculator environment: default against --best
    python bench/objectives.py --report bench/out/objectives/objectives.json   # print again, run nothing

Per seed, one warm start (``dora sft``, as the README's first command makes it), then for each row ``dora run``
from it with the row's settings and everything else as the example config says: the same prompts, the same
number of train steps (``core.total_steps``), the same held-out rows. A row differs from ``default`` only in the
keys it names. The held-out figures are those ``dora run`` records in ``eval.jsonl`` (before: version 0; after:
the last version). Entropy and KL to the start model per step come from the run's ``metrics.jsonl``.

Rows (arithmetic, examples/arithmetic.toml):
- ``default``: today's defaults (GRPO, one optimizer step per batch, K = 1, top_p 1).
- ``mb4``: ``learner.mini_batches = 4``.
- ``gspo``: GSPO's sequence ratio with its paper's clip (3e-4 / 4e-4), four mini-batches.
- ``rloo``: RLOO advantages.
- ``k3``: K = 3 (``core.max_staleness``), no correction; ``k3_is``: K = 3 with the decoupled correction capped at 2
  (``learner.is_cap``) and four mini-batches, so the proximal policy differs from the behaviour one.
- ``top_p09``: ``run.top_p = 0.9`` (the learner scores over the same nucleus).
- ``kl``: a KL term (k3, 0.05) and an entropy bonus (0.001), for the curves.

Written to OUT/objectives.json (every seed's before/after and per-step entropy, KL, reward), OUT/objectives.md
(the table), OUT/curves.png (entropy and KL over steps, mean over seeds, per row).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

from convergence_summary import mean_se  # noqa: E402
from quickstart import held_out, run  # noqa: E402

ROWS: dict[str, list[str]] = {
    "default": [],
    "mb4": ["learner.mini_batches=4"],
    "gspo": ["learner.ratio=sequence", "learner.clip_low=0.0003", "learner.clip_high=0.0004",
             "learner.mini_batches=4"],
    "rloo": ["learner.advantage=rloo"],
    "k3": ["core.max_staleness=3"],
    "k3_is": ["core.max_staleness=3", "learner.is_cap=2.0", "learner.mini_batches=4"],
    "top_p09": ["run.top_p=0.9"],
    "kl": ["learner.kl_coef=0.05", "learner.entropy_coef=0.001"],
}  # fmt: skip
ARITHMETIC, CALCULATOR = "examples/arithmetic.toml", "examples/envs/calculator.toml"


def one(cfg: str, row: str, sets: list[str], model: pathlib.Path, seed: int, out: pathlib.Path) -> dict[str, Any]:
    """One ``dora run`` of a row from the seed's warm start: held-out before and after, per-step health."""
    runs = out / f"{row}-s{seed}"
    every = [f"rollout.model={model}", f"run.seed={seed}", f"task.seed={seed}", f"run.dir={runs}", *sets]
    took = run(["run", "--config", cfg, *(a for s in every for a in ("--set", s))], out / f"{row}-s{seed}.log")
    rundir, before, after = held_out(runs)
    steps = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    curve = {k: [s.get(k) for s in steps] for k in ("entropy", "kl_ref", "reward_mean", "mismatch_abs")}
    return {"row": row, "seed": seed, "before": before["accuracy"], "after": after["accuracy"], "run_s": took,
            "steps": len(steps), **curve}  # fmt: skip


def table(results: list[dict[str, Any]], rows: list[str]) -> str:
    lines = ["| row | settings | seeds | held-out before | held-out after | rise | final entropy | final KL to start | "
             "run s (mean) |", "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip

    def pm(value: float, se: float, n: int, sign: str = "") -> str:
        return f"{value:{sign}.3f} ± {se:.3f}" if n > 1 else f"{value:{sign}.3f}"

    for row in rows:
        mine = [r for r in results if r["row"] == row]
        if not mine:
            continue
        (b, b_se), (a, a_se) = mean_se([r["before"] for r in mine]), mean_se([r["after"] for r in mine])
        rise, rise_se = mean_se([r["after"] - r["before"] for r in mine])
        ent = [r["entropy"][-1] for r in mine if r["entropy"] and r["entropy"][-1] is not None]
        kl = [r["kl_ref"][-1] for r in mine if r["kl_ref"] and r["kl_ref"][-1] is not None]
        ent_s = f"{mean_se(ent)[0]:.3f}" if ent else "–"
        kl_s = f"{mean_se(kl)[0]:.4f}" if kl else "–"
        settings = ", ".join(f"`{s}`" for s in ROWS.get(row, [])) or "defaults"
        n = len(mine)
        lines.append(f"| {row} | {settings} | {n} | {pm(b, b_se, n)} | {pm(a, a_se, n)} | {pm(rise, rise_se, n, '+')} "
                     f"| {ent_s} | {kl_s} | {sum(r['run_s'] for r in mine) / n:.0f} |")  # fmt: skip
    return "\n".join(lines) + "\n\nmean ± SE over the row's seeds (SE = stdev / sqrt(n)); no SE for one seed.\n"


def curves(results: list[dict[str, Any]], rows: list[str], path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    titles = ("entropy (nats)", "KL to the start model (k3)", "train reward")
    for ax, key, title in zip(axes, ("entropy", "kl_ref", "reward_mean"), titles, strict=True):
        for row in rows:
            series = [r[key] for r in results if r["row"] == row and r[key] and all(v is not None for v in r[key])]
            if not series:
                continue
            n = min(map(len, series))
            ax.plot(np.arange(1, n + 1), np.mean([s[:n] for s in series], 0), label=row)
        ax.set_title(title)
        ax.set_xlabel("train step")
        if ax.lines:
            ax.legend(fontsize=7)
        else:
            ax.text(0.5, 0.5, "no row measured it", ha="center", transform=ax.transAxes)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    p.add_argument("--env", action="store_true", help="the calculator environment: default against --best")
    p.add_argument("--best", default="mb4", choices=list(ROWS), help="with --env: the row set against default")
    p.add_argument("--out", default=None)
    p.add_argument("--report", metavar="JSON", help="print the table of an earlier objectives.json and draw its curves "
                   "beside it; run nothing")  # fmt: skip
    args = p.parse_args(argv)
    if args.report:  # the table again, and the curves beside the JSON, from the rows it holds
        record = json.loads(pathlib.Path(args.report).read_text())
        print(table(record["results"], record["rows"]))
        curves(record["results"], record["rows"], pathlib.Path(args.report).with_name("curves.png"))
        return 0
    cfg = CALCULATOR if args.env else ARITHMETIC
    rows = ["default", args.best] if args.env else args.rows
    out = pathlib.Path(args.out or ROOT / "bench" / "out" / ("objectives-env" if args.env else "objectives")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    failed: list[dict[str, Any]] = []
    record_path = out / "objectives.json"
    for seed in args.seeds:
        model = out / f"sft-s{seed}"
        started = time.perf_counter()
        sft = ["sft", "--config", cfg, "--set", f"sft.seed={seed}", "--set", f"sft.out={model}"]
        run(sft, out / f"sft-s{seed}.log")
        print(f"seed {seed}: warm start in {time.perf_counter() - started:.0f} s", flush=True)
        for row in rows:
            try:
                r = one(cfg, row, ROWS[row], model, seed, out)
            except RuntimeError as e:  # one failed run is reported, and the other rows still run
                failed.append({"row": row, "seed": seed, "error": str(e)})
                print(f"seed {seed} {row}: FAILED ({e})", flush=True)
                continue
            results.append(r)
            print(f"seed {seed} {row}: {r['before']:.3f} -> {r['after']:.3f} in {r['run_s']:.0f} s", flush=True)
            record = {"config": cfg, "rows": rows, "results": results, "failed": failed}
            record_path.write_text(json.dumps(record, indent=1))
    text = table(results, rows) + "".join(f"\nfailed: {f['row']} seed {f['seed']}: {f['error']}" for f in failed)
    print(text)
    (out / "objectives.md").write_text(f"`{cfg}`\n\n" + text)
    curves(results, rows, out / "curves.png")
    print(f"wrote {record_path}, {out / 'objectives.md'}, {out / 'curves.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
