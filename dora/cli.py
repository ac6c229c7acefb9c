"""`dora` command line: parses the subcommand, then imports only that subcommand's package.

Nothing heavy is imported here, so `dora --help` and `dora broker --help` start fast and never
pull torch or vllm.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "broker": ("the asyncio + ZeroMQ broker: ledger, scheduler, transfer queue, orchestrator", "dora.broker.main"),
    "rollout": ("a rollout worker (engine: sim, torch or vllm)", "dora.rollout.main"),
    "learner": ("the learner: --trainer sim (stand-in) or torch (GRPO; FSDP2 over ranks)", "dora.learner.main"),
    "run": ("broker, rollout workers and learner on one machine (the embedded default)", "dora.launch.run"),
    "sft": ("supervised warm start: fine-tune a model folder on the task dataset before RL", "dora.learner.sft_main"),
    "reward": ("a run's reward model and LLM judge, served as a batching reward service", "dora.reward.main"),
    "sim": ("discrete-event simulation of all paradigms on the production core", "dora.sim.main"),
    "status": ("live versions, workers, queues and staleness of a running broker", "dora.ops.status"),
    "plot": ("`dora plot RUN_DIR`: reward, staleness and worker-timeline PNGs of a run", "dora.ops.plot"),
    "chaos": ("a proxy in front of a broker that drops, copies and delays messages (fault testing)", "dora.ops.chaos"),
    "keys": ("`dora keys generate DIR`: CURVE keypairs for the broker and each role", "dora.ops.keys"),
    "slurm": (
        "`dora slurm config`: a Slurm job's shared run config (see examples/slurm/dora.sbatch)",
        "dora.launch.slurm",
    ),
    "audit": (
        "the invariant report of a run directory (steps, C1, C2, C3) from its journal and learner audit",
        "dora.ops.audit",
    ),
    "eval": (
        "`dora eval --model DIR`: held-out accuracy and pass@k of a model folder or store version",
        "dora.ops.evaluate",
    ),
    "config": (
        "`dora config reference|show`: the configuration reference, or a resolved config",
        "dora.config.reference",
    ),
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dora",
        description="Asynchronous RL post-training with multi-version streaming rollout.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run `dora COMMAND --help` for the options of one command.",
    )
    from dora import __version__

    p.add_argument("--version", action="version", version=f"dora {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", title="commands")
    for name, (summary, _) in COMMANDS.items():
        sub.add_parser(name, help=summary, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        p = parser()
        if not argv:
            p.print_help()
            return 2
        p.parse_args(argv[:1])  # prints --help / --version, or a usage error naming the bad command
        return 2
    name, rest = argv[0], argv[1:]
    _, module = COMMANDS[name]
    if name in ("broker", "rollout", "learner"):  # a SIGTERM is orderly from here on, not only once serving
        from dora.actor.signals import stop_before_serving

        stop_before_serving()
    try:
        return int(importlib.import_module(module).main(rest) or 0)
    except BrokenPipeError:  # the reader went away (`dora audit ... | head`): stop quietly, as cat does
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the exit-time flush has nowhere to fail
        return 141


if __name__ == "__main__":
    sys.exit(main())
