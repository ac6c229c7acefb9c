"""A process's session with the broker: the one connection protocol of the rollout worker and the learner.

A session is a DEALER socket with an identity of its own (``role/name/random``), secured with CURVE when the run
has keys. Its first message is a ``Hello`` (``hello``: the wire version, the role, who and where this process is,
and what the role adds). Then the peer heartbeats every ``heartbeat_interval_s`` (``beat_due``), judges the broker
gone after ``interval × liveness`` without a word (``silent``), sends what awaits an answer again every two
intervals (``resend_s``), and leaves with a ``Goodbye`` that the socket holds long enough to go out (``goodbye``).

What each role says and does with what comes stays in its actor: ``dora.rollout.actor`` ends a lost session
(``SessionLost``) and starts a new one on a new socket, with a new identity; ``dora.learner.actor`` keeps one
session for the life of the process and greets a broker that fell silent anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

import structlog
import zmq
import zmq.asyncio

from dora.actor.cluster import ClusterInfo
from dora.actor.security import Keys
from dora.actor.signals import GOODBYE_LINGER_MS
from dora.wire import codec
from dora.wire import messages as m

log = structlog.get_logger()


class SessionLost(Exception):
    """The session with the broker is over (silent, unreachable, refused); a new one may start."""


class PeerSession:
    """One connection to the broker, its heartbeat clock and its silence window."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        role: m.Role,
        name: str,
        *,
        cluster: ClusterInfo,
        keys: Keys | None,
        interval_s: float,
        liveness: int,
        clock: Callable[[], float],
        immediate: bool = False,
    ) -> None:
        """``immediate``: messages go out only on a live connection (a send with none fails: ``send``), instead of
        waiting for one."""
        self.role = role
        self.cluster = cluster
        self.clock = clock
        self.interval_s = interval_s
        self.silence_s = interval_s * liveness
        """The broker is gone once it said nothing for this long."""
        self.resend_s = 2 * interval_s
        """A message that awaits an answer (or an acknowledgement) goes again after this long without one."""
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, f"{role}/{name}/{uuid.uuid4().hex[:8]}".encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        if immediate:
            self.sock.setsockopt(zmq.IMMEDIATE, 1)
        if keys is not None:
            keys.connect_as(self.sock, role)
        self.now_or_never: zmq.Socket[bytes] = zmq.Socket.shadow(self.sock.underlying)
        """The same socket, for sends that must not wait (``self.sock`` is awaited for readiness)."""
        self.endpoint = ""
        self.heard_at = self.next_beat = clock()

    def connect(self, endpoint: str) -> None:
        """Connect to the broker at ``endpoint``, leaving the one connected before, if another."""
        if endpoint == self.endpoint:
            return
        if self.endpoint:
            self.sock.disconnect(self.endpoint)
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    async def connected(self, stop: asyncio.Event) -> bool:
        """Whether a connection to the broker is up within the silence window; False as soon as ``stop`` is set (a
        SIGTERM to a peer waiting for a broker that has gone ends it within a heartbeat interval)."""
        deadline = self.clock() + self.silence_s
        while not stop.is_set():
            left = deadline - self.clock()
            if left <= 0:
                return False
            if await writable(self.sock, int(1000 * min(left, self.interval_s)) + 1):
                return True
        return False

    def hello(self, peer_id: str, **role_fields: Any) -> m.Hello:
        """The session's first message: who this peer is, and what its role adds (``m.Hello``'s role fields)."""
        return m.Hello(wire_version=m.WIRE_VERSION, role=self.role, peer_id=peer_id, pid=os.getpid(),
                       host=self.cluster.host, slurm_job_id=self.cluster.job_id, **role_fields)  # fmt: skip

    def send(self, msg: Any) -> None:
        """Send now; ``SessionLost`` if no connection to the broker takes it."""
        try:
            self.now_or_never.send_multipart(codec.encode(msg), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again as e:
            raise SessionLost("broker unreachable") from e

    async def send_within(self, msg: Any, within_s: float | None) -> None:
        """Send, waiting for a connection up to ``within_s`` (None: as long as it takes); skipped after that (with
        none up, a send waits, and the loop must keep its deadlines)."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within_s):
                await self.sock.send_multipart(codec.encode(msg))

    async def receive(self, timeout_s: float) -> list[Any]:
        """What the broker sent, waiting up to ``timeout_s`` for it: every message queued, decoded. A frame that does
        not decode is logged and dropped."""
        if not await self.sock.poll(max(0, int(1000 * timeout_s)) + 1):
            return []
        messages: list[Any] = []
        while True:
            try:
                frames = self.now_or_never.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return messages
            self.heard()
            try:
                messages.append(codec.decode(frames))
            except codec.DecodeError as e:
                log.warning("bad_frame_from_broker", error=str(e)[:200])

    def heard(self) -> None:
        """The broker was heard from now (or is given a new silence window from now)."""
        self.heard_at = self.clock()

    def silent(self, now: float) -> bool:
        """Whether the broker has said nothing for longer than the silence window."""
        return now - self.heard_at > self.silence_s

    def due_in(self, now: float) -> float:
        """Seconds until the next heartbeat is due or the broker would be silent, whichever comes first."""
        return min(self.next_beat - now, self.heard_at + self.silence_s - now)

    def beat_due(self, now: float) -> bool:
        """Whether a heartbeat is due now; if so, the next one is due an interval later."""
        if now < self.next_beat:
            return False
        self.next_beat = now + self.interval_s
        return True

    async def goodbye(self, reason: str) -> None:
        """Leave: a ``Goodbye`` the socket, when closed, holds until it has gone out (skipped with no connection up
        within a heartbeat interval)."""
        await self.send_within(m.Goodbye(reason=reason), self.interval_s)
        self.sock.setsockopt(zmq.LINGER, GOODBYE_LINGER_MS)  # it leaves before the process does

    def close(self) -> None:
        """Close the socket (with no linger, unless a Goodbye was just sent)."""
        self.sock.close()


async def writable(sock: zmq.asyncio.Socket, timeout_ms: int) -> bool:
    """Whether a message can leave ``sock`` within ``timeout_ms`` (pyzmq's type stubs give its async ``poll`` no
    ``flags``, though it takes them)."""
    poll = cast(Callable[[int, int], Awaitable[int]], sock.poll)
    return bool(await poll(timeout_ms, zmq.POLLOUT))
