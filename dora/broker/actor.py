"""BrokerActor: the asyncio + ZeroMQ ROUTER shell around the pure core. It decides nothing.

Every decoded message becomes a core event; every core action becomes a message. The actor owns
what the core must not: sockets, the clock, peer identities, liveness timers, payload frames and
the registry of published weights.

Sending: the ROUTER has ROUTER_MANDATORY on and every send is non-blocking. A message that meets a
full pipe (EAGAIN) waits in that peer's outbox and is retried; nothing is dropped silently. A peer
that cannot be routed to (EHOSTUNREACH) is gone: its leases are re-queued by the core. Application
credits (the worker's slots) keep those outboxes small.

Lossy links: every command to a worker carries a number (``seq``, per session) and a worker applies
commands in order or not at all, so a copy or a late arrival is a loss. Each worker heartbeat says
the highest number it saw, the leases it holds and the version it serves; the actor compares that
with the core's view. A lease whose command the worker saw go by but does not hold was lost: the
core re-queues the group whole (``LeaseLost``). A lease the worker holds that is void gets its
``Cancel`` again; a lost ``Assign`` or ``MigrateOut`` is sent again; a lost ``WeightsLoaded`` is
taken from the heartbeat. Results are re-sent by the worker until acknowledged and taken once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import structlog
import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from dora.actor.liveness import Liveness
from dora.actor.security import Keys
from dora.broker.journal import Journal
from dora.broker.metrics import BrokerMetrics
from dora.broker.snapshot import snapshot
from dora.config.run import RunConfig
from dora.core import events as ev
from dora.core.core import Core
from dora.core.ledger import InvariantViolation
from dora.core.scheduler import GroupFailed
from dora.ids import WorkerId
from dora.store import retire_uri
from dora.wire import codec
from dora.wire import messages as m

log = structlog.get_logger()

HANDSHAKE_FAILED_NAMES = {
    zmq.EVENT_HANDSHAKE_FAILED_AUTH: "auth",
    zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL: "protocol",
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL: "no detail",
}
HANDSHAKE_FAILED = sum(HANDSHAKE_FAILED_NAMES)


@dataclass(slots=True)
class Peer:
    identity: bytes
    role: m.Role
    name: str
    outbox: deque[list[Any]] = field(default_factory=deque)
    seq: int = 0
    """The number of the last command sent to it."""
    lease_seq: dict[tuple[int, int], int] = field(default_factory=dict)
    """(group, attempt) -> number of the command that gave it that lease's work (Generate or MigrateIn)."""
    assign: m.Assign | None = None
    """The last Assign sent to it."""
    migrate_out: dict[tuple[int, int], m.MigrateOut] = field(default_factory=dict)
    """MigrateOut sent to it and not yet answered."""


def _user_id(frames: list[Any]) -> str | None:
    """The User-Id ZAP attached to a message (the peer's z85 public key under CURVE)."""
    frame = frames[1] if len(frames) > 1 else None
    try:
        return frame.get("User-Id") if isinstance(frame, zmq.Frame) else None
    except zmq.ZMQError:
        return None


