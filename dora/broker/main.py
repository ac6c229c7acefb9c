"""`dora broker --config run.toml [--set section.key=value ...]`"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import sys
from collections.abc import Callable

import numpy as np
import uvloop
import zmq
import zmq.asyncio

from dora.broker.actor import BrokerActor
from dora.broker.core import Core
from dora.config import ConfigError, load
from dora.logging import configure_logging
from dora.runconfig import RunConfig
from dora.tasks.prompts import prompt_source


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="dora broker", description="The broker: ledger, scheduler, transfer queue, orchestrator."
    )
    p.add_argument("--config", metavar="FILE.toml")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    args = p.parse_args(argv)
    try:
        cfg = load(RunConfig, path=args.config, env=os.environ, env_prefix="DORA_", overrides=args.set)
    except ConfigError as e:
        print(f"dora broker: {e}", file=sys.stderr)
        return 2
    try:
        prompts = prompt_source(cfg)
    except ValueError as e:
        print(f"dora broker: {e}", file=sys.stderr)
        return 2
    configure_logging(cfg.log, process="broker")
    return uvloop.run(serve(cfg, prompts))


def open_router(ctx: zmq.asyncio.Context, cfg: RunConfig) -> tuple[zmq.asyncio.Socket, str]:
    """The broker's ROUTER: unroutable sends raise (never dropped silently), explicit HWMs, no linger,
    a cap on message size; bound to ``broker.bind``. Returns the socket and the endpoint it got."""
    sock = ctx.socket(zmq.ROUTER)
    for opt, value in (
        (zmq.ROUTER_MANDATORY, 1),
        (zmq.LINGER, 0),
        (zmq.SNDHWM, cfg.broker.hwm),
        (zmq.RCVHWM, cfg.broker.hwm),
        (zmq.MAXMSGSIZE, cfg.broker.max_message_bytes),
    ):
        sock.setsockopt(opt, value)
    sock.bind(cfg.broker.bind)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


async def serve(cfg: RunConfig, prompts: Callable[[int], np.ndarray]) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ctx = zmq.asyncio.Context()
    try:
        sock, endpoint = open_router(ctx, cfg)
        epoch = secrets.randbits(62)
        ready = {"event": "ready", "endpoint": endpoint, "pid": os.getpid(), "broker_epoch": epoch}
        if cfg.broker.discovery_file:
            tmp = f"{cfg.broker.discovery_file}.{os.getpid()}.tmp"
            with open(tmp, "w") as f:
                json.dump(ready, f)
            os.replace(tmp, cfg.broker.discovery_file)
        print(json.dumps(ready), flush=True)
        actor = BrokerActor(cfg, sock, Core(cfg.core, strict=cfg.broker.strict), prompts, epoch=epoch)
        await actor.run(stop)
        actor.flush()
        await asyncio.sleep(0.05)  # let the last replies (goodbyes) leave before the socket closes
        return 0
    finally:
        ctx.destroy(linger=0)
