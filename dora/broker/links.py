"""The broker's links to its peers: one ROUTER socket, a session per peer, and nothing sent blindly.

Sending: the ROUTER has ROUTER_MANDATORY on and every send is non-blocking. A message that meets a
full pipe (EAGAIN) waits in that peer's outbox and is retried; nothing is dropped silently. A peer
that cannot be routed to (EHOSTUNREACH) is gone, and the actor is told so (its leases are re-queued
by the core). Application credits (the worker's slots) keep those outboxes small.

Commands to a worker are numbered (``seq``, per session): a worker applies them in order or not at
all, and each ``Peer`` remembers what lease reconciliation may have to send again.

Under CURVE a refused handshake is silent to both sides; the socket monitor is how it is counted.
"""

from __future__ import annotations

import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from dora.ids import WorkerId
from dora.wire import codec
from dora.wire import messages as m

log = structlog.get_logger()

HANDSHAKE_FAILED_NAMES: dict[int, str] = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
}
HANDSHAKE_FAILED = sum(HANDSHAKE_FAILED_NAMES)

_send, _recv = zmq.backend.Socket.send, zmq.backend.Socket.recv
"""The socket's own send and receive: pyzmq's Python wrappers around them (``send_multipart``, flag enums,
``recv_multipart`` reading RCVMORE per frame) cost several times as much per frame, and the broker moves
several frames per message, tens of thousands of messages a second."""
_NOBLOCK = int(zmq.NOBLOCK)
_MORE, _LAST = int(zmq.SNDMORE | zmq.NOBLOCK), _NOBLOCK
COPY_BELOW_BYTES = 1 << 12
"""Smaller frames are copied (cheaper than tracking a buffer); larger ones (sample payloads) are not: a train
batch of 512 samples of 1,024 tokens (134 frames of 32 KiB) went out in 0.81 ms instead of 1.17 ms at
pyzmq's default of 64 KiB."""


def send_frames(sock: zmq.Socket, frames: list[Any]) -> None:
    """``sock.send_multipart(frames, NOBLOCK, copy=False)`` (raises what it raises) at a quarter of the cost."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        size = f.nbytes if isinstance(f, memoryview) else len(f)
        _send(sock, f, _MORE if i < last else _LAST, size < COPY_BELOW_BYTES, False)


def recv_frames(sock: zmq.Socket) -> list[zmq.Frame]:
    """``sock.recv_multipart(NOBLOCK, copy=False)`` (raises ``zmq.Again`` when nothing is queued) without pyzmq's
    wrapper: each frame says whether more follow, so no socket option is read per frame. The frames keep their
    buffers: an array decoded from one is forwarded by reference (``codec._source``), never copied."""
    frame = _recv(sock, _NOBLOCK, False, False)
    frames = [frame]
    while frame.more:  # the rest of a message is queued with its first frame
        frame = _recv(sock, _NOBLOCK, False, False)
        frames.append(frame)
    return frames


@dataclass(slots=True)
class Peer:
    identity: bytes
    role: m.Role
    name: str
    process: tuple[str, int] = ("", 0)
    """(host, pid) from its Hello: a later Hello from the same process under the same name is that process
    back, however its socket identity changed."""
    worker: WorkerId = field(init=False)
    """The identity as text: the peer's key in the core and in liveness."""
    outbox: deque[list[Any]] = field(default_factory=deque)
    seq: int = 0
    """The number of the last command sent to it."""
    lease_seq: dict[tuple[int, int], int] = field(default_factory=dict)
    """(group, attempt) -> number of the command that gave it that lease's work (Generate or MigrateIn)."""
    assign: m.Assign | None = None
    """The last Assign sent to it."""
    migrate_out: dict[tuple[int, int], m.MigrateOut] = field(default_factory=dict)
    """MigrateOut sent to it and not yet answered."""
    yield_cmd: m.Yield | None = None
    """The last Yield sent to it (elastic workers)."""
    resume: m.Resume | None = None
    """The last Resume sent to it (elastic workers)."""
    relay: str = ""
    """A rollout worker's chunk server (its Hello's ``weights_endpoint``): what its host relays versions from."""

    def __post_init__(self) -> None:
        self.worker = WorkerId(self.identity.decode())


def user_id(frames: list[Any]) -> str | None:
    """The User-Id ZAP attached to a message (the peer's z85 public key under CURVE)."""
    frame = frames[1] if len(frames) > 1 else None
    try:
        key = frame.get("User-Id") if isinstance(frame, zmq.Frame) else None
    except zmq.ZMQError:
        return None
    return key if isinstance(key, str) else None


