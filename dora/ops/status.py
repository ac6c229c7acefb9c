"""`dora status --broker ADDR|broker.json [--watch [SECONDS]] [--json]`: what a running broker is doing."""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from typing import Any

import zmq
from rich.console import Console
from rich.table import Table

from dora.actor.discovery import resolve_endpoint
from dora.config import ConfigError
from dora.wire import codec
from dora.wire import messages as m


def fetch(endpoint: str, timeout_s: float = 5.0, keys_dir: str | None = None) -> dict[str, Any]:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"client/status/{uuid.uuid4().hex[:8]}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        if keys_dir:
            from dora.actor.security import Keys

            Keys.load(keys_dir).connect_as(sock, "client")
        sock.connect(endpoint)
        sock.send_multipart(codec.encode(m.StatusRequest()))
        if not sock.poll(int(timeout_s * 1000)):
            raise TimeoutError(f"no answer from the broker at {endpoint} within {timeout_s:g} s")
        reply = codec.decode(sock.recv_multipart())
        if not isinstance(reply, m.StatusReply):
            raise TimeoutError(f"unexpected answer {type(reply).__name__}")
        return reply.snapshot
    finally:
        ctx.destroy(linger=0)


def render(s: dict[str, Any], console: Console) -> None:
    console.print(
        f"[bold]dora[/bold] {s['mode']}  step {s['step']}  newest version {s['newest_version']}  "
        f"up {s['uptime_s']:.0f}s  {s['tokens_per_s']:.0f} tok/s trained  "
        f"finished groups waiting {s['finished_waiting']}"
    )
    t = Table(title="versions")
    for col in ("version", "state", "workers", "running groups", "queued groups"):
        t.add_column(col)
    for v, row in s["versions"].items():
        t.add_row(v, row["state"], str(row["workers"]), str(row["running"]), str(row["queued"]))
    console.print(t)
    w = Table(title="workers")
    for col in ("worker", "version", "ready", "leaving", "slots used", "groups"):
        w.add_column(col)
    for name, row in sorted(s["workers"].items()):
        w.add_row(
            name,
            str(row["version"]),
            str(row["ready"]),
            str(row["leaving"]),
            f"{row['used']}/{row['slots']}",
            str(row["groups"]),
        )
    console.print(w)
    if s.get("lost_peers"):
        lost = Table(title="dead, stalled or departed peers (latest last)")
        for col in ("peer", "role", "reason", "at uptime (s)"):
            lost.add_column(col)
        for row in s["lost_peers"][-10:]:
            lost.add_row(row["peer"], row["role"], row["reason"], f"{row['uptime_s']:.1f}")
        console.print(lost)
    console.print(
        f"staleness consumed: {s['staleness']}  migrated groups: {s['migrated_groups']}  "
        f"re-run groups: {s['requeued_groups']}  counters: {s['counters']}  malformed: {s['malformed']}"
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="dora status", description=__doc__)
    p.add_argument("--broker", default="broker.json", help="tcp://host:port, ipc://path, or a discovery file")
    p.add_argument("--watch", nargs="?", type=float, const=2.0, metavar="SECONDS")
    p.add_argument("--json", action="store_true", help="print the raw snapshot as JSON")
    p.add_argument("--keys", metavar="DIR", help="the run's CURVE keys directory (security.keys), if it has one")
    args = p.parse_args(argv)
    console = Console()
    try:
        endpoint = resolve_endpoint(args.broker)
        while True:
            snap = fetch(endpoint, keys_dir=args.keys)
            if args.json:
                print(json.dumps(snap))
            else:
                if args.watch:
                    console.clear()
                render(snap, console)
            if not args.watch:
                return 0
            time.sleep(args.watch)
    except (ConfigError, TimeoutError, ValueError) as e:
        print(f"dora status: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
