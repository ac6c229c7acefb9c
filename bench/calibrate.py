"""Fit the two free numbers of a paper config to the paper's synchronous run, and nothing else.

    python bench/calibrate.py examples/sim/paper-64gpu.toml [--steps 8]

Targets (DORA paper, Table A, 64 GPUs, sync): step 22.91 min and rollout-only 65%, i.e. 893.5 s of
rollout and the rest of the step (training, publishing, loading) 481.1 s. `engine.tpot_scale` sets
the rollout time, `trainer.gpu_s_per_token` the training time; the two are fitted alternately by
bisection until both are within 0.5%. The values printed go into the config file by hand, so the
fit is visible in review. Every other mode, and the 128-GPU config, is then a prediction.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace

from dora.config import load
from dora.config.sim import SimConfig
from dora.ids import Mode
from dora.sim.runner import simulate

STEP_S = 22.91 * 60
ROLLOUT_ONLY = 0.65


def measure(cfg: SimConfig) -> tuple[float, float]:
    m = simulate(cfg, Mode.SYNC).metrics
    return m["step_time_s"], m["rollout_only_fraction"] * m["step_time_s"]


def bisect(lo: float, hi: float, f, target: float, tol: float) -> float:
    """x in [lo, hi] with f(x) ~= target, f increasing."""
    for _ in range(40):
        mid = (lo + hi) / 2
        value = f(mid)
        if abs(value - target) <= tol * target:
            return mid
        lo, hi = (mid, hi) if value < target else (lo, mid)
    return (lo + hi) / 2


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config")
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args(argv)
    cfg = load(SimConfig, path=args.config)
    cfg = replace(cfg, run=replace(cfg.run, steps=args.steps, warmup_steps=min(2, args.steps - 1)))
    for round_ in range(4):
        base = cfg
        scale = bisect(0.1, 10.0, lambda s, c=base: measure(replace(c, engine=replace(c.engine, tpot_scale=s)))[1],
                       STEP_S * ROLLOUT_ONLY, 0.002)  # fmt: skip
        base = replace(base, engine=replace(base.engine, tpot_scale=scale))
        g = bisect(1e-5, 1e-1, lambda x, c=base: measure(replace(c, trainer=replace(c.trainer, gpu_s_per_token=x)))[0],
                   STEP_S, 0.002)  # fmt: skip
        cfg = replace(base, trainer=replace(base.trainer, gpu_s_per_token=g))
        step, rollout = measure(cfg)
        print(f"round {round_}: tpot_scale={scale:.4f} gpu_s_per_token={g:.6g} -> step {step / 60:.2f} min, "
              f"rollout-only {rollout / step:.1%}", flush=True)  # fmt: skip
        if abs(step - STEP_S) < 0.005 * STEP_S and abs(rollout / step - ROLLOUT_ONLY) < 0.005:
            break
    print(f"\n[engine] tpot_scale = {scale:.4f}\n[trainer] gpu_s_per_token = {g:.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
