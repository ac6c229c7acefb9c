"""BrokerActor: the asyncio + ZeroMQ ROUTER shell around the pure core. It decides nothing.

Every decoded message becomes a core event; every core action becomes a message. The actor owns
what the core must not: sockets, the clock, peer identities, liveness timers, payload frames and
the registry of published weights. Sending, outboxes and command numbering are ``dora.broker.links``;
mending what lossy links broke is ``dora.broker.reconcile``; the operators' view is
``dora.broker.snapshot`` and ``dora.broker.metrics``.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections import Counter, defaultdict, deque
from collections.abc import Callable
from typing import Any

import numpy as np
import structlog
import zmq
import zmq.asyncio

from dora.actor.lag import watching_lag
from dora.actor.liveness import Liveness
from dora.actor.security import Keys
from dora.broker import translate
from dora.broker.evaluation import BrokerEval, EvalRounds
from dora.broker.journal import Journal
from dora.broker.links import Links, Peer, recv_frames, user_id
from dora.broker.metrics import BrokerMetrics, batch_stats, rounded, step_row
from dora.broker.reconcile import reconcile
from dora.broker.snapshot import snapshot
from dora.config.run import RunConfig
from dora.core import events as ev
from dora.core.core import Core
from dora.core.intake import GroupFailed
from dora.core.ledger import InvariantViolation
from dora.ids import WorkerId
from dora.store.dirs import retire_uri
from dora.store.relays import RelayTree
from dora.wire import codec
from dora.wire import messages as m

log = structlog.get_logger()

TURN_S = 0.002
"""One turn of the loop handles queued messages for at most this long; then the timers, the sends and the
other tasks (the lag probe, the metrics endpoint) have their turn, however long the queue."""
ACTS_PER_TURN = 128
"""The core's actions carried out (commands numbered, encoded and queued) per event or turn of the loop; the rest
wait, in order, for the next turns. A publish re-pins every idle worker of an older version at once (a thousand
Assigns at 1,024 workers): carried out in one go, they held the loop for 10-25 ms."""


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
        evals: EvalRounds | None = None,
    ) -> None:
        self.cfg = cfg
        self.sock = sock
        self.core = core
        self.prompts = prompts
        self.clock = clock
        self.epoch = epoch
        self.journal = journal
        self.weights: dict[int, tuple[str, str]] = weights or {0: ("sim://v0", "0" * 64)}
        self.carried: dict[int, tuple[tuple[str, ...], dict[str, bytes]]] = {}
        """What a version's publish carried besides its uri, passed on in every Assign of it: the data-plane
        endpoints that serve its files, and a small version's files themselves (not journalled: a restarted broker's
        workers read the store)."""
        self._init_counts()
        self._init_peers(sock, keys)
        self.acts: deque[ev.Action] = deque()
        """The core's actions not yet carried out, in the order it decided them (ACTS_PER_TURN)."""
        self.waiting = Counter[WorkerId]()
        """Actions not yet carried out per worker they command: its heartbeats are not reconciled meanwhile."""
        self.done = asyncio.Event()
        self.closing_until: float | None = None
        """Set when the run is finished while held-out rounds are still open: the broker says goodbye once they
        close, or at this time (then they are reported dropped)."""
        self.metrics = BrokerMetrics(self)
        """Prometheus registry and the run's record files (metrics, timeline); close() it when done."""
        self.log_leases = cfg.log.level == "debug"
        """A lease's line is debug: unless debug lines are written, no logger is bound for it (one per group)."""
        self.evals = BrokerEval(evals, core, self.links.send_to, self.metrics.eval_round)
        """Held-out evaluation rounds, run by the workers outside every core decision (none: does nothing)."""
        self.relays = RelayTree(cfg.rollout.relay_fanout)
        """Each node's sources in its workers' Assign: its parent relay's chunk server, then the learner's."""

    def _init_counts(self) -> None:
        """What the broker counts and times beside the core (for metrics and `dora status`)."""
        self.counters = Counter[str]()
        self.decision_s: defaultdict[str, float] = defaultdict(float)
        """Seconds spent in the core's decisions, by event kind (orchestration runs inside them)."""
        self.malformed = Counter[str]()
        self.started = self.clock()
        self.trained_tokens = 0
        self.step_started = self.clock()
        self.lag_s: deque[float] = deque(maxlen=4096)
        """Event-loop lag: how late the probe woke after each of its sleeps (the latest 4,096, ~3.5 min)."""

    def _init_peers(self, sock: zmq.asyncio.Socket, keys: Keys | None) -> None:
        """The peers, their links and their liveness, and what is remembered of the ones lost."""
        b = self.cfg.broker
        self.liveness = Liveness(b.heartbeat_interval_s, b.liveness, b.stall_timeout_s)
        self.learner: bytes | None = None
        self.keys = keys
        """CURVE is on: every peer is authenticated, and may only say hello as its key's role."""
        self.links = Links(sock, self.counters, monitor=keys is not None)
        self.peers = self.links.peers
        self.lost: deque[dict[str, Any]] = deque(maxlen=32)
        """The latest peers declared dead or gone, with why (for `dora status`)."""
        self.declared_dead: dict[tuple[str, str, int], tuple[str, float]] = {}
        """(name, host, pid) of each peer declared dead by silence or stall -> (reason, when): a Hello from that
        same process later means it was alive, only slow or cut off for a while (a false death, counted)."""
        self.unreachable: dict[bytes, Peer] = {}
        """Peers a send found gone, lost once what came from them is read: a process that said goodbye and closed
        its socket is gone from the ROUTER's routes before its Goodbye is read."""
        self.unreachable_at = 0.0
        """When the oldest of ``unreachable`` was found so."""

    # ------------------------------------------------------------------ loop

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set or the run is finished."""
        async with watching_lag(self.observe_lag):
            await self.serve(stop)
        self.links.close()

    def observe_lag(self, late_s: float) -> None:
        self.lag_s.append(late_s)
        self.metrics.loop_lag.observe(late_s)

    async def serve(self, stop: asyncio.Event) -> None:
        next_beat = self.clock()
        next_tick = self.clock() + self.cfg.broker.tick_s
        retry_ms = 1
        last = self.clock()
        while not stop.is_set() and not self.done.is_set():
            # at least 1 ms: pyzmq's poll(0) resolves without yielding to the event loop, and a run of them would
            # starve every other task (the lag probe, the metrics endpoint) while messages keep coming
            timeout_ms = min(100, max(1, int(1000 * min(next_beat, next_tick) - 1000 * self.clock())))
            if self.links.pending:  # a ROUTER cannot say when one peer's pipe drains: retry soon, backing off
                timeout_ms = min(timeout_ms, retry_ms)
            if self.acts:
                timeout_ms = 1
                self.carry_out()
            drained = not await self.sock.poll(timeout_ms) or self.drain()
            now = self.clock()
            # A peer a send found gone is lost once what it sent is read (a Goodbye among it leaves with its own
            # reason): after a drain that emptied the socket, or an interval later for a broker that stays behind.
            if self.unreachable and (drained or now - self.unreachable_at > self.cfg.broker.heartbeat_interval_s):
                for identity, peer in self.unreachable.items():
                    if self.peers.get(identity) is peer:
                        self.peer_lost(peer, "unreachable")
                self.unreachable.clear()
            # Longer than asked since the last turn: the broker was not run (a loaded machine), or held, and heard
            # nobody meanwhile; peers whose heartbeats wait in the queue are not silent for it.
            away, last = now - last - timeout_ms / 1000, now
            if away > self.cfg.broker.heartbeat_interval_s:
                self.liveness.absent(away)
            # Silence is judged once every message that came is read (a heartbeat waiting in the queue is not
            # silence), or, for a broker that stays behind, once a whole silence window late.
            if now >= next_beat and (drained or now - next_beat > self.liveness.timeout_s):
                next_beat = now + self.cfg.broker.heartbeat_interval_s
                self.check_liveness(now)
            if now >= next_tick:
                next_tick = now + self.cfg.broker.tick_s
                self.feed(ev.Tick())
            self.evals.tick(now)  # rows go out as soon as a round's version has a ready worker
            if self.closing_until is not None and (not self.evals.open(now) or now >= self.closing_until):
                self.finish()
            retry_ms = 1 if self.flush(until=time.perf_counter() + TURN_S) else min(2 * retry_ms, 50)
            self.links.count_handshake_failures()

    def drain(self) -> bool:
        """Handle queued messages for up to TURN_S, without an await per message; True if none is left."""
        until = time.perf_counter() + TURN_S
        while time.perf_counter() < until:
            if not self.read_one():
                return True
        return False

    def read_one(self) -> bool:
        """Handle one queued message; False if none was queued."""
        try:
            frames = recv_frames(self.links.sync)
        except zmq.Again:
            return False
        self.on_frames(frames)
        return True

    def on_frames(self, frames: list[Any]) -> None:
        identity = bytes(frames[0])
        peer = self.peers.get(identity)
        if peer is not None:  # any frame from a peer, a bad one too, says it is there: silence is no frame at all
            self.liveness.heard(peer.worker, self.clock())
        try:
            msg = codec.decode(frames[1:])
        except codec.WireVersionMismatch as e:
            self.malformed["wire_version"] += 1
            log.warning("wire_version_mismatch", peer_version=e.peer_version, kind=e.kind)
            self.links.send_raw(identity, m.Reject(reason=str(e), wire_version=m.WIRE_VERSION))
            return
        except codec.DecodeError as e:
            self.malformed["decode"] += 1
            if self.malformed.total() % 1000 == 1:
                log.warning("bad_frame", error=str(e)[:200], total=self.malformed.total())
            return
        if isinstance(msg, m.Hello):
            try:
                text = identity.decode()
            except UnicodeDecodeError:
                text = ""
            if not text.isprintable() or not text:  # peer names are socket identities: ours are printable text
                self.malformed["bad identity"] += 1
                reason = "the socket identity must be printable text (set zmq.IDENTITY)"
                self.links.send_raw(identity, m.Reject(reason=reason, wire_version=m.WIRE_VERSION))
                return
            if self.keys is not None:  # ZAP let the key in; the key decides which role it may take
                role = self.keys.role_of(user_id(frames))
                if role != msg.role.value:
                    self.malformed["role not allowed for key"] += 1
                    reason = f"this CURVE key may connect as {role or 'nothing'}, not as {msg.role.value}"
                    log.error("peer_rejected", peer=msg.peer_id, reason=reason)
                    self.links.send_raw(identity, m.Reject(reason=reason, wire_version=m.WIRE_VERSION))
                    return
            self.on_hello(identity, msg)
            return
        if isinstance(msg, m.StatusRequest):
            self.links.send_raw(identity, m.StatusReply(snapshot=self.snapshot()))
            return
        if peer is None:
            if isinstance(msg, m.SamplesFinished):  # a worker declared dead, back with old work
                self.counters["refused result from an unregistered peer"] += 1
                if self.counters["refused result from an unregistered peer"] % 100 == 1:
                    log.warning("late_result_refused", peer=identity.decode(errors="replace"))
            else:
                self.malformed["unregistered"] += 1
            self.links.send_raw(identity, m.Disconnect(reason="unknown peer: say hello first"))
            return
        # bound for this message's log lines; reset to what was bound before (cheaper than bound_contextvars)
        bound = structlog.contextvars.bind_contextvars(kind=type(msg).__name__, peer=peer.name)
        try:
            self.on_message(peer, msg)
        finally:
            structlog.contextvars.reset_contextvars(**bound)

    def on_hello(self, identity: bytes, hello: m.Hello) -> None:
        reject = m.check_hello(hello)
        if reject is not None:
            log.error("peer_rejected", peer=hello.peer_id, reason=reject.reason)
            self.links.send_raw(identity, reject)
            return
        newest = self.core.view.newest
        if hello.role is m.Role.LEARNER and hello.learner_version is not None and hello.learner_version > newest:
            # Its checkpoint holds steps this broker never saw published: training on would fork the run.
            reason = (
                f"the learner's checkpoint is at version {hello.learner_version}, this broker's newest is {newest}: "
                "resume the broker from its journal, or start the learner without that checkpoint"
            )
            log.error("peer_rejected", peer=hello.peer_id, reason=reason)
            self.links.send_raw(identity, m.Reject(reason=reason, wire_version=m.WIRE_VERSION))
            return
        self.count_false_death(identity, hello)
        old = self.peers.get(identity)
        if old is not None and old.role is hello.role and old.name == hello.peer_id:
            self.counters["hello repeated"] += 1  # identities are per session: a copy, or its Welcome was lost
            self.links.send(old, self.welcome())
            return
        if old is not None:
            self.peer_lost(old, "hello again")
        peer = Peer(identity=identity, role=hello.role, name=hello.peer_id, process=(hello.host, hello.pid),
                    relay=hello.weights_endpoint)  # fmt: skip
        self.peers[identity] = peer
        self.relays.changed()
        timeout = self.cfg.broker.learner_timeout_s if hello.role is m.Role.LEARNER else None
        self.liveness.joined(identity.decode(), self.clock(), timeout_s=timeout)
        self.links.send(peer, self.welcome())
        log.info(
            "peer_joined",
            peer=hello.peer_id,
            role=hello.role.value,
            pid=hello.pid,
            host=hello.host,
            slots=hello.slots,
            engine=hello.engine,
            holds=hello.holds,
        )
        if hello.role is m.Role.ROLLOUT:
            self.feed(ev.WorkerJoined(worker_id=WorkerId(identity.decode()), slots=hello.slots, elastic=hello.elastic,
                                      holds=hello.holds))  # fmt: skip
        elif hello.role is m.Role.LEARNER:
            if self.learner is not None and self.learner in self.peers:
                self.peer_lost(self.peers[self.learner], "replaced by a new learner")
            self.learner = identity

    def welcome(self) -> m.Welcome:
        b = self.cfg.broker
        return m.Welcome(broker_epoch=self.epoch, heartbeat_interval_s=b.heartbeat_interval_s, liveness=b.liveness,
                         newest_version=self.core.view.newest)  # fmt: skip

    def on_message(self, peer: Peer, msg: Any) -> None:
        w = peer.worker
        rollout, learner = peer.role is m.Role.ROLLOUT, peer.role is m.Role.LEARNER
        match msg:
            case m.Heartbeat() if rollout:
                # so the worker can tell a dead broker from an idle one, and knows the last command sent to it
                self.links.send(peer, m.Heartbeat(seen=peer.seq))
                self.liveness.progressed(w, self.clock(), msg.tokens_generated, busy=msg.running > 0)
                self.metrics.worker_counted((peer.name, *peer.process), msg.counted())
                if not self.waiting[w]:  # with commands still to go out, what it holds cannot match yet
                    reconcile(self.core, peer, msg, command=self.links.command, feed=self.feed, counters=self.counters)
                if msg.kv_use >= self.core.cfg.kv_rebalance_threshold:
                    self.feed(ev.LoadReported(worker_id=w, kv_use=msg.kv_use))
            case m.Heartbeat():
                self.links.send(peer, m.Heartbeat())
                self.liveness.progressed(w, self.clock(), 0, busy=False)
            case m.SamplesFinished() if rollout:
                self.on_samples(peer, msg)
            case m.WeightsLoaded() if rollout:
                self.feed(ev.VersionLoaded(worker_id=w, version=msg.version))
            case m.Yielded() if rollout:
                log.info("worker_yielded", worker=w)
                self.feed(ev.Lent(worker_id=w))
            case m.MigrationExported() if rollout:
                peer.migrate_out.pop((msg.group_id, msg.attempt), None)
                self.feed(
                    ev.GroupExported(
                        worker_id=w,
                        group_id=msg.group_id,
                        attempt=msg.attempt,
                        n_requests=len(msg.requests),
                        state=msg.requests,
                    )
                )
            case m.EvalFinished() if rollout:
                self.evals.finished(msg)
            case m.RequestBatch() if learner:
                self.feed(ev.BatchRequested(step=msg.step))
            case m.WeightsPublished() if learner:
                self.on_published(peer, msg)
            case m.Goodbye():
                log.info("peer_left", reason=msg.reason)
                self.peer_lost(peer, f"goodbye: {msg.reason}")
            case _:
                self.malformed[f"unexpected {type(msg).__name__} from {peer.role.value}"] += 1

    def on_samples(self, peer: Peer, msg: m.SamplesFinished) -> None:
        """Hand a message's finished samples to the core as one event; answer with one ack per sample, in order."""
        headers = msg.samples
        epoch = self.epoch
        current = (
            headers
            if all(x.broker_epoch == epoch for x in headers)
            else [x for x in headers if x.broker_epoch == epoch]
        )
        if len(current) < len(headers):
            self.counters["refused old broker epoch"] += len(headers) - len(current)
        actions = self.feed(translate.samples_event(peer.worker, msg, current)) if current else []
        if current is headers and not any(type(a) is ev.Refused for a in actions):
            self.links.send_encoded(peer, translate.all_accepted(headers))  # the common answer, encoded at once
        else:
            self.links.send(peer, m.ResultAcks(acks=translate.result_acks(headers, epoch, actions)))

    def on_published(self, peer: Peer, msg: m.WeightsPublished) -> None:
        if msg.version == self.core.view.newest and msg.version in self.weights:
            self.links.send(peer, m.PublishAck(version=msg.version))  # a repeat (the ack was lost): idempotent
            return
        batch = self.core.publishable(msg.version)
        if batch is None:
            self.counters["refused publish"] += 1
            log.warning("publish_refused", version=msg.version, newest=self.core.view.newest)
            return
        filtered = self.core.filtered_with(batch.step)  # consumed beside the batch, never trained
        if self.journal is not None:  # durable before it takes effect, and before the learner may checkpoint it
            self.journal.step(msg.version, msg.uri, msg.sha256, [g.group_id for g in batch.groups], filtered)
        self.weights[msg.version] = (msg.uri, msg.sha256)
        if msg.sources or msg.inline:
            self.carried[msg.version] = (msg.sources, msg.inline)
        tokens, rewards = batch_stats(batch.groups)
        self.trained_tokens += tokens
        self.links.send(peer, m.PublishAck(version=msg.version))  # ahead of the run's end, which says goodbye
        actions = self.feed(ev.VersionPublished(version=msg.version))
        if any(isinstance(a, ev.Refused) for a in actions):
            raise InvariantViolation(f"the core refused publish {msg.version} after the broker checked it")
        now = self.clock()
        row = step_row(self.core, msg, now - self.step_started, rewards, self.metrics.workers.totals())
        self.evals.published(msg.version, now)
        learner = {k: rounded(v) for k, v in msg.metrics.items()}
        if self.core.cfg.filter_uniform:
            self.counters["groups filtered"] += len(filtered)
            log.info("train_step", **row, learner=learner, filtered_groups=len(filtered))
        else:
            log.info("train_step", **row, learner=learner)  # the learner's own numbers, kept apart
        self.metrics.train_step(row, learner, elapsed_s=now - self.started)
        self.step_started = now

    # ------------------------------------------------------------------ the core

    def feed(self, event: ev.Event) -> list[ev.Action]:
        started, now, ready = time.perf_counter(), self.clock(), self.core.fleet_ready
        try:
            actions = self.core.handle(now, event)
        except GroupFailed as e:
            log.error("group_failed", error=str(e))
            raise
        finally:
            self.decision_s[type(event).__name__] += time.perf_counter() - started
        if self.core.fleet_ready and not ready:  # min_workers have joined and loaded: leasing starts
            log.info("fleet_ready", workers=self.core.view.worker_count())
        if self.journal is not None:  # every group id about to leave is reserved on disk first
            self.journal.reserve_through(self.core.view.dispatched)
        self.metrics.fed(now, event, actions)
        if actions:
            self.acts.extend(actions)
            for a in actions:
                if (w := getattr(a, "worker_id", None)) is not None:
                    self.waiting[w] += 1
            self.carry_out()
        return actions

    def carry_out(self) -> None:
        """Carry out up to ACTS_PER_TURN of the core's actions, oldest first. Every command goes through here, so
        commands to a worker keep the core's order; what waits is already decided, and the core's state (pins,
        leases, the journal's reservations) is what reconciliation compares a heartbeat with: a command not yet
        numbered cannot be taken for lost."""
        acts, waiting = self.acts, self.waiting
        for _ in range(min(len(acts), ACTS_PER_TURN)):
            a = acts.popleft()
            if (w := getattr(a, "worker_id", None)) is not None:
                if waiting[w] == 1:
                    del waiting[w]
                else:
                    waiting[w] -= 1
            self.act(a)

    def act(self, a: ev.Action) -> None:
        match a:
            case ev.Lease():
                if self.log_leases:
                    log.debug("group_leased", group_id=a.group_id, attempt=a.attempt, worker=a.worker_id,
                              version=a.version)  # fmt: skip
                self.links.command(a.worker_id, functools.partial(translate.generate, a, self.cfg.run, self.prompts,
                                                                  self.epoch))  # fmt: skip
            case ev.Pin():
                log.info("worker_assigned", worker=a.worker_id, version=a.version, interrupt=a.interrupt,
                         keep=list(a.keep))  # fmt: skip
                uri, sha = self.weights.get(a.version, (f"sim://v{a.version}", "0" * 64))
                sources, inline = self.carried.get(a.version, ((), {}))
                peer = self.peers.get(a.worker_id.encode())
                sources = self.relays.sources(peer.process[0] if peer else "", sources, self.rollout_relays)
                self.links.command(a.worker_id, functools.partial(m.Assign, version=a.version, uri=uri, sha256=sha,
                                                                  interrupt=a.interrupt, keep=a.keep, sources=sources,
                                                                  inline=inline))  # fmt: skip
            case ev.Lend():
                lender = self.core.view.worker(a.worker_id)
                log.info("yield_requested", worker=a.worker_id, held_groups=len(lender.leases) if lender else 0)
                self.links.command(a.worker_id, m.Yield())
            case ev.Reclaim():
                log.info("worker_resumed", worker=a.worker_id, version=a.version)
                self.links.command(a.worker_id, m.Resume(version=a.version))
            case ev.ExportGroup():
                self.links.command(
                    a.worker_id,
                    m.MigrateOut(group_id=a.group_id, attempt=a.attempt, version=a.version, target=a.target),
                )
            case ev.ImportGroup():
                moved = sum(len(r.token_ids) for r in a.state)
                log.info("migration", group_id=a.group_id, source=a.source, target=a.worker_id, version=a.version,
                         requests=a.n_requests, tokens_moved=moved)  # fmt: skip
                self.links.command(a.worker_id, translate.migrate_in(a, self.cfg.run, self.prompts))
            case ev.Revoke():
                self.links.command(a.worker_id, m.Cancel(group_id=a.group_id, attempt=a.attempt))
            case ev.DeliverBatch():
                self.deliver(a)
            case ev.Retire():
                uri, _ = self.weights.pop(a.version, ("", ""))
                self.carried.pop(a.version, None)
                removed = retire_uri(uri)
                log.info("version_retired", version=a.version, deleted=str(removed) if removed else None)
                rollout = [p for p in self.peers.values() if p.role is m.Role.ROLLOUT]
                self.links.broadcast(rollout, m.RetireVersion(version=a.version))
            case ev.Refused():
                self.counters[f"refused {a.reason}"] += 1
            case ev.RunFinished():
                log.info("run_finished", steps=a.steps, elapsed_s=round(self.clock() - self.started, 3),
                         decision_s={k: round(v, 4) for k, v in sorted(self.decision_s.items(), key=lambda kv: -kv[1])},
                         migrated_groups=self.core.view.totals().migrated_groups)  # fmt: skip
                if self.cfg.broker.exit_when_done:
                    if self.evals.open(self.clock()):  # the rounds the run asked for are reported, not lost at the end
                        self.closing_until = self.clock() + self.evals.drain_s
                        log.info("waiting_for_eval_rounds", until_s=round(self.evals.drain_s, 1))
                    else:
                        self.finish()

    def finish(self) -> None:
        """The run is over: held-out rounds still under way are reported dropped, every peer is told goodbye, the
        loop ends."""
        self.evals.abandon()
        for peer in list(self.peers.values()):
            self.links.send(peer, m.Goodbye(reason="run finished"))
        self.closing_until = None
        self.done.set()

    def deliver(self, batch: ev.DeliverBatch) -> None:
        learner = self.peers.get(self.learner) if self.learner else None
        if learner is None:
            log.warning("batch_without_learner", step=batch.step)
            return  # the core keeps it and delivers it again when a learner asks for this step
        self.links.send(learner, translate.train_batch(batch, self.prompts))

    # ------------------------------------------------------------------ peers

    def check_liveness(self, now: float) -> None:
        """Declare dead the peers silent for their window (or stalled), and send a heartbeat to each one that
        missed one: a crashed peer's connection is closed, so that send finds it unreachable and it is lost at the
        next turn, in about two heartbeat intervals instead of a whole silence window. (The broker otherwise only
        answers heartbeats, and a dead peer sends none.)"""
        for name, reason in self.liveness.expired(now):
            peer = self.peers.get(name.encode())
            if peer is not None:
                log.warning("peer_expired", peer=peer.name, reason=reason)
                self.links.send_raw(peer.identity, m.Disconnect(reason=reason))
                self.peer_lost(peer, reason)
        for name in self.liveness.quiet(now, 2 * self.cfg.broker.heartbeat_interval_s):
            peer = self.peers.get(name.encode())
            if peer is not None:
                self.links.send(peer, m.Heartbeat(seen=peer.seq) if peer.role is m.Role.ROLLOUT else m.Heartbeat())

    def count_false_death(self, identity: bytes, hello: m.Hello) -> None:
        """A process says hello again: if the broker had declared it dead, that was a false death (it was alive);
        if it is still registered under another socket identity, it judged the broker silent and reconnected (its
        engine dropped what it held): the old registration is lost now, its leases re-queued without waiting for
        its silence. Both are counted (``false deaths``, ``reconnected while registered``) and logged; at the
        default liveness neither should happen to a process that is only slow."""
        key = (hello.peer_id, hello.host, hello.pid)
        if key in self.declared_dead:
            reason, at = self.declared_dead.pop(key)
            self.counters[f"false deaths ({hello.role.value})"] += 1
            log.warning("declared_dead_but_alive", peer=hello.peer_id, role=hello.role.value, reason=reason,
                        back_after_s=round(self.clock() - at, 3))  # fmt: skip
            return
        for other in self.peers.values():
            same = other.role is hello.role and other.name == hello.peer_id and other.process == key[1:]
            if same and other.identity != identity:
                self.counters[f"reconnected while registered ({hello.role.value})"] += 1
                log.warning("peer_reconnected_while_registered", peer=hello.peer_id, role=hello.role.value)
                self.peer_lost(other, "reconnected")
                return

    def peer_lost(self, peer: Peer, reason: str) -> None:
        held = self.core.view.worker(WorkerId(peer.identity.decode()))
        log.warning("peer_lost", peer=peer.name, role=peer.role.value, reason=reason,
                    groups=[g for g, _ in held.leases] if held is not None else [])  # fmt: skip
        self.lost.append({"peer": peer.name, "role": peer.role.value, "reason": reason,
                          "uptime_s": round(self.clock() - self.started, 3)})  # fmt: skip
        self.peers.pop(peer.identity, None)
        self.relays.changed()
        self.liveness.forget(peer.identity.decode())
        self.counters[f"lost {peer.role.value}"] += 1
        if reason in ("silent", "stalled") and peer.process[1]:
            self.declared_dead[(peer.name, *peer.process)] = (reason, self.clock())
        self.metrics.peer_lost(peer.role.value, reason)
        self.evals.worker_lost(WorkerId(peer.identity.decode()))
        if peer.role is m.Role.ROLLOUT and self.core.view.has_worker(WorkerId(peer.identity.decode())):
            self.feed(ev.WorkerLost(worker_id=WorkerId(peer.identity.decode()), reason=reason))
        elif peer.role is m.Role.LEARNER and self.learner == peer.identity:
            self.learner = None
            self.feed(ev.LearnerLost(reason=reason))

    def flush(self, until: float | None = None) -> int:
        """Send what the outboxes hold, until a pipe is full (or ``until``, a ``time.perf_counter`` time); a peer
        that cannot be routed to is lost once what it sent is read (``unreachable``)."""
        return self.links.flush(self.found_unreachable, until)

    def found_unreachable(self, peer: Peer) -> None:
        if not self.unreachable:
            self.unreachable_at = self.clock()
        self.unreachable.setdefault(peer.identity, peer)

    def rollout_relays(self) -> list[tuple[str, str, str]]:
        return [(p.process[0], p.name, p.relay) for p in self.peers.values() if p.role is m.Role.ROLLOUT]

    def snapshot(self) -> dict[str, Any]:
        return snapshot(self)
