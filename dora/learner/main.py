"""`dora learner --trainer sim --broker ADDR|broker.json [--config run.toml] [--set k=v ...]`"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

import uvloop
import zmq.asyncio

from dora.config import ConfigError, load
from dora.discovery import resolve_endpoint
from dora.learner.standin import StandInLearner
from dora.logging import configure_logging
from dora.runconfig import RunConfig


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dora learner", description="The learner (the FSDP2 trainer is not built yet).")
    p.add_argument("--broker", required=True, help="tcp://host:port, ipc://path, or a broker.json discovery file")
    p.add_argument("--trainer", choices=["sim"], required=True, help="sim: a stand-in that checks and times batches")
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=args.set)
        endpoint = resolve_endpoint(args.broker)
    except ConfigError as e:
        print(f"dora learner: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log, process="learner", rank=0)
    return uvloop.run(serve(cfg, endpoint))


async def serve(cfg: RunConfig, endpoint: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ctx = zmq.asyncio.Context()
    with contextlib.ExitStack() as stack:
        audit = stack.enter_context(open(cfg.learner.audit_file, "a")) if cfg.learner.audit_file else None
        try:
            return await StandInLearner(cfg, ctx, endpoint, audit=audit, clock=loop.time).run(stop)
        finally:
            ctx.destroy(linger=0)
