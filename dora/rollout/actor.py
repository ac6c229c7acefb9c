"""RolloutActor: one engine replica behind a DEALER socket.

Hello -> Welcome -> Assign (load the version the broker pins it to) -> Generate / MigrateOut /
MigrateIn / Cancel, streaming every finished sample with its token ids, behaviour log-probs, version
history, reward and finish reason. Heartbeats carry a progress counter (tokens generated) so the
broker can tell a hung engine from a busy one. If the broker goes silent, refuses it, or says
Disconnect, the worker drops its work (those leases are void) and says hello again on a new socket
with a new identity, backing off 1 -> 32 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog
import zmq
import zmq.asyncio

from dora.config import ConfigError
from dora.rollout.engines.base import EngineError, WorkerEngine
from dora.runconfig import RunConfig
from dora.security import HINT, Keys
from dora.wire import codec
from dora.wire import messages as m

log = structlog.get_logger()


class Reconnect(Exception):
    """The session with the broker is over; start a new one."""


class RolloutActor:
    def __init__(
        self,
        cfg: RunConfig,
        ctx: zmq.asyncio.Context,
        endpoint: str | Callable[[], str],
        name: str,
        engine: WorkerEngine,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.ctx = ctx
        self.endpoint = endpoint
        self.name = name
        self.engine = engine
        self.clock = clock
        self.slots = cfg.rollout.slots or cfg.engine.credit
        self.epoch = 0
        self.interval = cfg.broker.heartbeat_interval_s
        self.silence_s = cfg.broker.heartbeat_interval_s * cfg.broker.liveness
        self.sock: zmq.Socket | None = None
        self.loading: tuple[int, float, str, str] | None = None
        self.sent = 0
        self.keys = Keys.load(cfg.security.keys) if cfg.security.keys else None
        self.welcomed = False
        self.session_welcomed = False

    async def run(self, stop: asyncio.Event) -> int:
        backoff = 1.0
        started = self.clock()
        while not stop.is_set():
            try:
                await self.session(stop)
                return 0
            except Reconnect as e:
                if not self.welcomed and self.keys and self.clock() - started > self.cfg.security.auth_timeout_s:
                    log.error("broker_never_answered", reason=str(e), hint=HINT)
                    return 2
                if self.session_welcomed:  # that session worked: the broker is new, not flapping, so retry soon
                    backoff = 1.0
                log.warning("reconnecting", reason=str(e), backoff_s=backoff)
                self.engine.clear()
                self.loading = None
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=backoff)
                backoff = min(backoff * 2, self.cfg.rollout.reconnect_max_s)
        return 0

    async def session(self, stop: asyncio.Event) -> None:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.IDENTITY, f"rollout/{self.name}/{uuid.uuid4().hex[:8]}".encode())
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)
        self.session_welcomed = False
        if self.keys is not None:
            self.keys.connect_as(sock, "rollout")
        try:  # a discovery file is read again on every session: a restarted broker may listen elsewhere
            sock.connect(self.endpoint() if callable(self.endpoint) else self.endpoint)
        except (ConfigError, zmq.ZMQError) as e:
            sock.close(linger=0)
            raise Reconnect(f"no broker: {e}") from None
        self.sock = zmq.Socket.shadow(sock.underlying)  # non-blocking I/O; ``sock`` is awaited for readiness
        self.finished = False
        try:
            if not await sock.poll(int(1000 * self.silence_s), zmq.POLLOUT):
                raise Reconnect("broker unreachable")
            self.send(
                m.Hello(
                    wire_version=m.WIRE_VERSION,
                    role=m.Role.ROLLOUT,
                    peer_id=self.name,
                    pid=os.getpid(),
                    host=socket.gethostname(),
                    slurm_job_id=os.environ.get("SLURM_JOB_ID"),
                    slots=self.slots,
                    engine=self.engine.name,
                )
            )
            heard = self.clock()
            next_beat = self.clock()
            while not stop.is_set() and not self.finished:
                now = self.clock()
                waits = [next_beat - now, heard + self.silence_s - now]
                if (nxt := self.engine.next_event_s()) is not None:
                    waits.append(nxt)
                if self.loading is not None:
                    waits.append(self.loading[1] - now)
                if await sock.poll(max(0, int(1000 * min(waits))) + 1, zmq.POLLIN):
                    while True:
                        try:
                            frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                        except zmq.Again:
                            break
                        heard = self.clock()
                        self.on_frames(frames)
                now = self.clock()
                if now - heard > self.silence_s:
                    raise Reconnect("broker silent")
                if self.loading is not None and now >= self.loading[1]:
                    version, _, uri, sha = self.loading
                    self.loading = None
                    try:
                        self.engine.loaded(version, uri, sha)
                        log.info("weights_loaded", version=version, uri=uri)
                    except EngineError as e:  # bad weights: stay on the old version, let the broker re-plan
                        log.error("weights_refused", version=version, error=str(e))
                        raise Reconnect(f"could not load v{version}") from None
                    self.send(m.WeightsLoaded(version=version, load_s=self.engine.load_seconds()))
                self.engine.advance(now)
                self.report_finished()
                if now >= next_beat:
                    next_beat = now + self.interval
                    running, kv = self.engine.load()
                    self.send(m.Heartbeat(tokens_generated=self.engine.tokens_generated, running=running, kv_use=kv))
            if not self.finished:
                self.send(m.Goodbye(reason="stopping"))
                await asyncio.sleep(0.05)
        finally:
            sock.close(linger=0)
            self.sock = None

    def on_frames(self, frames: list[Any]) -> None:
        try:
            msg = codec.decode(frames)
        except codec.DecodeError as e:
            log.warning("bad_frame_from_broker", error=str(e)[:200])
            return
        now = self.clock()
        match msg:
            case m.Welcome():
                self.welcomed = self.session_welcomed = True
                self.epoch = msg.broker_epoch
                log.info("registered", broker_epoch=msg.broker_epoch, newest_version=msg.newest_version)
            case m.Assign():
                if self.engine.busy() and not msg.interrupt:
                    log.error("assign_refused_requests_running", version=msg.version)
                    return
                self.engine.advance(now)
                self.loading = (msg.version, now + self.engine.load_seconds(), msg.uri, msg.sha256)
                structlog.contextvars.bind_contextvars(version=msg.version)
            case m.Generate():
                self.engine.submit(msg, now)
            case m.MigrateOut():
                requests = self.engine.export(msg.group_id, msg.attempt, now)
                self.report_finished()  # samples that finished before the export are reported first
                self.send(m.MigrationExported(group_id=msg.group_id, attempt=msg.attempt, requests=tuple(requests)))
            case m.MigrateIn():
                self.engine.import_(msg, now)
            case m.Cancel():
                self.engine.cancel(msg.group_id, msg.attempt, now)
            case m.Reject():
                log.error("rejected_by_broker", reason=msg.reason)
                raise Reconnect(f"rejected: {msg.reason}")
            case m.Disconnect():
                raise Reconnect(f"disconnected: {msg.reason}")
            case m.Goodbye():
                log.info("broker_finished", reason=msg.reason)
                self.finished = True
            case m.ResultAck() | m.ResultAcks() | m.RetireVersion() | m.Heartbeat():
                pass
            case _:
                log.warning("unexpected_message", kind=type(msg).__name__)

    def report_finished(self) -> None:
        """Stream what finished since the last report: one message, however many samples."""
        results = [self.engine.result(r, self.epoch) for r in self.engine.take_finished()]
        if len(results) == 1:
            self.send(results[0])
        elif results:
            self.send(m.SamplesFinished(samples=tuple(results)))

    def send(self, msg: Any) -> None:
        assert self.sock is not None
        try:
            self.sock.send_multipart(codec.encode(msg), flags=zmq.NOBLOCK, copy=False)
            self.sent += 1
        except zmq.Again as e:  # the broker is not connected: the session must restart
            raise Reconnect("broker unreachable") from e
