"""`dora slurm config`: the run config a Slurm job's processes share, written into the job's run directory.

    dora slurm config --config run.toml --run-dir /shared/runs/job-1234 [--set section.key=value ...]

writes ``<run dir>/run.toml``: the user's config resolved (defaults, TOML, ``DORA_*`` variables, ``--set``),
with everything that must be shared, and survive a requeue, placed in the run directory:

- ``broker.json``: the discovery file (the broker writes it; workers and the learner wait for it);
- ``journal.jsonl``: the broker journal (a requeued job's broker resumes the run from it);
- ``audit.jsonl``: the learner's record of every committed step (``dora audit`` checks it);
- ``metrics.jsonl`` and ``timeline.jsonl``: one line per train step and per worker event (``dora plot``);
- ``weights/`` and ``checkpoints/``: the weight store and the learner's checkpoints, unless the config
  names other places;
- ``metrics.tensorboard_dir`` and ``metrics.wandb_dir``, when relative, are in the run directory (wandb's
  default is the run directory itself, beside ``metrics.jsonl``);
- the broker binds every interface on a free port (``tcp://0.0.0.0:0``) unless the config says where,
  and publishes this node's name in the discovery file; it serves Prometheus metrics on a free port
  (its URL is in the discovery file) unless ``broker.metrics_bind`` says where.

Running it again (a requeued job starts its script from the top) writes the same file. It prints the
path. ``examples/slurm/dora.sbatch`` calls it, then starts each process with ``--config <that file>``.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
from typing import Any

from dora.config import ConfigError, load, to_data
from dora.config.models import LearnerSection
from dora.config.run import BrokerSection, RunConfig
from dora.launch.local import to_toml

DEFAULTS_BROKER, DEFAULTS_LEARNER = BrokerSection(), LearnerSection()


def job_config(cfg: RunConfig, run_dir: pathlib.Path) -> dict[str, dict[str, Any]]:
    """``cfg`` as TOML-able data, with the job's shared files in ``run_dir``."""
    run_dir = run_dir.resolve()
    data = to_data(cfg)
    broker, learner = data["broker"], data["learner"]
    broker.update(
        discovery_file=str(run_dir / "broker.json"),
        journal=str(run_dir / "journal.jsonl"),
        metrics_file=str(run_dir / "metrics.jsonl"),
        timeline_file=str(run_dir / "timeline.jsonl"),
    )
    if cfg.broker.bind == DEFAULTS_BROKER.bind:  # the loopback default serves no other node
        broker["bind"] = "tcp://0.0.0.0:0"
    broker.setdefault("metrics_bind", "0.0.0.0:0")
    learner["audit_file"] = str(run_dir / "audit.jsonl")
    if cfg.learner.store == DEFAULTS_LEARNER.store:
        learner["store"] = str(run_dir / "weights")
    learner.setdefault("checkpoint_dir", str(run_dir / "checkpoints"))
    for key in ("tensorboard_dir", "wandb_dir"):  # relative: in the job's directory, shared by every node
        if key in data["metrics"] and not os.path.isabs(data["metrics"][key]):
            data["metrics"][key] = str(run_dir / data["metrics"][key])
    model = cfg.rollout.model or cfg.learner.model
    if model:  # one version 0 for the workers and the learner, and its tokenizer for the broker's prompts
        data["rollout"].setdefault("model", model)
        learner.setdefault("model", model)
        data["task"].setdefault("tokenizer", model)
    data["log"]["format"] = "json"
    return data


def write_job_config(cfg: RunConfig, run_dir: pathlib.Path) -> pathlib.Path:
    """Write ``run_dir/run.toml`` atomically and check that it reads back as the same run."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "run.toml"
    tmp = run_dir / f".run.toml.{os.getpid()}.tmp"
    tmp.write_text(to_toml(job_config(cfg, run_dir)))
    load(RunConfig, path=str(tmp))  # what every process will read: it must load
    os.replace(tmp, path)
    return path


def main(argv: list[str]) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="dora slurm", description=__doc__, formatter_class=fmt)
    sub = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    c = sub.add_parser("config", help="write RUN_DIR/run.toml for the job's processes and print its path")
    c.add_argument("--config", metavar="FILE.toml", required=True)
    c.add_argument("--run-dir", required=True, help="the job's directory on the shared filesystem")
    c.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=args.set)
        if cfg.core.total_steps is None:
            raise ConfigError("a Slurm job needs core.total_steps (the run's end, and what dora audit checks)")
        path = write_job_config(cfg, pathlib.Path(args.run_dir))
    except (ConfigError, OSError) as e:
        print(f"dora slurm: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0