class Links:
    """The registered peers (by socket identity), their outboxes, and every send of the broker."""

    def __init__(self, sock: zmq.asyncio.Socket, counters: Counter[str], *, monitor: bool) -> None:
        self.sock = sock
        self.sync: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        """Non-blocking sends and receives go through this synchronous view of the same socket; the
        asyncio socket is only awaited for readiness (its own NOBLOCK calls would hide errors in futures)."""
        self.counters = counters
        self.peers: dict[bytes, Peer] = {}
        self.pending: set[bytes] = set()
        """Peers whose outbox holds something."""
        self._monitor_sock = sock.get_monitor_socket(HANDSHAKE_FAILED) if monitor else None
        self._monitor: zmq.Socket[bytes] | None = (
            zmq.Socket.shadow(self._monitor_sock.underlying) if self._monitor_sock else None
        )

    def command(self, worker: WorkerId, msg: Any) -> None:
        """Number a command to a worker and send it; remember what reconciliation may need again. ``msg``: the
        command, or a function of its number (keyword ``seq``) that makes it: no copy to number it."""
        peer = self.peers.get(worker.encode())
        if peer is None:
            return
        peer.seq += 1
        msg = msg(seq=peer.seq) if callable(msg) else dataclasses.replace(msg, seq=peer.seq)
        match msg:
            case m.Generate() | m.MigrateIn():
                peer.lease_seq[(msg.group_id, msg.attempt)] = msg.seq
            case m.Assign():
                peer.assign = msg
            case m.Yield():
                peer.yield_cmd = msg
            case m.Resume():
                peer.resume = msg
            case m.MigrateOut():
                peer.migrate_out[(msg.group_id, msg.attempt)] = msg
        self.send(peer, msg)

    def send_to(self, worker: WorkerId, msg: Any) -> None:
        """Send an unnumbered message to a registered worker; nothing if it is gone."""
        peer = self.peers.get(worker.encode())
        if peer is not None:
            self.send(peer, msg)

    def send(self, peer: Peer, msg: Any) -> None:
        peer.outbox.append([peer.identity, *codec.encode(msg)])
        self.pending.add(peer.identity)

    def send_encoded(self, peer: Peer, frames: list[Any]) -> None:
        """Send a message already encoded (``codec.encode_plain``)."""
        peer.outbox.append([peer.identity, *frames])
        self.pending.add(peer.identity)

    def broadcast(self, peers: list[Peer], msg: Any) -> None:
        """Send one unnumbered message to each of ``peers``, encoded once (its frames are small, so copied)."""
        frames = codec.encode(msg)
        for peer in peers:
            peer.outbox.append([peer.identity, *frames])
            self.pending.add(peer.identity)

    def send_raw(self, identity: bytes, msg: Any) -> None:
        """Reply to an identity that is not (or no longer) a registered peer; best effort."""
        try:
            send_frames(self.sync, [identity, *codec.encode(msg)])
        except zmq.ZMQError:
            self.counters["unroutable reply"] += 1

    def flush(self, unreachable: Callable[[Peer], None], until: float | None = None) -> int:
        """Send what the outboxes hold, in order, until a pipe is full; ``unreachable`` is told of a peer that
        cannot be routed to. ``until`` (a ``time.perf_counter`` time): stop there, the rest stays pending.
        Returns the messages sent."""
        sent = 0
        for identity in list(self.pending):
            if until is not None and time.perf_counter() >= until:
                break
            peer = self.peers.get(identity)
            if peer is None:
                self.pending.discard(identity)
                continue
            while peer.outbox:
                try:
                    send_frames(self.sync, peer.outbox[0])
                except zmq.Again:
                    break  # full pipe: keep it queued, retry on the next pass
                except zmq.ZMQError as e:
                    if e.errno == zmq.EHOSTUNREACH:
                        unreachable(peer)
                        break
                    raise
                peer.outbox.popleft()
                sent += 1
            if not peer.outbox:
                self.pending.discard(identity)
        return sent

    def count_handshake_failures(self) -> None:
        if self._monitor is None:
            return
        while True:
            try:
                event = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            name = HANDSHAKE_FAILED_NAMES.get(event["event"], "other")
            self.counters[f"handshake failed ({name})"] += 1
            if self.counters[f"handshake failed ({name})"] % 100 == 1:
                log.warning(
                    "handshake_failed", reason=name, endpoint=str(event.get("endpoint", b""), "utf-8", "replace")
                )

    def close(self) -> None:
        if self._monitor_sock is not None:
            self.sock.disable_monitor()
            self._monitor_sock.close(linger=0)
