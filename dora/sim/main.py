"""`dora sim`: simulate the training paradigms side by side on one cluster and workload, on the production core."""

from __future__ import annotations

import argparse
import functools
import json
import os
import pathlib
import sys
import time

from dora.config import ConfigError, load
from dora.config.sim import DEMO, SimConfig
from dora.ids import Mode
from dora.sim.report import broken_promises, print_table
from dora.sim.runner import simulate

ALL = [Mode.SYNC, Mode.ONE_STEP, Mode.PARTIAL, Mode.DORA, Mode.DROP_STALE]


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dora sim", description=__doc__)
    p.add_argument(
        "--config", metavar="FILE.toml", help="cluster, engine, trainer and workload (default: a small demo)"
    )
    p.add_argument("--mode", choices=[*(m.value for m in Mode), "all"], default="all")
    p.add_argument("--steps", type=int, help="train steps per run (overrides run.steps)")
    p.add_argument("--faults", type=int, help="random worker kills per run (overrides run.faults)")
    p.add_argument("--seed", type=int, help="workload and fault seed (overrides run.seed)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override any config key, e.g. --set core.max_staleness=2 (repeatable)")  # fmt: skip
    p.add_argument("--json", metavar="OUT", help="write one metrics object per mode to OUT")
    p.add_argument("--plots", metavar="DIR", help="write timeline, staleness and throughput PNGs to DIR")
    return p.parse_args(argv)


def resolve(args: argparse.Namespace) -> SimConfig:
    overrides = list(args.set)
    for flag, key in ((args.steps, "run.steps"), (args.faults, "run.faults"), (args.seed, "run.seed")):
        if flag is not None:
            overrides.append(f"{key}={flag}")
    return load(SimConfig, path=args.config, base=None if args.config else DEMO, env=os.environ,
                env_prefix="DORA_SIM__", overrides=overrides)  # fmt: skip


def _progress(mode: Mode, line: str) -> None:
    print(f"{mode.value:>10}: {line}", file=sys.stderr, flush=True)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        cfg = resolve(args)
    except ConfigError as e:
        print(f"dora sim: {e}", file=sys.stderr)
        return 2
    modes = ALL if args.mode == "all" else [Mode(args.mode)]
    results = []
    for mode in modes:
        t0 = time.perf_counter()
        try:
            results.append(simulate(cfg, mode, timeline=bool(args.plots), progress=functools.partial(_progress, mode)))
        except ConfigError as e:  # a placement the cluster cannot make (e.g. no trainer replica left)
            print(f"dora sim: {mode.value}: {e}", file=sys.stderr)
            return 2
        m = results[-1].metrics
        print(f"{mode.value:>10}: {cfg.run.steps} steps in {time.perf_counter() - t0:.1f}s "
              f"({m['placement']}, {m['rollout_gpus']} rollout / {m['trainer_gpus']} trainer GPUs)",
              file=sys.stderr, flush=True)  # fmt: skip
    print_table([r.metrics for r in results])
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps([r.metrics for r in results], indent=1))
    if args.plots:
        from dora.sim.plots import write_plots

        for path in write_plots(results, pathlib.Path(args.plots), title=args.config or "demo"):
            print(f"wrote {path}", file=sys.stderr)
    failed = {r.mode.value: broken for r in results if (broken := broken_promises(r.metrics))}
    if failed:
        print(f"dora sim: invariants broken: {failed}", file=sys.stderr)
        return 1
    return 0