class BrokerActor:
    def __init__(
        self,
        cfg: RunConfig,
        sock: zmq.asyncio.Socket,
        core: Core,
        prompts: Callable[[int], np.ndarray],
        *,
        clock: Callable[[], float] = time.monotonic,
        epoch: int = 0,
        journal: Journal | None = None,
        weights: dict[int, tuple[str, str]] | None = None,
        keys: Keys | None = None,
    ) -> None:
        self.cfg = cfg
        self.sock = sock
        self.sync = zmq.Socket.shadow(sock.underlying)
        """Non-blocking sends and receives go through this synchronous view of the same socket; the
        asyncio socket is only awaited for readiness (its own NOBLOCK calls would hide errors in futures)."""
        self.core = core
        self.prompts = prompts
        self.clock = clock
        self.epoch = epoch
        b = cfg.broker
        self.liveness = Liveness(b.heartbeat_interval_s, b.liveness, b.stall_timeout_s)
        self.peers: dict[bytes, Peer] = {}
        self.learner: bytes | None = None
        self.journal = journal
        self.keys = keys
        """CURVE is on: every peer is authenticated, and may only say hello as its key's role."""
        self._monitor_sock = sock.get_monitor_socket(HANDSHAKE_FAILED) if keys is not None else None
        self._monitor = zmq.Socket.shadow(self._monitor_sock.underlying) if self._monitor_sock else None
        """Under CURVE a refused handshake is silent to both sides: the socket monitor is how it is counted."""
        self.weights: dict[int, tuple[str, str]] = weights or {0: ("sim://v0", "0" * 64)}
        self.counters = Counter[str]()
        self.lost: deque[dict[str, Any]] = deque(maxlen=32)
        """The latest peers declared dead or gone, with why (for `dora status`)."""
        self.decision_s = Counter[str]()
        """Seconds spent in the core's decisions, by event kind (orchestration runs inside them)."""
        self.malformed = Counter[str]()
        self.started = clock()
        self.trained_tokens = 0
        self.step_started = clock()
        self.done = asyncio.Event()
        self._pending_out: set[bytes] = set()
        self.lag_s: deque[float] = deque(maxlen=4096)
        """How late the heartbeat timer ran, per beat: the event loop's lag (the latest 4,096 beats)."""
        self.metrics = BrokerMetrics(self)
        """Prometheus registry and the run's record files (metrics, timeline); close() it when done."""

    # ------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set or the run is finished."""
        next_beat = self.clock()
        next_tick = self.clock() + self.cfg.broker.tick_s
        retry_ms = 1
        while not stop.is_set() and not self.done.is_set():
            timeout_ms = min(100, max(0, int(1000 * min(next_beat, next_tick) - 1000 * self.clock())))
            if self._pending_out:  # a ROUTER cannot say when one peer's pipe drains: retry soon, backing off
                timeout_ms = min(timeout_ms, retry_ms)
            if await self.sock.poll(timeout_ms, zmq.POLLIN):
                for _ in range(1000):  # drain what is queued without one await per message
                    try:
                        frames = self.sync.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self.on_frames(frames)
            now = self.clock()
            if now >= next_beat:
                self.lag_s.append(now - next_beat)
                self.metrics.loop_lag.observe(now - next_beat)
                next_beat = now + self.cfg.broker.heartbeat_interval_s
                self.check_liveness(now)
            if now >= next_tick:
                next_tick = now + self.cfg.broker.tick_s
                self.feed(ev.Tick())
            retry_ms = 1 if self.flush() else min(2 * retry_ms, 50)
            self.count_handshake_failures()
        if self._monitor_sock is not None:
            self.sock.disable_monitor()
            self._monitor_sock.close(linger=0)

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

    def on_frames(self, frames: list[Any]) -> None:
        identity = bytes(frames[0])
        try:
            msg = codec.decode(frames[1:])
        except codec.WireVersionMismatch as e:
            self.malformed["wire_version"] += 1
            log.warning("wire_version_mismatch", peer_version=e.peer_version, kind=e.kind)
            self.send_raw(identity, m.Reject(reason=str(e), wire_version=m.WIRE_VERSION))
            return
        except codec.DecodeError as e:
            self.malformed["decode"] += 1
            if self.malformed.total() % 1000 == 1:
                log.warning("bad_frame", error=str(e)[:200], total=self.malformed.total())
            return
        peer = self.peers.get(identity)
        if isinstance(msg, m.Hello):
            try:
                text = identity.decode()
            except UnicodeDecodeError:
                text = ""
            if not text.isprintable() or not text:  # peer names are socket identities: ours are printable text
                self.malformed["bad identity"] += 1
                self.send_raw(identity, m.Reject(reason="the socket identity must be printable text (set zmq.IDENTITY)",
                                                 wire_version=m.WIRE_VERSION))  # fmt: skip
                return
            if self.keys is not None:  # ZAP let the key in; the key decides which role it may take
                role = self.keys.role_of(_user_id(frames))
                if role != msg.role.value:
                    self.malformed["role not allowed for key"] += 1
                    reason = f"this CURVE key may connect as {role or 'nothing'}, not as {msg.role.value}"
                    log.error("peer_rejected", peer=msg.peer_id, reason=reason)
                    self.send_raw(identity, m.Reject(reason=reason, wire_version=m.WIRE_VERSION))
                    return
            self.on_hello(identity, msg)
            return
        if isinstance(msg, m.StatusRequest):
            self.send_raw(identity, m.StatusReply(snapshot=self.snapshot()))
            return
        if peer is None:
            if isinstance(msg, m.SampleFinished | m.SamplesFinished):  # a worker declared dead, back with old work
                self.counters["refused result from an unregistered peer"] += 1
                if self.counters["refused result from an unregistered peer"] % 100 == 1:
                    log.warning("late_result_refused", peer=identity.decode(errors="replace"))
            else:
                self.malformed["unregistered"] += 1
            self.send_raw(identity, m.Disconnect(reason="unknown peer: say hello first"))
            return
        self.liveness.heard(identity.decode(), self.clock())
        with structlog.contextvars.bound_contextvars(kind=type(msg).__name__, peer=peer.name):
            self.on_message(peer, msg)

    def on_hello(self, identity: bytes, hello: m.Hello) -> None:
        reject = m.check_hello(hello)
        if reject is not None:
            log.error("peer_rejected", peer=hello.peer_id, reason=reject.reason)
            self.send_raw(identity, reject)
            return
        newest = self.core.ledger.newest
        if hello.role is m.Role.LEARNER and hello.learner_version is not None and hello.learner_version > newest:
            # Its checkpoint holds steps this broker never saw published: training on would fork the run.
            reason = (
                f"the learner's checkpoint is at version {hello.learner_version}, this broker's newest is {newest}: "
                "resume the broker from its journal, or start the learner without that checkpoint"
            )
            log.error("peer_rejected", peer=hello.peer_id, reason=reason)
            self.send_raw(identity, m.Reject(reason=reason, wire_version=m.WIRE_VERSION))
            return
        old = self.peers.get(identity)
        if old is not None and old.role is hello.role and old.name == hello.peer_id:
            self.counters["hello repeated"] += 1  # identities are per session: a copy, or its Welcome was lost
            self.send(old, self.welcome())
            return
        if old is not None:
            self.peer_lost(old, "hello again")
        peer = Peer(identity=identity, role=hello.role, name=hello.peer_id)
        self.peers[identity] = peer
        timeout = self.cfg.broker.learner_timeout_s if hello.role is m.Role.LEARNER else None
        self.liveness.joined(identity.decode(), self.clock(), timeout_s=timeout)
        self.send(peer, self.welcome())
        log.info(
            "peer_joined",
            peer=hello.peer_id,
            role=hello.role.value,
            pid=hello.pid,
            host=hello.host,
            slots=hello.slots,
            engine=hello.engine,
        )
        if hello.role is m.Role.ROLLOUT:
            ready = self.core.fleet_ready
            self.feed(ev.WorkerJoined(worker_id=WorkerId(identity.decode()), slots=hello.slots))
            if self.core.fleet_ready and not ready:
                log.info("fleet_ready", workers=len(self.core.scheduler.workers))
        elif hello.role is m.Role.LEARNER:
            if self.learner is not None and self.learner in self.peers:
                self.peer_lost(self.peers[self.learner], "replaced by a new learner")
            self.learner = identity

    def welcome(self) -> m.Welcome:
        b = self.cfg.broker
        return m.Welcome(broker_epoch=self.epoch, heartbeat_interval_s=b.heartbeat_interval_s, liveness=b.liveness,
                         newest_version=self.core.ledger.newest)  # fmt: skip

    def on_message(self, peer: Peer, msg: Any) -> None:
        w = WorkerId(peer.identity.decode())
        rollout, learner = peer.role is m.Role.ROLLOUT, peer.role is m.Role.LEARNER
        match msg:
            case m.Heartbeat() if rollout:
                # so the worker can tell a dead broker from an idle one, and knows the last command sent to it
                self.send(peer, m.Heartbeat(seen=peer.seq))
                self.liveness.progressed(w, self.clock(), msg.tokens_generated, busy=msg.running > 0)
                self.reconcile(peer, msg)
                if msg.kv_use >= self.core.cfg.kv_rebalance_threshold:
                    self.feed(ev.LoadReported(worker_id=w, kv_use=msg.kv_use))
            case m.Heartbeat():
                self.send(peer, m.Heartbeat())
                self.liveness.progressed(w, self.clock(), 0, busy=False)
            case m.SampleFinished() if rollout:
                self.send(peer, self.on_samples(peer, (msg,))[0])
            case m.SamplesFinished() if rollout:
                self.send(peer, m.ResultAcks(acks=self.on_samples(peer, msg.samples)))
            case m.WeightsLoaded() if rollout:
                self.feed(ev.WeightsLoaded(worker_id=w, version=msg.version))
            case m.MigrationExported() if rollout:
                peer.migrate_out.pop((msg.group_id, msg.attempt), None)
                self.feed(
                    ev.MigrationExported(
                        worker_id=w,
                        group_id=msg.group_id,
                        attempt=msg.attempt,
                        n_requests=len(msg.requests),
                        state=msg.requests,
                    )
                )
            case m.RequestBatch() if learner:
                self.feed(ev.BatchRequested(step=msg.step))
            case m.WeightsPublished() if learner:
                self.on_published(peer, msg)
            case m.Goodbye():
                log.info("peer_left", reason=msg.reason)
                self.peer_lost(peer, f"goodbye: {msg.reason}")
            case _:
                self.malformed[f"unexpected {type(msg).__name__} from {peer.role.value}"] += 1

    def reconcile(self, peer: Peer, hb: m.Heartbeat) -> None:
        """Compare what a worker says it holds with the core's view, and mend what a lost message broke."""
        w = WorkerId(peer.identity.decode())
        worker = self.core.scheduler.workers.get(w)
        if worker is None:
            return
        flights, held = self.core.scheduler.flights, hb.held()
        current = {(g, int(flights[g].attempt)) for g in worker.groups}
        for key in sorted(current - held):  # it saw the command go by, and holds nothing of it
            if peer.lease_seq.get(key, hb.seen + 1) <= hb.seen:
                self.counters["lease lost on the way"] += 1
                log.warning("lease_lost", group_id=key[0], attempt=key[1], seen=hb.seen)
                self.feed(ev.LeaseLost(worker_id=w, group_id=key[0], attempt=key[1]))
        current = {(g, int(flights[g].attempt)) for g in worker.groups}
        peer.lease_seq = {k: v for k, v in peer.lease_seq.items() if k in current}
        for group, attempt in sorted(held - current):  # void leases it still works on: its Cancel was lost
            self.counters["cancel sent again"] += 1
            self.command(w, m.Cancel(group_id=group, attempt=attempt))
        for key, out in list(peer.migrate_out.items()):
            f = flights.get(key[0])
            if f is None or f.worker != w or f.target is None or f.attempt != key[1]:
                del peer.migrate_out[key]  # answered (or the group moved on) in some other way
            elif key in held and out.seq <= hb.seen:
                self.counters["migrate_out sent again"] += 1
                self.command(w, out)
        pinned = self.core.ledger.version_of(w)
        if pinned is None or worker.ready or peer.assign is None or peer.assign.version != pinned:
            return
        if hb.version == pinned and hb.loading < 0:  # it loaded them, and the WeightsLoaded was lost
            self.counters["weights_loaded taken from a heartbeat"] += 1
            self.feed(ev.WeightsLoaded(worker_id=w, version=pinned))
        elif pinned not in (hb.version, hb.loading) and peer.assign.seq <= hb.seen:
            self.counters["assign sent again"] += 1
            self.command(w, peer.assign)

    def on_samples(self, peer: Peer, msgs: tuple[m.SampleFinished, ...]) -> tuple[m.ResultAck, ...]:
        """Hand finished samples to the core as one event; the answer for each, in order."""
        worker = WorkerId(peer.identity.decode())
        current = [x for x in msgs if x.broker_epoch == self.epoch]
        refused: dict[tuple[int, int, int], list[str]] = {}
        if current:
            events = tuple(
                ev.SampleFinished(worker_id=worker, group_id=x.group_id, attempt=x.attempt, index=x.index,
                                  segments=tuple(map(tuple, x.segments.tolist())), finish=x.finish, payload=x)
                for x in current
            )  # fmt: skip
            actions = self.feed(events[0] if len(events) == 1 else ev.SamplesFinished(samples=events))
            for a in actions:
                if isinstance(a, ev.Refused) and a.index is not None:
                    refused.setdefault((a.group_id, a.attempt, a.index), []).append(a.reason)
        left = Counter((x.group_id, x.attempt, x.index) for x in current)
        acks = []
        for x in msgs:
            key = (x.group_id, x.attempt, x.index)
            if x.broker_epoch != self.epoch:
                self.counters["refused old broker epoch"] += 1
                reason: str | None = "old broker epoch"
            else:  # a copy later in the same message is the one refused as a duplicate
                left[key] -= 1
                reasons = refused.get(key, [])
                reason = reasons[len(reasons) - 1 - left[key]] if left[key] < len(reasons) else None
            acks.append(m.ResultAck(group_id=x.group_id, attempt=x.attempt, index=x.index, accepted=reason is None,
                                    reason=reason or ""))  # fmt: skip
        return tuple(acks)

    def on_published(self, peer: Peer, msg: m.WeightsPublished) -> None:
        if msg.version == self.core.ledger.newest and msg.version in self.weights:
            self.send(peer, m.PublishAck(version=msg.version))  # a repeat (the ack was lost): idempotent
            return
        batch = self.core.publishable(msg.version)
        if batch is None:
            self.counters["refused publish"] += 1
            log.warning("publish_refused", version=msg.version, newest=self.core.ledger.newest)
            return
        if self.journal is not None:  # durable before it takes effect, and before the learner may checkpoint it
            self.journal.step(msg.version, msg.uri, msg.sha256, [g.group_id for g in batch.groups])
        self.weights[msg.version] = (msg.uri, msg.sha256)
        self.trained_tokens += sum(len(s.payload.token_ids) for g in batch.groups for s in g.samples)
        self.send(peer, m.PublishAck(version=msg.version))  # ahead of the run's end, which says goodbye
        actions = self.feed(ev.WeightsPublished(version=msg.version))
        if any(isinstance(a, ev.Refused) for a in actions):
            raise InvariantViolation(f"the core refused publish {msg.version} after the broker checked it")
        now = self.clock()
        row = {
            "step": msg.version - 1,
            "version": msg.version,
            "step_s": round(now - self.step_started, 3),
            "publish_s": msg.publish_s,
            "staleness": {str(k): n for k, n in sorted(self.core.transfer.staleness.items())},
            "live_versions": self.core.ledger.alive(),
            "workers": len(self.core.scheduler.workers),
        }
        learner = {k: round(v, 4) for k, v in msg.metrics.items()}
        log.info("train_step", **row, learner=learner)  # the learner's own numbers, kept apart
        self.metrics.train_step(row, learner, elapsed_s=now - self.started)
        self.step_started = now

    # ------------------------------------------------------------------ the core

    def feed(self, event: ev.Event) -> list[ev.Action]:
        started, now = time.perf_counter(), self.clock()
        try:
            actions = self.core.handle(now, event)
        except GroupFailed as e:
            log.error("group_failed", error=str(e))
            raise
        finally:
            self.decision_s[type(event).__name__] += time.perf_counter() - started
        if self.journal is not None:  # every group id about to leave is reserved on disk first
            self.journal.reserve_through(self.core.scheduler.cursor)
        self.metrics.fed(now, event, actions)
        for action in actions:
            self.act(action)
        return actions

    def act(self, a: ev.Action) -> None:
        match a:
            case ev.Lease():
                log.debug("group_leased", group_id=a.group_id, attempt=a.attempt, worker=a.worker_id, version=a.version)
                c = self.cfg.run
                self.command(
                    a.worker_id,
                    m.Generate(
                        group_id=a.group_id,
                        attempt=a.attempt,
                        version=a.version,
                        prompt_ids=self.prompts(a.group_id),
                        n_samples=a.n_samples,
                        max_tokens=c.max_tokens,
                        temperature=c.temperature,
                        top_p=c.top_p,
                        seed=(c.seed << 32) ^ a.attempt,
                        broker_epoch=self.epoch,
                    ),
                )
            case ev.Assign():
                log.info("worker_assigned", worker=a.worker_id, version=a.version, interrupt=a.interrupt)
                uri, sha = self.weights.get(a.version, (f"sim://v{a.version}", "0" * 64))
                self.command(a.worker_id, m.Assign(version=a.version, uri=uri, sha256=sha, interrupt=a.interrupt))
            case ev.MigrateOut():
                self.command(
                    a.worker_id,
                    m.MigrateOut(group_id=a.group_id, attempt=a.attempt, version=a.version, target=a.target),
                )
            case ev.MigrateIn():
                requests: tuple[m.RequestState, ...] = a.state
                log.info(
                    "migration",
                    group_id=a.group_id,
                    source=a.source,
                    target=a.worker_id,
                    version=a.version,
                    requests=a.n_requests,
                    tokens_moved=sum(len(r.token_ids) for r in requests),
                )
                c = self.cfg.run
                self.command(
                    a.worker_id,
                    m.MigrateIn(
                        group_id=a.group_id,
                        attempt=a.attempt,
                        version=a.version,
                        source=a.source,
                        prompt_ids=self.prompts(a.group_id),
                        requests=requests,
                        max_tokens=c.max_tokens,
                        temperature=c.temperature,
                        top_p=c.top_p,
                        seed=(c.seed << 32) ^ a.attempt,
                    ),
                )
            case ev.Cancel():
                self.command(a.worker_id, m.Cancel(group_id=a.group_id, attempt=a.attempt))
            case ev.DeliverBatch():
                self.deliver(a)
            case ev.Retire():
                uri, _ = self.weights.pop(a.version, ("", ""))
                removed = retire_uri(uri)
                log.info("version_retired", version=a.version, deleted=str(removed) if removed else None)
                for peer in [p for p in self.peers.values() if p.role is m.Role.ROLLOUT]:
                    self.send(peer, m.RetireVersion(version=a.version))
            case ev.Refused():
                self.counters[f"refused {a.reason}"] += 1
            case ev.RunFinished():
                log.info("run_finished", steps=a.steps, elapsed_s=round(self.clock() - self.started, 3),
                         decision_s={k: round(v, 4) for k, v in self.decision_s.most_common()},
                         migrated_groups=self.core.scheduler.stats_migrated_groups)  # fmt: skip
                if self.cfg.broker.exit_when_done:
                    for peer in list(self.peers.values()):
                        self.send(peer, m.Goodbye(reason="run finished"))
                    self.done.set()

    def deliver(self, batch: ev.DeliverBatch) -> None:
        groups = []
        for g in batch.groups:
            samples = []
            for s in g.samples:
                p: m.SampleFinished = s.payload
                samples.append(
                    m.TrainSample(
                        index=s.index,
                        token_ids=p.token_ids,
                        logprobs=p.logprobs,
                        reward=p.reward,
                        finish=p.finish,
                        segments=p.segments,
                    )
                )
            groups.append(
                m.TrainGroup(
                    group_id=g.group_id, version=g.version, prompt_ids=self.prompts(g.group_id), samples=tuple(samples)
                )
            )
        learner = self.peers.get(self.learner) if self.learner else None
        if learner is None:
            log.warning("batch_without_learner", step=batch.step)
            return  # the core keeps it and delivers it again when a learner asks for this step
        self.send(learner, m.TrainBatch(step=batch.step, groups=tuple(groups), redelivery=batch.redelivery))

    # ------------------------------------------------------------------ peers and sending

    def check_liveness(self, now: float) -> None:
        for name, reason in self.liveness.expired(now):
            peer = self.peers.get(name.encode())
            if peer is not None:
                log.warning("peer_expired", peer=peer.name, reason=reason)
                self.send_raw(peer.identity, m.Disconnect(reason=reason))
                self.peer_lost(peer, reason)

    def peer_lost(self, peer: Peer, reason: str) -> None:
        held = self.core.scheduler.workers.get(WorkerId(peer.identity.decode()))
        log.warning("peer_lost", peer=peer.name, role=peer.role.value, reason=reason,
                    groups=sorted(held.groups) if held is not None else [])  # fmt: skip
        self.lost.append({"peer": peer.name, "role": peer.role.value, "reason": reason,
                          "uptime_s": round(self.clock() - self.started, 3)})  # fmt: skip
        self.peers.pop(peer.identity, None)
        self.liveness.forget(peer.identity.decode())
        self.counters[f"lost {peer.role.value}"] += 1
        self.metrics.peer_lost(peer.role.value, reason)
        if peer.role is m.Role.ROLLOUT and WorkerId(peer.identity.decode()) in self.core.scheduler.workers:
            self.feed(ev.WorkerLost(worker_id=WorkerId(peer.identity.decode()), reason=reason))
        elif peer.role is m.Role.LEARNER and self.learner == peer.identity:
            self.learner = None
            self.feed(ev.LearnerLost(reason=reason))

    def command(self, worker: WorkerId, msg: Any) -> None:
        """Number a command to a worker and send it; remember what reconciliation may need again."""
        peer = self.peers.get(worker.encode())
        if peer is None:
            return
        peer.seq += 1
        msg = dataclasses.replace(msg, seq=peer.seq)
        match msg:
            case m.Generate() | m.MigrateIn():
                peer.lease_seq[(msg.group_id, msg.attempt)] = msg.seq
            case m.Assign():
                peer.assign = msg
            case m.MigrateOut():
                peer.migrate_out[(msg.group_id, msg.attempt)] = msg
        self.send(peer, msg)

    def send(self, peer: Peer, msg: Any) -> None:
        peer.outbox.append([peer.identity, *codec.encode(msg)])
        self._pending_out.add(peer.identity)

    def send_raw(self, identity: bytes, msg: Any) -> None:
        """Reply to an identity that is not (or no longer) a registered peer; best effort."""
        try:
            self.sync.send_multipart([identity, *codec.encode(msg)], flags=zmq.NOBLOCK, copy=False)
        except zmq.ZMQError:
            self.counters["unroutable reply"] += 1

    def flush(self) -> int:
        """Send what the outboxes hold, in order, until a pipe is full. Returns the messages sent."""
        sent = 0
        for identity in list(self._pending_out):
            peer = self.peers.get(identity)
            if peer is None:
                self._pending_out.discard(identity)
                continue
            while peer.outbox:
                try:
                    self.sync.send_multipart(peer.outbox[0], flags=zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break  # full pipe: keep it queued, retry on the next pass
                except zmq.ZMQError as e:
                    if e.errno == zmq.EHOSTUNREACH:
                        self.peer_lost(peer, "unreachable")
                        break
                    raise
                peer.outbox.popleft()
                sent += 1
            if not peer.outbox:
                self._pending_out.discard(identity)
        return sent

    # ------------------------------------------------------------------ status

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self)
