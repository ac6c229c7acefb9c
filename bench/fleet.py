"""Many zero-latency rollout peers in one process: DEALER sockets on one zmq.Context and one poller loop.

Each peer speaks the rollout protocol as `dora.rollout.actor` does, with an engine that takes no time:
it says Hello, heartbeats at the broker's interval with the highest command number seen, the leases it
holds (results sent and not yet acknowledged) and its version; loads weights at once (Assign ->
WeightsLoaded); answers a Generate at once with the group's finished samples
(`bench.broker_throughput.finished`, so the wire layout is the one the workers use); hands over nothing
on MigrateOut (its groups are already done); drops a cancelled lease. A Disconnect voids its leases and
it says hello again after 1 s, as a real worker does, and the Disconnect is recorded: the peer was
heartbeating, so the death was false.

What it measures, each with the monotonic time it happened (the system-wide clock, so the parent can
compare with its own): every Generate's arrival and version, each finished group's result round trip
(sent to acknowledged) and each heartbeat's round trip (the broker answers every rollout heartbeat, in
order).
"""

from __future__ import annotations

import heapq
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from bench.broker_throughput import finished
from dora.wire import codec
from dora.wire import messages as m

REJOIN_S = 1.0
"""A disconnected peer says hello again after this long (the rollout actor's first backoff)."""


@dataclass(slots=True)
class Peer:
    """One rollout peer: a DEALER socket and what a real worker keeps to heartbeat honestly."""

    sock: zmq.Socket
    name: str
    slots: int
    epoch: int = 0
    seen: int = 0
    version: int = -1
    tokens: int = 0
    welcomed: bool = False
    leases: dict[tuple[int, int], int] = field(default_factory=dict)
    """(group, attempt) -> samples not yet acknowledged: what the heartbeat says it holds."""
    results_sent: dict[tuple[int, int], float] = field(default_factory=dict)
    beats_sent: list[float] = field(default_factory=list)
    beats_answered: int = 0

    def hello(self) -> None:
        self.send(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id=self.name, pid=os.getpid(),
                          host="bench", slots=self.slots, engine="zero"))  # fmt: skip

    def send(self, msg: Any) -> None:
        self.sock.send_multipart(codec.encode(msg), copy=False)

    def heartbeat(self, now: float) -> None:
        self.beats_sent.append(now)
        holding = np.array(sorted(self.leases), dtype=np.int64).reshape(-1, 2)
        self.send(m.Heartbeat(tokens_generated=self.tokens, running=0, kv_use=0.0, seen=self.seen, holding=holding,
                              version=self.version, loading=-1))  # fmt: skip


