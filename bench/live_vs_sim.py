"""The same small dora run, live (real processes, sim engine in scaled real time) and in `dora sim`.

    python bench/live_vs_sim.py [--workers 3] [--steps 20] [--time-scale 0.02] [--out DIR]
                                [--elastic N] [--deadlines fixed|adaptive] [--drain-load N]

Both read one run config. The live run is `dora broker` + `dora rollout --engine sim` ×W +
`dora learner --trainer sim`, on loopback; its per-step times are read from the broker's canonical
`train_step` log lines and divided by the time scale. The simulation drives the same core on a
virtual clock with the same engine, trainer and workload models (one accelerator per worker, the
learner's `sim_gpus` for training). With ``--elastic N`` the last N workers are elastic (`dora rollout
--elastic`; in the simulation, the elastic placement) and the learner trains on its `sim_gpus` plus
their N accelerators. Printed side by side: steady-state step time, staleness histogram (share of
trajectories), migrations, role switches; and the orchestration overhead of the live broker:
time in the core's decisions (orchestration and migration planning run inside them) / wall time.
Targets: step times and staleness shares agree within 15%; overhead <= 2%.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import tomllib
from statistics import fmean

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.config import load  # noqa: E402
from dora.config.run import RunConfig  # noqa: E402
from dora.config.sim import ClusterSection, RunSection, SimConfig  # noqa: E402
from dora.ids import Mode  # noqa: E402
from dora.launch.local import LocalRun  # noqa: E402
from dora.sim.des import Simulation  # noqa: E402
from dora.sim.metrics import summarize  # noqa: E402

WARMUP = 2


def config(steps: int, time_scale: float, workers: int, elastic: int, deadlines: str,
           drain_load: int = 0) -> dict[str, dict]:  # fmt: skip
    """examples/live/sim.toml, with this run's size and pace."""
    cfg = tomllib.loads((ROOT / "examples" / "live" / "sim.toml").read_text())
    cfg["run"]["time_scale"] = time_scale
    cfg["core"]["total_steps"] = steps
    cfg["core"]["deadlines"] = deadlines
    cfg["core"]["drain_load"] = drain_load
    cfg["learner"]["sim_gpus"] = cfg["learner"].get("sim_gpus", 1) + elastic  # elastic accelerators train too
    cfg["core"]["min_workers"] = workers  # the simulated fleet is there from t = 0 too
    cfg["log"]["format"] = "json"
    cfg["learner"].pop("audit_file", None)
    return cfg


def sim_config(cfg: RunConfig, workers: int, elastic: int) -> SimConfig:
    """The live run as a simulation: one accelerator per worker, the learner's sim_gpus training (of them,
    ``elastic`` are the elastic workers' own)."""
    return SimConfig(
        run=RunSection(
            steps=cfg.core.total_steps or 1,
            warmup_steps=WARMUP,
            cooldown_steps=0,  # the live run ends in its drain, and is measured to its end: the same here
            seed=cfg.run.seed,
            tick_s=cfg.broker.tick_s / cfg.run.time_scale,
        ),
        core=cfg.core,
        cluster=ClusterSection(
            total_gpus=workers + cfg.learner.sim_gpus - elastic,
            gpus_per_worker=1,
            rollout_gpus=workers,
            elastic_gpus=elastic or None,
            placement={m.value: "elastic" if elastic else "disaggregated" for m in Mode},
        ),
        engine=cfg.engine,
        trainer=cfg.trainer,
        workload=cfg.workload,
    )


def shares(hist: dict) -> dict[int, float]:
    total = sum(hist.values()) or 1
    return {int(k): n / total for k, n in sorted(hist.items(), key=lambda kv: int(kv[0]))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--time-scale", type=float, default=0.02, help="real seconds per simulated second")
    p.add_argument("--out", help="run directory for the live logs (default: a temp dir)")
    p.add_argument("--elastic", type=int, default=0, help="how many of the workers are elastic")
    p.add_argument("--deadlines", choices=["fixed", "adaptive"], default="fixed")
    p.add_argument("--drain-load", type=int, default=0, help="core.drain_load (0: the paper's re-partition)")
    args = p.parse_args()
    if not 0 <= args.elastic <= args.workers:
        p.error("--elastic must be between 0 and --workers")
    rundir = pathlib.Path(args.out or tempfile.mkdtemp(prefix="dora-live-vs-sim-"))
    raw = config(args.steps, args.time_scale, args.workers, args.elastic, args.deadlines, args.drain_load)
    run = LocalRun(rundir, raw)
    cfg = load(RunConfig, path=str(run.config))

    simcfg = sim_config(cfg, args.workers, args.elastic)
    sim = Simulation(simcfg, Mode.DORA).run()
    sm = summarize(sim, simcfg)

    print(f"live run: {args.workers} workers ({args.elastic} elastic), {args.steps} steps, {args.deadlines} deadlines, "
          f"drain_load {args.drain_load}, time scale {args.time_scale:g}; logs in {rundir}")  # fmt: skip
    try:
        run.start_broker()
        for i in range(args.workers):  # standalone first, as the simulation joins them
            run.start_worker(f"w{i}", "sim", *(["--elastic"] if i >= args.workers - args.elastic else []))
        run.start_learner()
        rc = run.wait("learner", timeout_s=60 + 5 * args.steps * 60 * args.time_scale * 10)
        run.wait("broker", timeout_s=30)
    finally:
        codes = run.stop()
    if rc != 0 or codes.get("broker") != 0:
        print(f"live run failed: exit codes {codes}; see {rundir}", file=sys.stderr)
        return 1
    steps = run.events("broker", "train_step")
    finished = run.events("broker", "run_finished")[-1]
    live_step = fmean(r["step_s"] for r in steps[WARMUP:]) / args.time_scale
    live_hist = shares(steps[-1]["staleness"])
    sim_hist = shares(sm["staleness_histogram"])
    overhead = sum(finished["decision_s"].values()) / finished["elapsed_s"]

    step_err = abs(live_step - sm["step_time_s"]) / sm["step_time_s"]
    keys = sorted(set(live_hist) | set(sim_hist))
    hist_err = max(abs(live_hist.get(k, 0.0) - sim_hist.get(k, 0.0)) for k in keys)
    print("\n| | live | sim | difference |\n|---|---|---|---|")
    print(f"| steady-state step (virtual s) | {live_step:.1f} | {sm['step_time_s']:.1f} | {100 * step_err:.1f}% |")
    for k in keys:
        print(f"| staleness {k} (share) | {live_hist.get(k, 0):.3f} | {sim_hist.get(k, 0):.3f} | "
              f"{abs(live_hist.get(k, 0) - sim_hist.get(k, 0)):.3f} |")  # fmt: skip
    print(f"| migrated groups | {finished['migrated_groups']} | {sim.migrated_groups} | |")
    print(f"| role switches (yields) | {len(run.events('broker', 'worker_yielded'))} | {sim.yields} | |")
    print(
        f"\nbroker decision time {sum(finished['decision_s'].values()):.3f} s of {finished['elapsed_s']:.1f} s wall "
        f"= {100 * overhead:.2f}% (target <= 2%); by event: {json.dumps(finished['decision_s'])}"
    )
    ok = step_err <= 0.15 and hist_err <= 0.15 and overhead <= 0.02
    print(
        f"step time within 15%: {step_err <= 0.15}; staleness shares within 0.15: {hist_err <= 0.15}; "
        f"overhead <= 2%: {overhead <= 0.02}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
