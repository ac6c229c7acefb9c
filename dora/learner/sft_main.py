"""`dora sft --config FILE.toml [--set SECTION.KEY=VALUE ...]`: a supervised warm start before RL.

Fine-tunes ``sft.model`` (default: rollout.model; the tiny model is built there when the folder has no
config.json) on the (prompt, answer) rows of ``task.dataset``, rendered exactly as RL renders them, and
writes the model folder ``sft.out``. Then point ``rollout.model`` at it and run `dora run`. Bad input
(a missing dataset, a bad row, no sft.out, a model folder that does not load) is one line and exit 2.
"""

from __future__ import annotations

import argparse
import os
import sys

from dora.config import ConfigError, load
from dora.config.run import RunConfig


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
        from dora.learner import sft  # torch and transformers: only once the config is good

        out = sft.run(cfg)
    except (ConfigError, ValueError, OSError) as e:
        print(f"dora sft: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dora sft: stopped; nothing written", file=sys.stderr)
        return 130
    print(f'dora sft: wrote {out}; start RL from it with rollout.model = "{out}"', file=sys.stderr)
    return 0
