"""dora inside a custom stack, on this machine: the stack's inference engine, reward and loss around
dora's broker and torch learner.

    python examples/embed/run.py [--set section.key=value ...]

- ``worker.py``: the rollout workers, this stack's engine (a transformers model sampled token by token),
  each a ``RolloutActor`` in a process of its own;
- ``my_stack.py``: ``reward`` (``task.reward = "my_stack:reward"``), called by the workers, and ``loss``
  (``learner.loss = "my_stack:loss"``), called by dora's torch learner instead of its built-in loss;
- ``run.toml``: the run; dora's ``prepare`` fills in this run's socket, weight store, checkpoints and
  journal, and finds the model (``"dora:tiny"``: dora's tiny model, built on first use), as ``dora run`` does.

Everything lands in ``runs/embed-<time>/`` (``run.dir``): ``metrics.jsonl``, the figures, one log per
process. The exit status is 0 only if every process exited 0.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.launch.local import LocalRun
from dora.launch.run import follow, prepare
from dora.ops.plot import PlotError, render

HERE = pathlib.Path(__file__).resolve().parent


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args()
    try:
        cfg = load(RunConfig, path=str(HERE / "run.toml"), env=os.environ, overrides=args.set)
        rundir = pathlib.Path(cfg.run.dir) / time.strftime("embed-%Y%m%d-%H%M%S")
        rundir.mkdir(parents=True)
        data = prepare(cfg, rundir)
    except (ConfigError, FileExistsError) as e:
        print(f"embed: {e}", file=sys.stderr)
        return 2
    run = LocalRun(rundir, data, threads=cfg.run.threads or max(1, (os.cpu_count() or 1) // (cfg.run.workers + 1)))
    run.env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), run.env.get("PYTHONPATH")) if p)  # my_stack
    print(f"embed: {cfg.run.workers} workers of this stack's engine, dora's torch learner with my_stack:loss, "
          f"{cfg.core.total_steps} steps; run directory {rundir}", file=sys.stderr)  # fmt: skip
    try:
        run.start_broker()
        for i in range(cfg.run.workers):
            run.spawn_command(f"w{i}", [str(HERE / "worker.py"), "--broker", str(run.discovery), "--name", f"w{i}"])
        run.start_learner("torch")
        follow(run, rundir, cfg.core.total_steps, lambda: False)
    finally:
        codes = run.stop()
        try:
            render(rundir)  # reward.png, staleness.png, timeline.png
        except PlotError as e:
            print(f"embed: no figures: {e}", file=sys.stderr)
    steps = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    losses = run.events("learner", "custom_loss")
    scored = [w for w in run.procs if w.startswith("w") and run.events(w, "custom_reward_in_use")]
    if steps and losses:
        quarter = max(1, len(steps) // 4)
        first, last = (sum(r["reward_mean"] for r in rows) / len(rows) for rows in (steps[:quarter], steps[-quarter:]))
        print(f"embed: {len(steps)} steps; mean reward {first:.3f} over the first quarter, {last:.3f} over the last; "
              f"my_stack:loss called {len(losses)} times (KL to the behaviour policy {losses[-1]['kl']:.4f} at the "
              f"last); my_stack:reward scored on {len(scored)} workers", file=sys.stderr)  # fmt: skip
    failed = {k: v for k, v in codes.items() if v != 0}
    if failed:
        print(f"embed: processes failed: {failed}; logs in {rundir}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
