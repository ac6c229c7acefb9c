"""LearnerActor: the learner's side of the protocol (rank 0), the same for every trainer.

It asks the broker for batch ``u``, checks every batch invariant on its own (``dora.learner.checks``),
hands the batch to its trainer (``dora.learner.trainers``: the sim trainer, which waits the trainer
model's time, or the torch trainer, GRPO over FSDP2 ranks), publishes version ``u + 1`` and commits
the step once the broker has journalled it. An audit file gets one JSON line per committed step with
the groups it trained, so a run can be proven to train every group exactly once; a learner that resumes
behind the broker and takes the newer versions' weights from the store writes an ``adopted`` line for each
step it took so (a learner killed after the broker's record and before its own leaves such a step). A broken invariant
stops it with exit 3. Blocking trainer work runs in a thread while this loop keeps heartbeating.

Stopping (the torch trainer checkpoints on the way out; correctness never depends on it):
- ``drain`` (SIGUSR1, e.g. Slurm's ``--signal=B:USR1@120`` forwarded by the batch script): finish the step
  in flight, wait for the broker to record it, checkpoint, say goodbye and exit 0.
- ``stop`` (SIGTERM): leave now; a step in flight is not published (the broker holds its batch for the
  next learner). Before exiting, the newest committed version is checkpointed if it is not yet and the
  weights are still that version's (``learner.checkpoint_on_stop``).
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable
from statistics import fmean
from typing import Any, TextIO

import structlog
import zmq.asyncio

from dora.actor.cluster import ClusterInfo
from dora.actor.lag import watching_lag
from dora.actor.security import HINT, Keys
from dora.actor.session import PeerSession
from dora.config import ConfigError
from dora.config.run import RunConfig
from dora.learner.checks import InvariantBroken, check_batch
from dora.learner.trainers import Trainer
from dora.learner.writing import BackgroundWrite, WriteFailed
from dora.samples import Batch
from dora.wire import messages as m
from dora.wire import packed

log = structlog.get_logger()

WRITE_POLL_S = 0.02
"""How often the loop looks at a write in flight while it waits for messages (its version is announced at once)."""


def _key(msg: Any) -> Any:
    """What an awaited request is known by: its kind, and a publish by its version too (two may be awaited)."""
    return (msg.KIND, msg.version) if isinstance(msg, m.WeightsPublished) else msg.KIND


class LearnerActor:
    def __init__(
        self,
        cfg: RunConfig,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        *,
        audit: TextIO | None = None,
        clock: Callable[[], float] = time.monotonic,
        trainer: Trainer,
        resumed: dict[str, Any] | None = None,
        discover: Callable[[], str] | None = None,
        cluster: ClusterInfo | None = None,
        sources: tuple[str, ...] = (),
    ) -> None:
        self.cfg = cfg
        self.sources = sources
        """Data-plane endpoints that serve the published versions' files (named in every ``WeightsPublished``)."""
        self.cluster = cluster or ClusterInfo(host=socket.gethostname())
        self.ctx = ctx
        self.endpoint = endpoint
        self.discover = discover
        """Where to look for the broker's endpoint again when it falls silent (its discovery file)."""
        self.audit = audit
        self.clock = clock
        self.trainer = trainer
        """The sim trainer (sleeps the trainer model's time), or the torch trainer (train + publish, checkpoints)."""
        self.version = resumed["version"] if resumed else 0
        """The version the trainer's weights hold (a checkpoint's, when resumed)."""
        self.trained: set[int] = set(resumed["trained_groups"]) if resumed else set()
        """Every group trained so far, checkpointed with the weights: a group in it is never trained again."""
        self.committed = self.version
        """The newest version the broker has acknowledged (recorded in its journal)."""
        self.checkpointed = self.version
        """The version of the newest checkpoint (the one resumed from; 0 stands for the model folder)."""
        self.weights_ahead = False
        """A step was trained and not published (cut short by a stop): the weights are past ``version``."""
        self.writing: BackgroundWrite | None = None
        """The version being written in the background (``learner.overlap_publish``), announced once durable."""
        self.requested: int | None = None
        """The step whose batch was asked for and has not come."""
        self.drain = asyncio.Event()
        """Set: leave at the next step boundary (after checkpointing). ``run`` may be handed its own."""
        self.unacked: list[tuple[int, Batch, dict[str, Any]]] = []
        """The versions announced and not yet acknowledged, oldest first: (version, batch, facts). Two at most: a
        version written in the background is announced during the next step, whose own is announced at its end,
        possibly before the first one's acknowledgement is read."""
        self.link: PeerSession | None = None
        """The session with the broker, while the learner serves."""
        self.welcomed = False
        """The broker has welcomed this learner once."""
        self.joining = True
        """A Hello is out and its Welcome not in: the learner (re)joins the run at the broker's newest version."""
        self.awaiting: dict[Any, tuple[float, Any]] = {}
        """The requests whose answers are awaited (a Hello, a RequestBatch, each WeightsPublished) and when each was
        sent: sent again every two heartbeat intervals until answered, since either message may be lost."""

    async def _request(self, msg: Any) -> None:
        """Send a request that expects an answer, and keep it for sending again."""
        self.awaiting[_key(msg)] = (self.clock(), msg)
        await self._offer(msg)

    async def _offer(self, msg: Any) -> None:
        """Send ``msg``, skipped if it cannot leave within a heartbeat interval: with no connection up (a broker gone,
        a refused handshake) a send would wait, and the loop must keep its deadlines. Each is sent again."""
        assert self.link is not None
        await self.link.send_within(msg, self.cfg.broker.heartbeat_interval_s)

    def _rediscover(self) -> str:
        if self.discover is None:
            return self.endpoint
        try:
            return self.discover()
        except ConfigError:  # the discovery file is being replaced by a starting broker: try again later
            return self.endpoint

    def _hello(self) -> m.Hello:
        assert self.link is not None
        return self.link.hello("learner-0", learner_version=self.committed if self.trainer.keeps_weights else None)

    async def run(self, stop: asyncio.Event, drain: asyncio.Event | None = None) -> int:
        """Serve until the run ends, ``stop`` is set (leave now) or ``drain`` is (leave at the next step boundary)."""
        self.drain = drain or self.drain
        async with watching_lag():  # says why the learner fell silent, if it did
            return await self.serve(stop)

    async def serve(self, stop: asyncio.Event) -> int:
        """The learner's one session with the broker, greeted anew whenever it falls silent; the exit code."""
        b = self.cfg.broker
        keys = Keys.load(self.cfg.security.keys) if self.cfg.security.keys else None
        link = PeerSession(self.ctx, m.Role.LEARNER, self.cluster.host, cluster=self.cluster, keys=keys,
                           interval_s=b.heartbeat_interval_s, liveness=b.liveness, clock=self.clock)  # fmt: skip
        self.link = link
        link.connect(self.endpoint)
        started, self.welcomed = self.clock(), False
        try:
            try:  # a send waits until a connection is up, which a refused CURVE handshake never lets happen
                async with asyncio.timeout(self.cfg.security.auth_timeout_s):
                    await self._request(self._hello())
            except TimeoutError:
                log.error("broker_never_answered", endpoint=self.endpoint, hint=HINT if keys else "")
                return 1
            self.joining = True
            link.heard()
            while not stop.is_set():
                idle = not self.unacked and self.writing is None
                if self.drain.is_set() and idle and self.welcomed:  # no step in flight: leave now
                    await self.leave(stop, "drained")
                    return 0
                if not self.welcomed and self.clock() - started > self.cfg.security.auth_timeout_s:
                    log.error("broker_never_answered", endpoint=self.endpoint, hint=HINT if keys else "")
                    return 1
                due = link.due_in(self.clock())
                messages = await link.receive(min(due, WRITE_POLL_S) if self.writing is not None else due)
                if not messages and link.silent(self.clock()):  # judged silent only once what came is read
                    await self.find_broker_again()
                for msg in messages:
                    if (code := await self.on_message(msg, stop)) is not None:
                        return code
                await self._announce_written(stop)
                if link.beat_due(self.clock()):
                    await self._offer(m.Heartbeat())
                    for sent, msg in list(self.awaiting.values()):
                        if self.clock() - sent >= link.resend_s:
                            await self._request(msg)  # no answer yet: the request or it was lost
            # stopped (SIGTERM): tell the broker, which holds the batch for the next learner
            await self.leave(stop, "stopping")
            return 0
        except InvariantBroken as e:
            log.error("invariant_broken", error=str(e))
            return 3
        except packed.CorruptBatch as e:  # nothing of it is trained: the payload is not what the worker sent
            log.error("batch_corrupt", step=e.step, group_id=e.group_id, index=e.index, error=str(e))
            return 3
        except WriteFailed as e:
            log.error("publish_failed", error=str(e))
            return 1
        finally:
            link.close()  # with no linger, unless a Goodbye was just sent
            self.link = None

    async def find_broker_again(self) -> None:
        """The broker fell silent: look for it where its discovery file says it is now, and greet it anew."""
        assert self.link is not None
        self.link.heard()
        endpoint = self._rediscover()
        self.link.connect(endpoint)
        log.warning("broker_silent", endpoint=endpoint, version=self.version, committed=self.committed)
        self.endpoint, self.joining = endpoint, True
        await self._request(self._hello())

    async def on_message(self, msg: Any, stop: asyncio.Event) -> int | None:
        """Act on one message of the broker's; the exit code when the learner leaves on it."""
        assert self.link is not None
        match msg:
            case m.Welcome() if self.joining:  # joining a run in progress: pick it up at the newest version
                self.joining, self.welcomed, self.awaiting, self.requested = False, True, {}, None
                if not await self.catch_up(msg.newest_version, stop):
                    return 1
                log.info("registered", broker_epoch=msg.broker_epoch, version=self.version)
                if await self.after_commit(stop):
                    return 0
            case m.TrainBatch() if not self.joining:
                if msg.step != self.version or self.requested != msg.step or self.drain.is_set():
                    # a copy of a batch already trained (re-sent on a rejoin), or one asked for before a drain
                    # (the broker holds it for the next learner)
                    log.warning("batch_ignored", step=msg.step, version=self.version, draining=self.drain.is_set())
                    return None
                self.awaiting.pop(m.RequestBatch.KIND, None)  # ``requested`` stays this step's while it trains
                await self.train(packed.unpack_batch(msg), stop)
                self.link.heard()  # what came meanwhile is still queued: read it before judging
            case m.PublishAck() if any(v == msg.version for v, _, _ in self.unacked):
                while self.unacked and self.unacked[0][0] <= msg.version:
                    await self.commit(stop)
                if await self.after_commit(stop):
                    return 0
            case m.Goodbye():
                while self.unacked:  # the run ends only once the last publish is in
                    await self.commit(stop)
                return 0
            case m.Reject():
                log.error("learner_turned_away", reason=msg.reason)
                return 1
            case m.Disconnect() if not self.joining:  # e.g. a restarted broker that does not know us yet
                log.warning("rejoining", reason=msg.reason, version=self.version, committed=self.committed)
                self.joining = True
                await self._request(self._hello())
            case _:  # heartbeats, and anything that came for a step or a session already left
                pass
        return None

    async def after_commit(self, stop: asyncio.Event) -> bool:
        """Ask for the next batch; True when the learner leaves: the run's steps are all trained, or a drain
        was asked for (this is the step boundary it waits for)."""
        total = self.cfg.core.total_steps
        if total is not None and self.committed >= total:
            log.info("learner_done", version=self.version)
            assert self.link is not None
            await self.link.goodbye("done")
            return True
        if self.drain.is_set():
            if self.writing is None and not self.unacked:
                await self.leave(stop, "drained")
                return True
            return False  # the version in flight is written and recorded first
        await self._ask()
        return False

    async def _ask(self) -> None:
        """Ask for the batch of the step after the weights held, unless it is asked for already, the run has no
        such step, or it must wait: while the version held is still being written, only if it may go early."""
        step, total = self.version, self.cfg.core.total_steps
        if self.requested == step or (total is not None and step >= total) or self.drain.is_set():
            return
        if self.writing is not None and not self._early_ok(step):
            return
        self.requested = step
        await self._request(m.RequestBatch(step=step))

    def _early_ok(self, version: int) -> bool:
        """Whether batch ``version`` may be asked for while version ``version`` is still being written: not for a
        version to be checkpointed (its commit must find the weights still at it, before the next step trains)."""
        lc = self.cfg.learner
        due = self.trainer.keeps_weights and lc.checkpoint_dir and version % lc.checkpoint_every == 0
        return lc.overlap_publish and not due

    async def leave(self, stop: asyncio.Event, reason: str) -> None:
        """Checkpoint the newest committed version if it is not yet (and the weights are still it), then
        say goodbye: the broker holds any batch for the next learner."""
        lc = self.cfg.learner
        clean = not self.weights_ahead and not self.unacked and self.writing is None and self.committed == self.version
        wanted = reason == "drained" or lc.checkpoint_on_stop
        if self.trainer.keeps_weights and lc.checkpoint_dir and wanted and clean and self.committed > self.checkpointed:
            await self.save_checkpoint(stop, reason)
        assert self.link is not None
        await self.link.goodbye(reason)
        log.info("learner_stopped", reason=reason, version=self.version, checkpointed=self.checkpointed)

    async def save_checkpoint(self, stop: asyncio.Event, reason: str) -> None:
        """Checkpoint the committed version (weights, optimizer, RNG, trained groups), heartbeating meanwhile."""
        started = self.clock()
        await self._busy(stop, self.trainer.checkpoint, self.committed, sorted(self.trained))
        self.checkpointed = self.committed
        log.info("checkpoint_saved", version=self.committed, reason=reason, groups=len(self.trained),
                 seconds=round(self.clock() - started, 3))  # fmt: skip

    async def catch_up(self, newest: int, stop: asyncio.Event) -> bool:
        """Bring the learner to the broker's newest version; False if that cannot be done."""
        await self._finish_write(stop, announce=False)
        self.writing = None  # durable, never announced: published again by the step that makes it next
        while self.unacked and self.unacked[0][0] <= newest:  # the broker took the publish before its ack was lost
            await self.commit(stop)
        if self.unacked or self.version > max(newest, self.committed):  # past what the broker recorded: undo
            await self.roll_back(stop)
        if not self.trainer.keeps_weights or newest == self.version:
            self.version = self.committed = newest
            return True
        if newest < self.version:  # the broker turns such a learner away; never train on from the wrong weights
            log.error("learner_ahead_of_broker", version=self.version, broker_version=newest)
            return False
        # Versions the learner published after its last checkpoint (or all of them, for a fresh learner):
        # the store holds the newest one whole; the optimizer moments stay those of the checkpoint.
        await self._busy(stop, self.trainer.adopt, newest)
        log.warning("weights_from_store", version=newest, optimizer_state_version=self.version)
        if self.audit is not None:  # steps this learner holds without having trained them here (see dora audit)
            self.audit.writelines(json.dumps({"step": s, "adopted": True, "version": s + 1}) + "\n"
                                  for s in range(self.version, newest))  # fmt: skip
            self.audit.flush()
        self.version = self.committed = newest
        return True

    async def roll_back(self, stop: asyncio.Event) -> None:
        """Forget the steps whose publish the broker never recorded: their groups will be trained again."""
        steps = [batch.step for _, batch, _ in self.unacked]
        self.unacked = []
        self.version = self.committed
        if self.trainer.keeps_weights:  # the weights and optimizer of the newest checkpoint, then the store's
            resumed = await self._busy(stop, self.trainer.restore)
            self.version = resumed["version"] if resumed else 0
        self.weights_ahead = False
        log.warning("step_rolled_back", steps=steps, version=self.version)

    async def _busy(self, stop: asyncio.Event, fn: Any, *args: Any) -> Any:
        """Run blocking work in a thread while this loop keeps heartbeating (and announces a version whose write
        ends meanwhile); None if stopped meanwhile."""
        task = asyncio.ensure_future(asyncio.to_thread(fn, *args))
        while not task.done():
            await asyncio.wait([task, *self._write_done()], timeout=self.cfg.broker.heartbeat_interval_s,
                               return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
            await self._announce_written(stop)
            await self._offer(m.Heartbeat())
        result = task.result()
        return None if stop.is_set() else result

    def _write_done(self) -> list[asyncio.Future[Any]]:
        """The write in flight, as something to wait on beside other work (none once it is done)."""
        if self.writing is None or self.writing.done.done():
            return []
        return [asyncio.wrap_future(self.writing.done)]

    async def _finish_write(self, stop: asyncio.Event, *, announce: bool = True) -> float:
        """Wait for the write in flight, heartbeating; announce its version (unless told not to). The seconds
        waited."""
        started = self.clock()
        while self.writing is not None and not self.writing.done.done() and not stop.is_set():
            await asyncio.wait(self._write_done(), timeout=self.cfg.broker.heartbeat_interval_s)
            await self._offer(m.Heartbeat())
        if announce:
            await self._announce_written(stop)
        return self.clock() - started

    async def _announce_written(self, stop: asyncio.Event) -> None:
        """The version written in the background is durable: tell the broker (it dispatches on it from now on)."""
        w = self.writing
        if w is None or not w.done.done() or stop.is_set():
            return
        self.writing = None
        uri, sha, publish_s = w.result()
        w.metrics["publish_s"] = publish_s
        w.metrics["publish_total_s"] = time.perf_counter() - w.started + w.pending.snapshot_s
        self.unacked.append((w.version, w.batch, w.facts))
        await self._request(m.WeightsPublished(version=w.version, uri=uri, sha256=sha, publish_s=publish_s,
                                               metrics=w.metrics, sources=self.sources,
                                               inline=w.pending.inline))  # fmt: skip
        await self._ask()  # a batch that waited for this version's write

    async def train(self, batch: Batch, stop: asyncio.Event) -> None:
        """Train on the batch, copy the weights aside as the next version and start its write; then ask for the
        next batch at once (``learner.overlap_publish``, when the next version may go early), or once the write is
        announced and recorded."""
        core = self.cfg.core
        facts = check_batch(batch, step=self.version, groups=core.train_groups, group_size=core.group_size,
                            k=core.staleness, mixed_ok=core.in_flight_swap, trained=self.trained)  # fmt: skip
        started = self.clock()
        metrics = await self._busy(stop, self.trainer.train, batch)
        wait_s = await self._finish_write(stop) if metrics is not None else 0.0  # one write in flight at most
        pending = await self._busy(stop, self.trainer.snapshot, self.version + 1) if metrics is not None else None
        if metrics is None or pending is None:  # cut short: not published; the broker re-delivers the batch
            self.weights_ahead = self.trainer.keeps_weights
            return
        self.version += 1
        self.requested = None
        metrics.setdefault("reward_mean", fmean(s.reward for g in batch.groups for s in g.samples))
        metrics.setdefault("tokens", float(facts["tokens"]))
        metrics["learner_step_s"] = self.clock() - started
        metrics["snapshot_s"] = pending.snapshot_s
        metrics["write_wait_s"] = wait_s
        self.writing = BackgroundWrite(pending, batch, facts, metrics).start()
        if not self._early_ok(self.version):
            await self._finish_write(stop)
        await self._ask()

    async def commit(self, stop: asyncio.Event) -> None:
        """The broker recorded the oldest announced version: its step is final. Audit it, then checkpoint (when
        due: such a version never went early, so the weights are still it).

        The audit line is on disk before the checkpoint starts: a learner killed between the two resumes from an
        older checkpoint and writes an ``adopted`` line for the step again (which ``dora audit`` accepts), while
        the other order could leave a checkpoint holding a step that no audit line names."""
        version, batch, facts = self.unacked.pop(0)
        self.awaiting = {k: v for k, v in self.awaiting.items() if not (isinstance(k, tuple) and k[1] <= version)}
        self.committed = version
        self.trained.update(g.group_id for g in batch.groups)
        self._audit_step(batch, facts)
        lc, core = self.cfg.learner, self.cfg.core
        if (
            self.trainer.keeps_weights
            and lc.checkpoint_dir
            and (version % lc.checkpoint_every == 0 or version == core.total_steps)
        ):
            await self.save_checkpoint(stop, "final" if version == core.total_steps else "periodic")

    def _audit_step(self, batch: Batch, facts: dict[str, Any]) -> None:
        if self.audit is not None:
            self.audit.write(
                json.dumps(
                    {
                        "step": batch.step,
                        "redelivery": batch.redelivery,
                        "groups": sorted(g.group_id for g in batch.groups),
                        "versions": sorted({g.version for g in batch.groups}),
                        "staleness": facts["staleness"],
                        "mixed": facts["mixed_version_trajectories"],
                        "turns": facts["turns"],
                    }
                )
                + "\n"
            )
            self.audit.flush()
            os.fsync(self.audit.fileno())  # a step the broker recorded survives the node's power loss in the audit
