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


def health(learner: dict[str, float], held_out: dict[str, float]) -> list[str]:
    """The latest step's health, in two lines: the policy (reward, entropy, drift from the start model, the
    engine-learner gap, clipping, learning rate, held-out accuracy) and its samples (lengths, truncation, groups
    whose rewards are all equal). A number the step did not report is left out; a line with none, too."""

    def num(key: str, label: str | None = None) -> str | None:
        v = learner.get(key)
        return None if v is None else f"{label or key} {v:.4g}"

    def share(key: str, label: str) -> str | None:
        v = learner.get(key)
        return None if v is None else f"{label} {100 * v:.1f}%"

    low, high = learner.get("clip_low_fraction"), learner.get("clip_high_fraction")
    clip: str | None
    if low is not None and high is not None:
        clip = f"clipped low/high {100 * low:.1f}%/{100 * high:.1f}%"
    else:
        clip = share("clip_low_fraction", "clipped low") or share("clip_high_fraction", "clipped high")
    length = None
    if "length_mean" in learner:
        p95 = f" p95 {learner['length_p95']:.0f}" if "length_p95" in learner else ""
        length = f"length mean {learner['length_mean']:.1f}{p95}"
    accuracy = f"held-out accuracy {held_out['accuracy']:.3f}" if "accuracy" in held_out else None
    policy = [num("reward_mean", "reward"), num("entropy"), num("kl_ref"), num("mismatch_abs"), clip, num("lr"),
              accuracy]  # fmt: skip
    output = [length, share("truncated_share", "truncated"), share("uniform_share", "uniform groups")]
    lines = ["  ".join(x for x in parts if x) for parts in (policy, output)]
    return [f"{head}: {line}" for head, line in zip(("policy", "samples"), lines, strict=True) if line]


def worker_counters(counters: dict[str, float]) -> str:
    """The workers' own counters summed over the run (reward services, agents, environments), one line."""
    return "workers counted: " + "  ".join(f"{name} {value:.6g}" for name, value in sorted(counters.items()))


def render(s: dict[str, Any], console: Console) -> None:
    console.print(
        f"[bold]dora[/bold] {s['mode']}  step {s['step']}  newest version {s['newest_version']}  "
        f"up {s['uptime_s']:.0f}s  {s['tokens_per_s']:.0f} tok/s trained  "
        f"finished groups waiting {s['finished_waiting']}"
    )
    for line in health(s.get("learner") or {}, s.get("held_out") or {}):
        console.print(line, highlight=False)
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
    if s.get("worker_counters"):
        console.print(worker_counters(s["worker_counters"]), highlight=False)
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
