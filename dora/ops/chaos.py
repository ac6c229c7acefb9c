"""`dora chaos`: a proxy in front of a broker that loses, copies and delays messages on every link.

    dora chaos --upstream RUN/broker.json --discovery-file RUN/chaos.json --drop 0.05 --dup 0.05 --delay 0.1

Workers and learners pointed at the proxy's discovery file (or endpoint) reach the broker through it.
Each message, in either direction, is dropped with probability ``drop``, sent twice with ``dup`` (the
copy up to ``max_delay_ms`` later), held back up to ``max_delay_ms`` with ``delay`` (so later messages
overtake it), and passed on at once otherwise. The proxy keeps one DEALER towards the broker per
peer, under the peer's own socket identity, so the broker sees the same names it would without it.
It prints a ``ready`` JSON line (its endpoint) at start and its counts as a JSON line when stopped.
The seed fixes the fault sequence for a given arrival order.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
from collections import Counter
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from dora.actor.discovery import announce, resolve_endpoint
from dora.config import ConfigError


@dataclass(frozen=True, slots=True)
class Faults:
    drop: float = 0.05
    dup: float = 0.05
    delay: float = 0.10
    max_delay_s: float = 0.2

    def __post_init__(self) -> None:
        for name in ("drop", "dup", "delay"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"--{name} must be a probability in [0, 1], got {getattr(self, name)}")
        if self.drop + self.dup + self.delay > 1.0:
            raise ValueError("--drop, --dup and --delay add up to more than 1")
        if self.max_delay_s < 0:
            raise ValueError(f"--max-delay-ms must be >= 0, got {self.max_delay_s * 1000:g}")


class ChaosProxy:
    def __init__(self, ctx: zmq.asyncio.Context, upstream: str, faults: Faults, seed: int) -> None:
        self.ctx = ctx
        self.upstream = upstream
        """The broker's endpoint or discovery file, read again for every new peer."""
        self.faults = faults
        self.rng = random.Random(seed)
        self.counts = Counter[str]()
        self.front = ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.front.setsockopt(zmq.LINGER, 0)
        self.dealers: dict[bytes, zmq.asyncio.Socket] = {}
        self.tasks: set[asyncio.Task[None]] = set()

    def bind(self, endpoint: str) -> str:
        self.front.bind(endpoint)
        return self.front.getsockopt_string(zmq.LAST_ENDPOINT)

    def pass_on(self, send: Any, frames: list[bytes], direction: str) -> None:
        """Apply the fault draw to one message and send it (now, later, twice or never)."""
        f, r = self.faults, self.rng.random()
        loop = asyncio.get_running_loop()
        if r < f.drop:
            self.counts[f"{direction} dropped"] += 1
            return
        if r < f.drop + f.dup:
            self.counts[f"{direction} duplicated"] += 1
            send(frames)
            loop.call_later(self.rng.uniform(0, f.max_delay_s), send, frames)
            return
        if r < f.drop + f.dup + f.delay:
            self.counts[f"{direction} delayed"] += 1
            loop.call_later(self.rng.uniform(0, f.max_delay_s), send, frames)
            return
        self.counts[f"{direction} passed"] += 1
        send(frames)

    def to_broker(self, identity: bytes) -> Any:
        def send(frames: list[bytes]) -> None:
            try:
                self.dealers[identity].send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # not connected (yet): what a real network would lose too
                self.counts["up unsendable"] += 1

        return send

    def to_peer(self, identity: bytes) -> Any:
        def send(frames: list[bytes]) -> None:
            try:
                self.front.send_multipart([identity, *frames], flags=zmq.NOBLOCK)
            except zmq.ZMQError:  # the peer is gone
                self.counts["down unsendable"] += 1

        return send

    async def serve(self, stop: asyncio.Event) -> None:
        stopping = asyncio.ensure_future(stop.wait())
        try:
            while not stop.is_set():
                recv = asyncio.ensure_future(self.front.recv_multipart())
                await asyncio.wait([recv, stopping], return_when=asyncio.FIRST_COMPLETED)
                if not recv.done():
                    recv.cancel()
                    break
                identity, *frames = recv.result()
                if identity not in self.dealers:
                    try:
                        endpoint = resolve_endpoint(self.upstream)
                    except ConfigError:
                        self.counts["up no broker"] += 1
                        continue
                    dealer = self.ctx.socket(zmq.DEALER)
                    dealer.setsockopt(zmq.IDENTITY, identity)
                    dealer.setsockopt(zmq.LINGER, 0)
                    dealer.connect(endpoint)
                    self.dealers[identity] = dealer
                    task = asyncio.create_task(self.pump(identity, dealer, stop))
                    self.tasks.add(task)
                    task.add_done_callback(self.tasks.discard)
                self.pass_on(self.to_broker(identity), frames, "up")
        finally:
            stopping.cancel()
            for task in list(self.tasks):
                task.cancel()

    async def pump(self, identity: bytes, dealer: zmq.asyncio.Socket, stop: asyncio.Event) -> None:
        """Broker -> peer, for one peer."""
        send = self.to_peer(identity)
        while not stop.is_set():
            frames = await dealer.recv_multipart()
            self.pass_on(send, frames, "down")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dora chaos", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--upstream", required=True, help="the broker: an endpoint or its discovery file")
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="where peers connect (default: %(default)s)")
    p.add_argument("--discovery-file", help="write this discovery file for peers, pointing at the proxy")
    p.add_argument("--drop", type=float, default=0.05)
    p.add_argument("--dup", type=float, default=0.05)
    p.add_argument("--delay", type=float, default=0.10)
    p.add_argument("--max-delay-ms", type=float, default=200.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--config", help=argparse.SUPPRESS)  # dora.launch.local passes the run's config to every child
    return p.parse_args(argv)


async def run(args: argparse.Namespace, faults: Faults) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ctx = zmq.asyncio.Context()
    try:
        proxy = ChaosProxy(ctx, args.upstream, faults, args.seed)
        try:
            endpoint = proxy.bind(args.bind)
        except zmq.ZMQError as e:
            print(f"dora chaos: cannot bind {args.bind}: {e}", file=sys.stderr)
            return 2
        ready = {"event": "ready", "endpoint": endpoint, "pid": os.getpid()}
        announce(ready, args.discovery_file)
        await proxy.serve(stop)
        print(json.dumps({"event": "chaos_counts", **dict(sorted(proxy.counts.items()))}), flush=True)
        return 0
    finally:
        ctx.destroy(linger=0)


def main(argv: list[str]) -> int:
    args = parse(argv)
    try:
        faults = Faults(drop=args.drop, dup=args.dup, delay=args.delay, max_delay_s=args.max_delay_ms / 1000)
    except ValueError as e:
        print(f"dora chaos: {e}", file=sys.stderr)
        return 2
    return asyncio.run(run(args, faults))
