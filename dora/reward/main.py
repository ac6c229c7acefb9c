"""`dora reward --config run.toml [--set section.key=value ...] [--url-file PATH]`

Serves the run's reward model (task.reward_model) and LLM judge (task.reward_judge) as a reward service on
task.reward_server_bind, batching the samples of every worker's requests; prints a ``ready`` JSON line with its URL
(and writes ``{"url": ...}`` to ``--url-file``), which the workers are given as task.reward_server. `dora run`
starts it when either is set. Torch is imported only once the arguments are read.
"""

from __future__ import annotations

import argparse
import os
import sys

from dora.config import ConfigError, load
from dora.config.run import RunConfig, TaskSection
from dora.hf.folder import resolve
from dora.logging import configure_logging


def check_models(task: TaskSection) -> None:
    """The reward model's and the judge's folders resolve (a folder, or a hub id in the cache or downloaded), before
    torch is imported; a ConfigError naming the key otherwise. Also what `dora run` checks before any process."""
    if task.reward_model is None and task.reward_judge is None:
        raise ConfigError("dora reward serves task.reward_model and task.reward_judge: set one of them")
    for key, name in (("task.reward_model", task.reward_model), ("task.reward_judge", task.reward_judge)):
        if name is not None:
            resolve(name, key=key)


def main(argv: list[str]) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="dora reward", description=__doc__, formatter_class=fmt)
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    p.add_argument("--url-file", metavar="PATH", help="write {'url': ...} here once serving")
    args = p.parse_args(argv)
    try:
        cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=args.set)
        check_models(cfg.task)
        configure_logging(cfg.log, process="reward")
        from dora.reward.server import serve

        return serve(cfg.task, args.url_file)
    except ConfigError as e:  # a model folder that does not resolve or is no reward model, too
        print(f"dora reward: {e}", file=sys.stderr)
        return 2