class Fleet:
    """The peers of one process and what they saw."""

    def __init__(self, endpoint: str, names: list[str], slots: int, tokens: int, interval_s: float) -> None:
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self.peers: dict[zmq.Socket, Peer] = {}
        for name in names:
            s = self.ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, f"rollout/{name}/0".encode())
            s.setsockopt(zmq.LINGER, 0)
            s.connect(endpoint)
            self.peers[s] = Peer(sock=s, name=name, slots=slots)
            self.poller.register(s, zmq.POLLIN)
        self.tokens, self.interval_s = tokens, interval_s
        self.ids = (np.arange(tokens) % 50_000).astype(np.int32)
        self.lps = np.full(tokens, -0.7, np.float32)
        self.due: list[tuple[float, str, Peer]] = []
        """A heap of (when, name, peer): each peer's next heartbeat (or its hello again after a Disconnect)."""
        self.rng = random.Random(names[0])
        self.welcomed = 0
        self.leases: list[tuple[float, int]] = []
        """(arrival, version) of every Generate."""
        self.result_rtt: list[tuple[float, float]] = []
        self.beat_rtt: list[tuple[float, float]] = []
        self.disconnects: list[tuple[float, str, str]] = []
        self.counts = dict.fromkeys(("generate", "assign", "migrate_out", "cancel", "stale_command", "reject",
                                     "disconnect_while_joining"), 0)  # fmt: skip

    def run(self, stop: Any, out: Any) -> None:
        """Serve until ``stop`` is set; put ("welcomed", time) on ``out`` once every peer is, then ("report", ...)."""
        for p in self.peers.values():
            p.hello()
        told = False
        while not stop.is_set():
            wait_s = min(0.1, self.due[0][0] - time.monotonic()) if self.due else 0.1
            for sock, _ in self.poller.poll(max(0, int(1000 * wait_s)) + 1):
                p = self.peers[sock]
                for _ in range(64):
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.on_message(p, codec.decode(frames), time.monotonic())
            if not told and self.welcomed == len(self.peers):
                told = True
                out.put(("welcomed", time.monotonic()))
            self.beat(time.monotonic())
        out.put(("report", self.report()))
        self.ctx.destroy(linger=0)

    def beat(self, now: float) -> None:
        while self.due and self.due[0][0] <= now:
            _, name, p = heapq.heappop(self.due)
            if p.welcomed:
                p.heartbeat(now)
                heapq.heappush(self.due, (now + self.interval_s, name, p))
            else:  # the hello again after a Disconnect; heartbeats start again at its Welcome
                p.hello()

    def on_message(self, p: Peer, msg: Any, now: float) -> None:
        seq = getattr(msg, "seq", 0)
        if seq:
            if seq <= p.seen:  # a copy or overtaken: the rollout actor drops it unapplied
                self.counts["stale_command"] += 1
                return
            p.seen = seq
        match msg:
            case m.Welcome():
                p.epoch = msg.broker_epoch
                if not p.welcomed:
                    p.welcomed = True
                    self.welcomed += 1
                    heapq.heappush(self.due, (now + self.rng.random() * self.interval_s, p.name, p))
            case m.Heartbeat():
                if p.beats_answered < len(p.beats_sent):
                    self.beat_rtt.append((now, now - p.beats_sent[p.beats_answered]))
                    p.beats_answered += 1
            case m.Assign():
                self.counts["assign"] += 1
                p.version = msg.version
                p.send(m.WeightsLoaded(version=msg.version))
            case m.Generate():
                self.counts["generate"] += 1
                self.leases.append((now, msg.version))
                p.epoch = msg.broker_epoch
                key = (msg.group_id, msg.attempt)
                p.leases[key] = msg.n_samples
                p.tokens += msg.n_samples * self.tokens
                p.send(finished(msg, p.epoch, self.ids, self.lps))
                p.results_sent[key] = time.monotonic()
            case m.ResultAcks():
                for ack in msg.acks:
                    key = (ack.group_id, ack.attempt)
                    if key in p.leases:
                        p.leases[key] -= 1
                        if p.leases[key] <= 0:
                            del p.leases[key]
                            self.result_rtt.append((now, now - p.results_sent.pop(key, now)))
            case m.MigrateOut():  # its groups are already done: nothing left to hand over
                self.counts["migrate_out"] += 1
                p.send(m.MigrationExported(group_id=msg.group_id, attempt=msg.attempt, requests=()))
            case m.Cancel():
                self.counts["cancel"] += 1
                p.leases.pop((msg.group_id, msg.attempt), None)
                p.results_sent.pop((msg.group_id, msg.attempt), None)
            case m.Disconnect() if p.welcomed:  # declared dead while heartbeating: a false death
                self.disconnects.append((now, p.name, msg.reason))
                p.leases.clear()  # void, as a real worker's
                p.results_sent.clear()
                p.welcomed, p.seen, p.beats_answered = False, 0, len(p.beats_sent)
                self.welcomed -= 1
                heapq.heappush(self.due, (now + REJOIN_S, p.name, p))
            case m.Disconnect():
                self.counts["disconnect_while_joining"] += 1
            case m.Reject():
                self.counts["reject"] += 1

    def report(self) -> dict[str, Any]:
        peers = self.peers.values()
        return {"leases": self.leases, "result_rtt": self.result_rtt, "beat_rtt": self.beat_rtt,
                "disconnects": self.disconnects, "counts": self.counts,
                "beats_sent": sum(len(p.beats_sent) for p in peers),
                "beats_answered": sum(p.beats_answered for p in peers),
                "served": sum(1 for p in peers if p.tokens)}  # fmt: skip


def serve_peers(endpoint: str, names: list[str], slots: int, tokens: int, interval_s: float, nice: int, stop: Any,
                out: Any) -> None:  # fmt: skip
    """A process's entry point: its peers, at ``nice`` (on a cluster they are other machines' load), until ``stop``."""
    os.nice(nice)
    Fleet(endpoint, names, slots, tokens, interval_s).run(stop, out)
