"""A rollout worker whose engine hangs after a few samples while its event loop (and heartbeat) lives on.

    python tests/live/hung_worker.py --broker broker.json --config run.toml --name hung --after 4

The engine is the custom engine of examples/custom_engine.py; once it has finished ``--after`` samples (it
finishes a group at a time) it stops making progress for good, as a wedged inference engine does. Used by the
stall-watchdog test (T3).
"""

from __future__ import annotations

import argparse
import asyncio
import pathlib
import sys

import uvloop
import zmq.asyncio

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "examples"))

from custom_engine import MyEngine

from dora.actor.discovery import resolve_endpoint, run_finished
from dora.config import load
from dora.config.run import RunConfig
from dora.logging import configure_logging
from dora.rollout.actor import RolloutActor


class HungEngine(MyEngine):
    def __init__(self, after: int) -> None:
        super().__init__()
        self.left = after

    def advance(self, now: float) -> None:
        if self.left > 0:
            before = len(self.finished)
            super().advance(now)
            self.left -= len(self.finished) - before  # then nothing, ever: pending work stays pending


async def serve(cfg: RunConfig, broker: str, name: str, after: int) -> int:
    stop = asyncio.Event()
    ctx = zmq.asyncio.Context()
    try:
        actor = RolloutActor(cfg, ctx, lambda: resolve_endpoint(broker), name, HungEngine(after),
                             clock=asyncio.get_running_loop().time,
                             run_finished=lambda epoch: run_finished(broker, epoch))  # fmt: skip
        return await actor.run(stop)
    finally:
        ctx.destroy(linger=0)


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--broker", required=True)
    p.add_argument("--config", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--after", type=int, default=4)
    args = p.parse_args()
    cfg = load(RunConfig, path=args.config)
    configure_logging(cfg.log, process="rollout", worker_id=args.name)
    raise SystemExit(uvloop.run(serve(cfg, args.broker, args.name, args.after)))
