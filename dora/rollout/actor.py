"""RolloutActor: one engine replica behind a DEALER socket.

Hello -> Welcome -> Assign (load the version the broker pins it to) -> Generate / MigrateOut /
MigrateIn / Cancel, streaming every finished sample with its token ids, behaviour log-probs, version
history, reward and finish reason. Heartbeats carry a progress counter (tokens generated) so the
broker can tell a hung engine from a busy one. If the broker goes silent, refuses it, or says
Disconnect, the worker drops its work (those leases are void) and says hello again on a new socket
with a new identity, backing off 1 -> 32 s.

Lossy links: the broker numbers its commands; a command numbered at or below the highest seen is a
copy or arrived late, and is dropped unapplied (the broker's reconciliation treats it as lost). The
worker keeps every lease until all its results are acknowledged, sends unacknowledged results again
every two heartbeat intervals, and says in each heartbeat the highest number seen, the leases it
holds and its version, so the broker can mend whatever a lost message left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import structlog
import zmq
import zmq.asyncio

from dora.actor.cluster import ClusterInfo
from dora.actor.lag import watching_lag
from dora.actor.security import HINT, Keys
from dora.actor.session import PeerSession, SessionLost
from dora.config import ConfigError
from dora.config.run import RunConfig
from dora.rollout.engines.base import EngineError, WorkerEngine
from dora.rollout.offloop import EngineThread, beating
from dora.samples import FinishedSample
from dora.store.dirs import superseded
from dora.store.fetch import FetchFailed, fetch, retire_local
from dora.wire import messages as m
from dora.wire import packed

log = structlog.get_logger()


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
        cluster: ClusterInfo | None = None,
        run_finished: Callable[[int], bool] | None = None,
        weights_endpoint: str = "",
    ) -> None:
        self.cfg = cfg
        self.cluster = cluster or ClusterInfo(host=socket.gethostname())
        self.ctx = ctx
        self.endpoint = endpoint
        self.run_finished = run_finished
        """Whether the broker of this epoch has said it finished its run (its discovery file): asked when a session
        is lost, so a worker away at the goodbye still leaves. None: nothing to ask (an endpoint was given)."""
        self.name = name
        self.engine = engine
        self.clock = clock
        self.slots = cfg.rollout.credit
        self.epoch = 0
        self.interval = cfg.broker.heartbeat_interval_s
        self.link: PeerSession | None = None
        """The session with the broker, while one is open."""
        self.loading: tuple[int, float, str, str, Mapping[str, bytes]] | None = None
        """The load due: version, when, its uri, digest and files carried inline (``Assign.inline``)."""
        self.sent = 0
        self.keys = Keys.load(cfg.security.keys) if cfg.security.keys else None
        self.welcomed = False
        self.session_welcomed = False
        self.version = -1
        """The version whose weights the engine holds (-1: none yet)."""
        self.seen = 0
        """The highest command number received from the broker this session."""
        self.leases: dict[tuple[int, int], int] = {}
        """(group, attempt) -> samples of that lease not yet acknowledged by the broker."""
        self.unacked: dict[tuple[int, int, int], tuple[FinishedSample, float]] = {}
        """Results sent and not acknowledged, with when they were last sent."""
        self.dropped_commands = 0
        self.behind: tuple[int, float] | None = None
        """(the broker's last command number, when first heard) while that command has not arrived."""
        self.deferred: m.Assign | None = None
        """An Assign that waits for this worker's held-out evaluation requests to finish on the version they
        were sent for (every completion of an evaluation row comes from one version, like a trajectory's)."""
        self.eval_dropped = 0
        """Evaluate requests dropped: for a version this worker is not serving, or it cannot evaluate."""
        self.yielded = False
        """Elastic: its accelerators are the trainer's; the engine is paused (``Yield`` until ``Resume``/``Assign``)."""
        self.holds = max(1, engine.max_versions)
        """Versions the engine serves at once (a LoRA engine's adapter versions; 1: full weights)."""
        self.keep: tuple[int, ...] = ()
        """The older versions the load under way must keep beside the new one (``Assign.keep``)."""
        self.engine_thread = EngineThread()
        """Where the engine's blocking calls run: a decode step of a real engine, a full-weight load."""
        self.weights_endpoint = weights_endpoint
        """This process's chunk server (with rollout.store): what it relays this node's versions from."""
        self.sources: tuple[str, ...] = ()
        """Where the version being loaded is served (``Assign.sources``): fetched from there into rollout.store."""
        self.retired: set[int] = set()
        """Versions the broker retired that this worker's node store may still hold (removed once not in use)."""

    async def run(self, stop: asyncio.Event) -> int:
        """Serve sessions with the broker until ``stop`` is set or the run is finished; a lost one is tried again."""
        try:
            async with watching_lag():  # says why a worker fell silent, if it did
                return await self.sessions(stop)
        finally:
            self.engine_thread.close()

    async def sessions(self, stop: asyncio.Event) -> int:
        backoff = 1.0
        started = self.clock()
        while not stop.is_set():
            try:
                await self.session(stop)
                return 0
            except SessionLost as e:
                if self.welcomed and self.run_finished is not None and self.run_finished(self.epoch):
                    log.info("broker_finished", reason="its discovery file says the run is over", lost=str(e))
                    return 0
                if not self.welcomed and self.keys and self.clock() - started > self.cfg.security.auth_timeout_s:
                    log.error("broker_never_answered", reason=str(e), hint=HINT)
                    return 2
                if self.session_welcomed:  # that session worked: the broker is new, not flapping, so retry soon
                    backoff = 1.0
                log.warning("reconnecting", reason=str(e), backoff_s=backoff)
                self.engine.clear()
                self.loading = None
                self.leases.clear()
                self.unacked.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=backoff)
                backoff = min(backoff * 2, self.cfg.rollout.reconnect_max_s)
        return 0

    async def session(self, stop: asyncio.Event) -> None:
        """One session with the broker, on a new socket: hello, then turns until ``stop``, the run's end, or its loss
        (``SessionLost``)."""
        b = self.cfg.broker
        link = PeerSession(self.ctx, m.Role.ROLLOUT, self.name, cluster=self.cluster, keys=self.keys, immediate=True,
                           interval_s=b.heartbeat_interval_s, liveness=b.liveness, clock=self.clock)  # fmt: skip
        self.session_welcomed = False
        self.seen = 0
        self.behind = None
        try:  # a discovery file is read again on every session: a restarted broker may listen elsewhere
            link.connect(self.endpoint() if callable(self.endpoint) else self.endpoint)
        except (ConfigError, zmq.ZMQError) as e:
            link.close()
            raise SessionLost(f"no broker: {e}") from None
        self.link = link
        self.finished = False
        try:
            if not await link.connected(stop):
                if stop.is_set():  # stopped while waiting for a connection: no session to leave
                    return
                raise SessionLost(f"broker unreachable at {link.endpoint} (no connection in {link.silence_s:g} s)")
            self.send(link.hello(self.name, slots=self.slots, engine=self.engine.name,
                                 elastic=self.cfg.rollout.elastic, holds=self.holds,
                                 weights_endpoint=self.weights_endpoint))  # fmt: skip
            link.heard()
            while not stop.is_set() and not self.finished:
                await self.turn(link)
            if not self.finished:
                await link.goodbye("stopping")
        finally:
            link.close()
            self.link = None

    async def turn(self, link: PeerSession) -> None:
        """One turn of the session: what the broker sent, a weights load that is due, a turn of the engine, what
        finished, and a heartbeat when one is due."""
        now = self.clock()
        waits = [link.due_in(now)]
        if not self.yielded and (nxt := self.engine.next_event_s()) is not None:
            waits.append(nxt)
        if self.loading is not None:
            waits.append(self.loading[1] - now)
        for msg in await link.receive(min(waits)):
            self.on_message(msg)
        if self.finished:  # the run is over and the broker is leaving: nothing more to load or send
            return
        now = self.clock()
        if link.silent(now):
            raise SessionLost("broker silent")
        if self.loading is not None and now >= self.loading[1]:
            version, _, uri, sha, inline = self.loading
            self.loading = None
            await self.load(version, uri, sha, inline)  # the broker's messages meanwhile are read next turn
        if not self.yielded:  # a yielded worker's accelerators are the learner's, whatever its engine
            await self.advance(now)
        self.report_finished()
        if self.deferred is not None and not self.engine.evaluating():
            deferred, self.deferred = self.deferred, None
            self.on_assign(deferred, now)
        if link.beat_due(now):
            self.give_up_on_missing_commands(now, link.resend_s)
            self.resend_unacked(now, link.resend_s)
            self.send(self.heartbeat())

    async def advance(self, now: float) -> None:
        """One turn of the engine. An engine that offers its step apart (``begin_step`` returns it: torch, vLLM)
        steps on the engine's thread while this loop goes on heartbeating (``dora.rollout.offloop``); the broker's
        commands that come meanwhile are read after it. Any other engine (sim, a custom one) advances in
        ``begin_step``, on the loop."""
        step, seqs = self.engine.begin_step(now), []
        if step is not None:
            beat = self.heartbeat()  # what the engine holds now; nothing changes that until the step is done
            seqs = await beating(self.engine_thread.call(step), self.interval, lambda: self.send(beat))
        self.engine.end_step(seqs)

    async def load(self, version: int, uri: str, sha: str, inline: Mapping[str, bytes] = {}) -> None:
        """Load ``version``'s weights and tell the broker. Full weights load on the engine's thread while this loop
        goes on heartbeating: a model of several GB takes seconds to read and copy, past the broker's silence window,
        and a worker loading is slow, not dead. Nothing else touches the engine meanwhile: the loop neither steps it
        nor reads the broker's commands until the load is done, and each heartbeat says again what the engine held
        when the load began. Adapters taken beside running requests (``keep``: megabytes) load here, between two
        decode steps."""
        started = time.perf_counter()
        try:
            if self.cfg.rollout.store and not uri.startswith("sim://") and not inline:  # a LoRA version came whole
                uri = await self.fetched(version, sha)
            if self.keep:  # a multi-version engine: requests of these go on beside the new version
                self.engine.loaded(version, uri, sha, keep=frozenset(self.keep), inline=inline)
            else:
                beat = dataclasses.replace(self.heartbeat(), loading=version)
                job = self.engine_thread.call(self.engine.loaded, version, uri, sha, frozenset(), inline)
                await beating(job, self.interval, lambda: self.send(beat))
            self.version = version
            log.info("weights_loaded", version=version, uri=uri, inline=bool(inline),
                     took_s=round(time.perf_counter() - started, 4))  # fmt: skip
        except EngineError as e:
            newer = None if self.cfg.rollout.store else superseded(uri)
            if newer is not None:  # retired since this order: the newer one is on its way
                log.warning("weights_superseded", version=version, newer=newer.name, error=str(e))
                return
            log.error("weights_refused", version=version, error=str(e))  # bad weights: let the broker re-plan
            raise SessionLost(f"could not load v{version}") from None
        self.send(m.WeightsLoaded(version=version, load_s=self.engine.load_seconds()))
        self.drop_retired()

    def drop_retired(self) -> None:
        """Remove from the node store (rollout.store) the retired versions this worker neither holds nor loads."""
        busy = {*self.engine.held_versions(), *(self.loading or (-1,))[:1]}
        for v in sorted(self.retired - busy):
            self.retired.discard(v)
            if retire_local(self.cfg.rollout.store, v):
                log.info("weights_retired_local", version=v)

    async def fetched(self, version: int, sha: str) -> str:
        """The uri of ``version`` in this node's store (rollout.store), fetched over the weights' data plane unless a
        worker of this node has it there already; the learner's store is never read. Heartbeats go on meanwhile."""
        if not self.sources:
            raise EngineError(f"v{version}: rollout.store is set but its Assign names no data-plane source (the "
                              "learner serves none)")  # fmt: skip
        beat = dataclasses.replace(self.heartbeat(), loading=version)
        job = asyncio.ensure_future(asyncio.to_thread(fetch, version, sha, self.sources, self.cfg.rollout.store,
                                                      timeout_s=self.cfg.rollout.fetch_timeout_s))  # fmt: skip
        try:
            got = await beating(job, self.interval, lambda: self.send(beat))
        except (FetchFailed, OSError, ValueError) as e:
            raise EngineError(f"v{version}: {e}") from None
        return f"file://{got.path}"

    def on_message(self, msg: Any) -> None:
        """Act on one message of the broker's: the session's own here, a lease's or the engine's in ``on_command``."""
        now = self.clock()
        seq = getattr(msg, "seq", 0)
        if seq:
            if seq <= self.seen:  # a copy, or overtaken by a later command: as good as lost
                self.dropped_commands += 1
                log.debug("command_out_of_order", kind=type(msg).__name__, seq=seq, seen=self.seen)
                return
            self.seen = seq
        match msg:
            case m.Welcome():
                self.welcomed = self.session_welcomed = True
                self.epoch = msg.broker_epoch
                log.info("registered", broker_epoch=msg.broker_epoch, newest_version=msg.newest_version)
            case m.Reject():
                log.error("rejected_by_broker", reason=msg.reason)
                raise SessionLost(f"rejected: {msg.reason}")
            case m.Disconnect():
                raise SessionLost(f"disconnected: {msg.reason}")
            case m.Goodbye():
                log.info("broker_finished", reason=msg.reason)
                self.finished = True
            case m.ResultAcks():
                for ack in msg.acks:
                    self.acked(ack)
            case m.Heartbeat() if msg.seen > self.seen and self.behind is None:
                self.behind = (msg.seen, now)
            case m.RetireVersion() if self.cfg.rollout.store:
                self.retired.add(msg.version)
                self.drop_retired()
            case m.RetireVersion() | m.Heartbeat():
                pass
            case _:
                self.on_command(msg, now)

    def on_command(self, msg: Any, now: float) -> None:
        """A command about the weights, the accelerators, a lease or a held-out row."""
        match msg:
            case m.Assign():
                self.wake(now)
                self.on_assign(msg, now)
            case m.Yield():
                self.engine.advance(now)
                self.report_finished()  # what finished before the yield goes out first
                self.engine.paused = True  # an engine that can sleep gives the accelerator's memory back here
                self.yielded = True
                log.info("yielded", version=self.version, release_s=round(self.clock() - now, 3),
                         asleep=self.engine.asleep)  # fmt: skip
                self.send(m.Yielded())
            case m.Resume() if msg.version == self.version:
                self.wake(now)
                self.send(m.WeightsLoaded(version=msg.version, load_s=0.0))
            case m.Resume():
                log.error("resume_of_another_version", version=msg.version, serving=self.version)
            case m.Generate() | m.MigrateIn() if not self.takes(msg):
                pass
            case m.Generate():
                self.epoch = msg.broker_epoch  # the lease's epoch (a lost Welcome does not leave results untagged)
                self.leases[(msg.group_id, msg.attempt)] = msg.n_samples
                self.engine.submit(msg, now)
            case m.MigrateIn():
                self.leases[(msg.group_id, msg.attempt)] = len(msg.requests)
                self.engine.import_(msg, now)
            case m.Evaluate() if msg.version == self.version and self.loading is None and self.deferred is None:
                self.eval_dropped += not self.engine.evaluate(msg, now)
            case m.Evaluate():
                self.eval_dropped += 1
            case m.MigrateOut() if (msg.group_id, msg.attempt) in self.leases:
                requests = self.engine.export(msg.group_id, msg.attempt, now)
                self.report_finished()  # samples that finished before the export are reported first
                self.settle((msg.group_id, msg.attempt), len(requests))
                self.send(m.MigrationExported(group_id=msg.group_id, attempt=msg.attempt, requests=tuple(requests)))
            case m.MigrateOut():
                pass  # not held (its lease was lost): the broker learns that from the next heartbeat
            case m.Cancel():
                self.engine.cancel(msg.group_id, msg.attempt, now)
                self.leases.pop((msg.group_id, msg.attempt), None)
                for key in [k for k in self.unacked if k[:2] == (msg.group_id, msg.attempt)]:
                    del self.unacked[key]
            case _:
                log.warning("unexpected_message", kind=type(msg).__name__)

    def wake(self, now: float) -> None:
        """Take the accelerators back after a yield (the engine's clock restarts now: no progress meanwhile)."""
        if self.yielded:
            self.engine.advance(now)  # paused: moves its clock only
            self.engine.paused = False
            self.yielded = False
            log.info("resumed", version=self.version, wake_s=round(self.clock() - now, 3))

    def on_assign(self, msg: m.Assign, now: float) -> None:
        if self.loading is not None and self.loading[0] == msg.version:
            return  # a repeat while loading it
        if msg.version == self.version and self.loading is None and not msg.interrupt:
            self.deferred = None
            self.send(m.WeightsLoaded(version=msg.version, load_s=0.0))  # a repeat: its answer was lost
            return
        if self.engine.evaluating():
            if not msg.interrupt:
                self.deferred = msg  # loaded once the evaluation requests of the current version are done
                return
            self.engine.drop_evaluations()  # the broker asks some worker again
        self.deferred = None
        if self.engine.busy() and not msg.interrupt and self.holds == 1:
            log.error("assign_refused_requests_running", version=msg.version)
            return
        self.engine.advance(now)
        self.keep = msg.keep if self.holds > 1 else ()
        self.sources = msg.sources
        self.loading = (msg.version, now + self.engine.load_seconds(), msg.uri, msg.sha256, msg.inline)
        structlog.contextvars.bind_contextvars(version=msg.version)

    def takes(self, msg: m.Generate | m.MigrateIn) -> bool:
        """Whether to run a lease's work: never on weights other than its version's (C1), never twice. A
        multi-version engine runs it under the version it names, if it holds that one."""
        held = self.engine.held_versions()
        if msg.version not in held:
            log.warning("lease_for_another_version", group_id=msg.group_id, version=msg.version, serving=self.version,
                        held=sorted(held))  # fmt: skip
            return False
        return (msg.group_id, msg.attempt) not in self.leases

    def give_up_on_missing_commands(self, now: float, resend_s: float) -> None:
        """The broker sent commands that have not come within ``resend_s``: count them as lost, so the next
        heartbeat says so and the broker mends what they carried (a late copy is then dropped unapplied)."""
        if self.behind is None:
            return
        last, since = self.behind
        if self.seen >= last:
            self.behind = None
        elif now - since >= resend_s:
            log.warning("commands_lost", seen=self.seen, broker_sent=last)
            self.seen, self.behind = last, None

    def settle(self, lease: tuple[int, int], n: int) -> None:
        """``n`` samples of a lease are off this worker's hands; the lease ends with its last one."""
        if lease in self.leases:
            self.leases[lease] -= n
            if self.leases[lease] <= 0:
                del self.leases[lease]

    def acked(self, ack: m.ResultAck) -> None:
        if self.unacked.pop((ack.group_id, ack.attempt, ack.index), None) is not None:
            self.settle((ack.group_id, ack.attempt), 1)

    def heartbeat(self) -> m.Heartbeat:
        """What the worker holds and does now, and its engine's cumulative counters (left out when it has none)."""
        running, kv = self.engine.load()
        counters = self.engine.counters()
        return m.Heartbeat(
            tokens_generated=self.engine.tokens_generated, running=0 if self.yielded else running, kv_use=kv,
            seen=self.seen, yielded=self.yielded,
            holding=np.array(sorted(self.leases), dtype=np.int64).reshape(-1, 2), version=self.version,
            loading=self.loading[0] if self.loading is not None else self.deferred.version if self.deferred else -1,
            counters=counters if counters else m.UNSET,
        )  # fmt: skip

    def report_finished(self) -> None:
        """Stream what finished since the last report: one message, however many samples; then the held-out
        rows evaluated (unnumbered, not kept: the broker asks again if one is lost)."""
        for evaluated in self.engine.take_evaluated():
            self.send(evaluated)
        now = self.clock()
        results = []
        for r in self.engine.take_finished():
            result = self.engine.result(r, self.epoch)
            self.unacked[(result.group_id, result.attempt, result.index)] = (result, now)
            results.append(result)
        self.send_results(results)

    def resend_unacked(self, now: float, resend_s: float) -> None:
        """Results whose acknowledgement has not come within ``resend_s``: one of the two was lost."""
        due = [key for key, (_, at) in self.unacked.items() if now - at >= resend_s][:256]
        for key in due:
            self.unacked[key] = (self.unacked[key][0], now)
        self.send_results([self.unacked[key][0] for key in due])

    def send_results(self, results: list[FinishedSample]) -> None:
        if results:
            self.send(packed.pack_samples(results))

    def send(self, msg: Any) -> None:
        """Send on the session now; with no connection to take it, the session is lost (``SessionLost``)."""
        assert self.link is not None
        self.link.send(msg)
        self.sent += 1
