"""`dora sim`: run the paradigms side by side on one simulated workload and report the invariants."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from dora.config import ConfigError, CoreConfig
from dora.ids import Mode
from dora.sim.des import Simulation, Timing
from dora.sim.report import as_json, broken_promises, print_table
from dora.sim.world import Lengths


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dora sim", description=__doc__)
    p.add_argument("--mode", choices=[*(m.value for m in Mode), "all"], default="all")
    p.add_argument("--steps", type=int, default=12, help="train steps per run (default 12)")
    p.add_argument("--staleness", type=int, default=2, help="K for partial and dora (default 2)")
    p.add_argument("--workers", type=int, default=8, help="rollout workers (default 8)")
    p.add_argument("--slots", type=int, default=64, help="sequences per worker (default 64)")
    p.add_argument("--train-groups", type=int, default=32, help="groups per batch (default 32)")
    p.add_argument("--group-size", type=int, default=8, help="samples per prompt (default 8)")
    p.add_argument("--median-tokens", type=float, default=400.0, help="median output length (default 400)")
    p.add_argument("--sigma", type=float, default=1.1, help="lognormal sigma of output lengths (default 1.1)")
    p.add_argument("--max-tokens", type=int, default=8192, help="output length cap (default 8192)")
    p.add_argument("--train-fixed-s", type=float, default=5.0, help="learner time per step (default 5)")
    p.add_argument("--train-per-token-s", type=float, default=3e-4, help="learner time per token (default 3e-4)")
    p.add_argument("--faults", type=int, default=0, help="random worker kills during each run (default 0)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", metavar="OUT", help="also write the results as JSON to OUT")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = parse(argv)
    modes = list(Mode) if args.mode == "all" else [Mode(args.mode)]
    try:
        lengths = Lengths(median=args.median_tokens, sigma=args.sigma, cap=args.max_tokens, seed=args.seed)
        configs = [
            CoreConfig(mode=m, max_staleness=args.staleness, train_groups=args.train_groups,
                       group_size=args.group_size, total_steps=args.steps)
            for m in modes
        ]  # fmt: skip
        if args.workers < 1 or args.slots < args.group_size:
            raise ConfigError("need --workers >= 1 and --slots >= --group-size")
    except ConfigError as e:
        print(f"dora sim: {e}", file=sys.stderr)
        return 2
    timing = Timing(train_fixed_s=args.train_fixed_s, train_per_token_s=args.train_per_token_s)
    results = []
    for cfg in configs:
        # The same faults for every mode: times spread over a sync-length run, victims by index.
        rng = random.Random(args.seed)
        horizon = args.steps * 40.0
        deaths = tuple(sorted((rng.uniform(0, horizon), rng.randrange(1 << 30)) for _ in range(args.faults)))
        t0 = time.perf_counter()
        sim = Simulation(cfg, workers=args.workers, slots=args.slots, timing=timing, lengths=lengths,
                         deaths=deaths, strict=True)  # fmt: skip
        results.append(sim.run())
        print(f"{cfg.mode.value:>8}: {args.steps} steps simulated in {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    sys.stderr.flush()
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_json(results), f, indent=1)
    failed = {r.mode.value: broken_promises(r) for r in results if broken_promises(r)}
    if failed:
        print(f"dora sim: invariants broken: {failed}", file=sys.stderr)
        return 1
    return 0
