"""`dora sft --config FILE.toml [--set SECTION.KEY=VALUE ...]`: a supervised warm start before RL.

Fine-tunes ``sft.model`` (default: rollout.model; a folder, a hub id, or ``"dora:tiny"``, dora's tiny model,
built on first use) on the (prompt, answer) rows of ``task.dataset``, rendered exactly as RL renders them, and
writes the model folder ``sft.out``. Then point ``rollout.model`` at it and run `dora run`. Bad input
(a missing dataset, a bad row, no sft.out, a model folder that does not exist or does not load) is one line and
exit 2.
It trains on sft.device (auto: a GPU if there is one, in bf16); with sft.ranks > 1 it starts itself that many
times under torchrun on this node (or runs as srun's tasks), the model sharded with FSDP2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

from dora.actor.cluster import ClusterInfo
from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.hf.preflight import model_folder, sft_start


def main(argv: list[str]) -> int:
    fmt = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog="dora sft", description=__doc__, formatter_class=fmt)
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=args.set)
        if not cfg.sft.out:
            raise ConfigError("dora sft needs sft.out (the model folder to write)")
        name, key = sft_start(cfg)
        start = model_folder(name, key=key)  # before torch is imported: a name that does not resolve is one line
        cfg = dataclasses.replace(cfg, sft=dataclasses.replace(cfg.sft, model=str(start)))
        cluster = ClusterInfo.from_env(os.environ)
        from dora.learner import sft, sft_ranks  # torch and transformers: only once the config is good

        if sft_ranks.relaunches(cfg.sft, cluster):  # checked here, so that a mistake is one line, not one per rank
            sft.plan(cfg)
            sft_ranks.device_of(cfg.sft, cluster)
            sft_ranks.relaunch(argv, cfg.sft, env=os.environ)
        out = sft.run(cfg, cluster)
    except (ConfigError, ValueError, OSError) as e:
        print(f"dora sft: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dora sft: stopped; nothing written", file=sys.stderr)
        return 130
    if out is not None:  # rank 0
        print(f'dora sft: wrote {out}; start RL from it with rollout.model = "{out}"', file=sys.stderr)
    return 0
