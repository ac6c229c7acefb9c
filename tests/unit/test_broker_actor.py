"""BrokerActor over inproc:// with fake peers that speak the protocol: handshake, leases within
credit, results and batches, fencing of dead peers, rejects, and no silent drop under backpressure."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.asyncio

from dora.broker import actor as broker_actor
from dora.broker import translate
from dora.broker.actor import BrokerActor
from dora.broker.evaluation import EvalRounds
from dora.broker.main import open_router
from dora.config import load
from dora.config.run import RunConfig
from dora.core.core import Core
from dora.ids import Finish
from dora.samples import FinishedSample
from dora.wire import codec, packed
from dora.wire import messages as m

pytestmark = pytest.mark.timeout(30)
G, B = 4, 2


class Fake:
    """A peer: one DEALER with a text identity."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, name: str, **opts: int) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.setsockopt(zmq.LINGER, 0)
        for k, v in opts.items():
            self.sock.setsockopt(getattr(zmq, k), v)
        self.sock.connect(endpoint)
        self.name = name
        self.backlog: list[Any] = []

    async def send(self, msg: Any) -> None:
        if isinstance(msg, FinishedSample):  # one finished sample travels as a message of one
            msg = packed.pack_samples([msg])
        await self.sock.send_multipart(codec.encode(msg))

    async def ack(self) -> m.ResultAck:
        """The answer to a message of one finished sample."""
        (ack,) = (await self.recv(m.ResultAcks)).acks
        return ack

    async def recv(self, kind: type | tuple[type, ...] = object, timeout_s: float = 5.0) -> Any:
        """The next message of ``kind``; others are kept, in order, for a later call.

        The wait is a poll, and the read a non-blocking one that cannot be interrupted. A ``recv_multipart``
        awaited under a timeout drops the message when the timeout fires in the loop turn the message came in:
        the message is off the socket, and the task is cancelled before it resumes with it. A loaded machine makes
        such turns common (``test_a_fake_peer_loses_no_message_to_its_own_timeouts``)."""
        for i, msg in enumerate(self.backlog):
            if isinstance(msg, kind):
                return self.backlog.pop(i)
        loop = asyncio.get_running_loop()
        until = loop.time() + timeout_s
        while True:
            left_ms = int(1000 * (until - loop.time()))
            if left_ms <= 0 or not await self.sock.poll(left_ms, zmq.POLLIN):
                raise TimeoutError(f"{self.name}: no {kind} within {timeout_s} s")
            msg = codec.decode(await self.sock.recv_multipart(zmq.NOBLOCK))  # a done future: no turn to lose it in
            if isinstance(msg, kind):
                return msg
            self.backlog.append(msg)

    async def hello(self, role: m.Role, slots: int = 0, peer_id: str | None = None) -> m.Welcome:
        await self.send(m.Hello(wire_version=m.WIRE_VERSION, role=role, peer_id=peer_id or self.name,
                                pid=os.getpid(), host="test", slots=slots, engine="fake"))  # fmt: skip
        return await self.recv(m.Welcome)

    async def worker(self, slots: int, peer_id: str | None = None) -> m.Assign:
        """Join as a rollout worker and load the version the broker assigns."""
        await self.hello(m.Role.ROLLOUT, slots, peer_id)
        assign = await self.recv(m.Assign)
        await self.send(m.WeightsLoaded(version=assign.version, load_s=0.0))
        return assign


def finished(gen: m.Generate, index: int, epoch: int) -> FinishedSample:
    n = 5 + index
    return FinishedSample(group_id=gen.group_id, attempt=gen.attempt, index=index,
                          segments=np.array([[gen.version, n]], dtype=np.int32),
                          token_ids=np.arange(n, dtype=np.int32), logprobs=np.full(n, -0.5, np.float32),
                          reward=float(index % 2), finish=Finish.STOP, broker_epoch=epoch)  # fmt: skip


@asynccontextmanager
async def running_broker(*overrides: str, evals: EvalRounds | None = None
                         ) -> AsyncIterator[tuple[BrokerActor, str, zmq.asyncio.Context]]:  # fmt: skip
    cfg = load(RunConfig, overrides=[f"broker.bind=inproc://broker-{uuid.uuid4().hex}", "broker.strict=true",
                                     "broker.heartbeat_interval_s=0.05", "broker.liveness=40", "broker.tick_s=0.05",
                                     "core.mode=dora",
                                     f"core.group_size={G}", f"core.train_groups={B}", "core.max_staleness=1",
                                     "core.total_steps=100", *overrides])  # fmt: skip
    ctx = zmq.asyncio.Context()
    sock, endpoint = open_router(ctx, cfg)
    actor = BrokerActor(cfg, sock, Core(cfg.core, strict=True), lambda g: np.arange(3, dtype=np.int32) + g, epoch=7,
                        evals=evals)  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(actor.run(stop))
    try:
        yield actor, endpoint, ctx
    finally:
        stop.set()
        await task  # re-raises anything the actor crashed with
        ctx.destroy(linger=0)


async def test_a_fake_peer_loses_no_message_to_its_own_timeouts():
    """The tests' peer waits in short timeouts (``leased_again``: 0.05 s). On a loaded machine a loop turn is long,
    and a message and the timeout often land in one: a ``recv_multipart`` awaited under ``asyncio.timeout`` then
    took the message off the socket and lost it, and a re-leased group never reached the worker (the liveness tests'
    5 s failures). Here each turn of the loop is held 3 ms, and the peer waits 4 ms at a time."""
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    endpoint = f"inproc://fake-{uuid.uuid4().hex}"
    router.bind(endpoint)
    peer = Fake(ctx, endpoint, "rollout/p/1")
    n, got, timeouts = 150, 0, 0

    async def hold() -> None:
        while True:
            time.sleep(0.003)
            await asyncio.sleep(0)

    async def send() -> None:
        for _ in range(n):
            await asyncio.sleep(0.004)
            await router.send_multipart([peer.name.encode(), *codec.encode(m.Heartbeat())])

    try:
        await peer.send(m.Heartbeat())
        await router.recv_multipart()  # the router knows the peer now
        holder, sender = asyncio.create_task(hold()), asyncio.create_task(send())
        async with asyncio.timeout(10):
            while got < n:
                try:
                    await peer.recv(m.Heartbeat, timeout_s=0.004)
                    got += 1
                except TimeoutError:
                    timeouts += 1
        await sender
        holder.cancel()
        assert got == n and timeouts > 0, (got, timeouts)  # the timeouts did fire, and every message arrived
    finally:
        ctx.destroy(linger=0)


async def test_worker_is_pinned_and_never_leased_beyond_its_credit():
    async with running_broker() as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        assign = await w.worker(slots=2 * G + 1)
        assert assign.version == 0
        gens = [await w.recv(m.Generate) for _ in range(2)]
        assert all(g.version == 0 and g.n_samples == G and g.broker_epoch == 7 for g in gens)
        with pytest.raises(TimeoutError):  # 9 slots hold two groups of 4, not three
            await w.recv(m.Generate, timeout_s=0.3)
        snap = actor.snapshot()
        assert snap["workers"]["rollout/a/1"]["used"] == 2 * G <= snap["workers"]["rollout/a/1"]["slots"]


async def test_results_are_acked_and_whole_groups_reach_the_learner():
    async with running_broker() as (_actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        await w.worker(slots=2 * G)
        learner = Fake(ctx, ep, "learner/x")
        await learner.hello(m.Role.LEARNER)
        await learner.send(m.RequestBatch(step=0))
        seen: set[int] = set()
        while len(seen) < B:
            gen = await w.recv(m.Generate)
            for i in range(G):
                await w.send(finished(gen, i, epoch=7))
                ack = await w.ack()
                assert ack.accepted and (ack.group_id, ack.index) == (gen.group_id, i)
            seen.add(gen.group_id)
        batch = packed.unpack_batch(await learner.recv(m.TrainBatch))
        assert batch.step == 0 and len(batch.groups) == B
        for g in batch.groups:
            assert g.version == 0 and sorted(s.index for s in g.samples) == list(range(G))
            assert all(np.array_equal(s.token_ids, np.arange(5 + s.index)) for s in g.samples)
            assert np.array_equal(g.prompt_ids, np.arange(3) + g.group_id)


async def test_duplicate_and_foreign_results_are_refused():
    async with running_broker() as (actor, ep, ctx):
        a, b = Fake(ctx, ep, "rollout/a/1"), Fake(ctx, ep, "rollout/b/1")
        await a.worker(slots=G)
        await b.worker(slots=G)
        gen = await a.recv(m.Generate)
        await a.send(finished(gen, 0, epoch=7))
        assert (await a.ack()).accepted
        await a.send(finished(gen, 0, epoch=7))  # the same sample again
        dup = await a.ack()
        assert not dup.accepted and "duplicate" in dup.reason
        await b.send(finished(gen, 1, epoch=7))  # a sample of a group it does not hold
        foreign = await b.ack()
        assert not foreign.accepted and foreign.reason in ("not_holder", "stale_attempt")
        await a.send(finished(gen, 1, epoch=6))  # from an earlier broker
        old = await a.ack()
        assert not old.accepted and "epoch" in old.reason
        assert actor.counters["refused old broker epoch"] == 1


async def leased_again(b: Fake, gen: m.Generate, timeout_s: float = 5.0) -> m.Generate:
    """Worker ``b`` heartbeats and finishes its own groups until ``gen``'s group is leased to it again."""
    async with asyncio.timeout(timeout_s):
        while True:
            await b.send(m.Heartbeat(tokens_generated=0, running=0, kv_use=0.0))
            try:
                got = await b.recv(m.Generate, timeout_s=0.05)
            except TimeoutError:
                continue
            if got.group_id == gen.group_id:
                return got
            for i in range(G):  # its own fresh group: finish it to free the slots
                await b.send(finished(got, i, epoch=7))


async def test_a_silent_worker_is_dropped_its_group_re_leased_and_its_late_results_refused():
    async with running_broker("broker.liveness=3") as (actor, ep, ctx):
        a = Fake(ctx, ep, "rollout/a/1")
        await a.worker(slots=G)
        gen = await a.recv(m.Generate)
        b = Fake(ctx, ep, "rollout/b/1")
        await b.worker(slots=G)
        again = await leased_again(b, gen)  # a says nothing: it dies after 3 x 0.05 s
        assert again.group_id == gen.group_id and again.attempt != gen.attempt
        assert isinstance(await a.recv((m.Disconnect,)), m.Disconnect)
        await a.send(finished(gen, 0, epoch=7))  # late: a is no longer a peer
        assert isinstance(await a.recv(m.Disconnect), m.Disconnect)
        await asyncio.sleep(0.05)
        assert actor.counters["refused result from an unregistered peer"] == 1
        assert actor.snapshot()["requeued_groups"] >= 1


async def test_a_worker_whose_connection_closed_is_lost_as_unreachable_long_before_its_silence_window():
    async with running_broker("broker.liveness=200") as (actor, ep, ctx):  # silent for 10 s before it is dead
        a = Fake(ctx, ep, "rollout/a/1")
        await a.worker(slots=G)
        gen = await a.recv(m.Generate)
        b = Fake(ctx, ep, "rollout/b/1")
        await b.worker(slots=G)
        a.sock.close(linger=0)  # as a crashed process's kernel closes its connections
        again = await leased_again(b, gen)
        assert again.attempt != gen.attempt
        [lost] = actor.lost
        assert (lost["peer"], lost["reason"]) == ("rollout/a/1", "unreachable"), lost
        assert "false deaths (rollout)" not in actor.counters


@pytest.mark.parametrize("bind", ["inproc", "ipc"])
async def test_a_worker_that_said_goodbye_and_closed_leaves_by_its_goodbye_when_drains_are_cut_short(
        bind: str, tmp_path: Any, monkeypatch: pytest.MonkeyPatch):  # fmt: skip
    """A loaded machine cuts the broker's drain short: here every drain reads one message. The worker sends its
    results and Goodbye and closes its socket before the broker reads any, so the acks the broker sends find it gone
    while its Goodbye still waits to be read; it is lost for its Goodbye, not as unreachable. (Over inproc the acks
    find it gone every time; over ipc, when the broker sees the disconnect before it reads the Goodbye.)"""

    monkeypatch.setattr(BrokerActor, "drain", lambda self: not self.read_one())  # not drained after one, if any
    where = [f"broker.bind=ipc://{tmp_path}/b.sock"] if bind == "ipc" else []
    # a 5 s interval: "an interval later" (for a broker that stays behind) cannot come first
    async with running_broker("broker.heartbeat_interval_s=5", *where) as (actor, ep, ctx):
        a = Fake(ctx, ep, "rollout/a/1", LINGER=2000)  # its messages leave before its socket closes
        await a.worker(slots=G)
        gen = await a.recv(m.Generate)
        for i in range(G):
            await a.send(finished(gen, i, epoch=7))
        await a.send(m.Goodbye(reason="stopping"))
        a.sock.close()
        async with asyncio.timeout(10):
            while not actor.lost:
                await asyncio.sleep(0.01)
        [lost] = actor.lost
        assert (lost["peer"], lost["reason"]) == ("rollout/a/1", "goodbye: stopping"), lost
        assert actor.counters["lost rollout"] == 1


async def test_a_process_declared_dead_that_says_hello_again_is_counted_as_a_false_death():
    async with running_broker("broker.liveness=3") as (actor, ep, ctx):
        first = Fake(ctx, ep, "rollout/a/1")
        await first.worker(slots=G, peer_id="a")
        assert isinstance(await first.recv(m.Disconnect), m.Disconnect)  # silent for 3 x 0.05 s: declared dead
        assert actor.counters["lost rollout"] == 1 and actor.counters["false deaths (rollout)"] == 0
        again = Fake(ctx, ep, "rollout/a/2")  # the same process (name, host, pid) on a new session: it was alive
        await again.worker(slots=G, peer_id="a")
        assert actor.counters["false deaths (rollout)"] == 1
        other = Fake(ctx, ep, "rollout/b/1")  # another process that was never declared dead is not counted
        await other.worker(slots=G, peer_id="b")
        assert actor.counters["false deaths (rollout)"] == 1


async def test_a_peer_heard_only_through_bad_frames_is_not_silent():
    """A heartbeat can wait behind a peer's own frames: a flood the broker reads slower than it comes. Every
    frame from a registered peer, one that does not decode too, says it is there; silence is no frame at all."""
    async with running_broker("broker.liveness=3") as (actor, ep, ctx):
        noisy = Fake(ctx, ep, "rollout/noisy/1")
        await noisy.worker(slots=G)
        loop = asyncio.get_running_loop()
        until = loop.time() + 12 * 3 * 0.05  # twelve silence windows of heartbeat-free garbage
        while loop.time() < until:
            await noisy.sock.send_multipart([codec.MAGIC, b"\xc1 not a message"])
            await asyncio.sleep(0.01)
        assert actor.counters["lost rollout"] == 0 and actor.malformed["decode"] > 12
        assert isinstance(await noisy.recv(m.Disconnect), m.Disconnect)  # quiet now: declared dead in a window
        assert actor.counters["lost rollout"] == 1


async def test_a_broker_held_past_the_silence_window_declares_nobody_dead_for_it():
    """A loaded machine may not run the broker for seconds (3.3 s seen beside the suite): its peers' heartbeats of
    that time wait in its queue, or, where the whole machine stopped, were never sent. Either way the broker did not
    listen, and that time is nobody's silence; a peer silent while it listens is still declared dead in a window."""
    async with running_broker("broker.liveness=3") as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/w/1")
        await w.worker(slots=G)
        await w.send(m.Heartbeat(seen=0, holding=held(), version=0, loading=-1))
        await asyncio.sleep(0.05)
        time.sleep(4 * 3 * 0.05)  # the broker's loop (this test's) held for four silence windows, the worker's too
        await asyncio.sleep(0.02)  # the broker's turns come first, before the worker's next heartbeat
        await w.send(m.Heartbeat(seen=0, holding=held(), version=0, loading=-1))
        await asyncio.sleep(0.05)
        assert actor.counters["lost rollout"] == 0
        assert isinstance(await w.recv(m.Disconnect), m.Disconnect)  # quiet now, the broker listening: dead in a window
        assert actor.counters["lost rollout"] == 1


async def test_a_worker_that_reconnects_while_registered_has_its_old_session_ended_at_once():
    async with running_broker() as (actor, ep, ctx):  # liveness 40 x 0.05 s: nothing expires by silence here
        first = Fake(ctx, ep, "rollout/a/1")
        await first.worker(slots=G, peer_id="a")
        gen = await first.recv(m.Generate)
        again = Fake(ctx, ep, "rollout/a/2")  # it judged the broker silent, dropped its work and said hello anew
        await again.worker(slots=G, peer_id="a")
        rerun = await again.recv(m.Generate)
        assert rerun.group_id == gen.group_id and rerun.attempt != gen.attempt  # re-leased without waiting 2 s
        assert actor.counters["reconnected while registered (rollout)"] == 1
        assert b"rollout/a/1" not in actor.peers and actor.lost[-1]["reason"] == "reconnected"


async def test_bad_peers_get_a_clear_answer_and_the_broker_lives_on():
    async with running_broker() as (_actor, ep, ctx):
        old = Fake(ctx, ep, "rollout/old/1")
        await old.send(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id="old", pid=1, host="h",
                               slots=G))  # fmt: skip
        frames = codec.encode(m.Heartbeat())
        frames[1] = (m.WIRE_VERSION + 1).to_bytes(2, "big")
        await old.sock.send_multipart(frames)
        reject = await old.recv(m.Reject)
        assert "wire version" in reject.reason and reject.wire_version == m.WIRE_VERSION
        stranger = Fake(ctx, ep, "rollout/stranger/1")
        await stranger.send(m.WeightsLoaded(version=0, load_s=0.0))
        assert "hello" in (await stranger.recv(m.Disconnect)).reason
        zero = Fake(ctx, ep, "rollout/zero/1")
        await zero.send(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id="z", pid=1, host="h"))
        assert "slots" in (await zero.recv(m.Reject)).reason
        anon = ctx.socket(zmq.DEALER)  # no identity: ZeroMQ makes a binary one
        anon.connect(ep)
        await anon.send_multipart(codec.encode(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT,
                                                       peer_id="anon", pid=1, host="h", slots=G)))  # fmt: skip
        async with asyncio.timeout(5):
            reply = codec.decode(await anon.recv_multipart())
        assert isinstance(reply, m.Reject) and "identity" in reply.reason
        await old.sock.send_multipart([b"\x00garbage"])
        status = Fake(ctx, ep, "client/status/1")
        await status.send(m.StatusRequest())
        snap = (await status.recv(m.StatusReply)).snapshot
        assert snap["malformed"]["wire_version"] == 1 and snap["malformed"]["decode"] == 1
        assert snap["malformed"]["bad identity"] == 1 and snap["malformed"]["unregistered"] == 1


async def test_a_slow_reader_loses_nothing_when_its_pipe_is_full():
    async with running_broker("broker.hwm=8") as (actor, ep, ctx):
        slow = Fake(ctx, ep, "learner/slow", RCVHWM=4)
        await slow.hello(m.Role.LEARNER)
        n = 3000
        for _ in range(n):  # every heartbeat is answered; the answers pile up while nobody reads
            await slow.send(m.Heartbeat())
        await asyncio.sleep(0.3)
        assert actor.peers[b"learner/slow"].outbox, "the pipe never filled: the test proves nothing"
        got = 0
        async with asyncio.timeout(10):
            while got < n:
                if isinstance(codec.decode(await slow.sock.recv_multipart()), m.Heartbeat):
                    got += 1
        assert got == n and not actor.counters["unroutable reply"]


async def test_one_report_of_many_samples_gets_one_answer_per_sample_in_order():
    async with running_broker() as (_actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        await w.worker(slots=G)
        gen = await w.recv(m.Generate)
        first = finished(gen, 0, epoch=7)
        report = (first, first, *(finished(gen, i, epoch=7) for i in range(1, G)), finished(gen, 1, epoch=3))
        await w.send(packed.pack_samples(report))
        acks = (await w.recv(m.ResultAcks)).acks
        assert [(a.index, a.accepted) for a in acks] == [(0, True), (0, False), *((i, True) for i in range(1, G)),
                                                         (1, False)]  # fmt: skip
        assert acks[1].reason == "duplicate_sample" and "epoch" in acks[-1].reason


def test_the_answer_accepting_a_whole_report_is_the_bytes_of_its_acks():
    """The common answer is encoded from plain data (no dataclass per sample): exactly what the codec would send."""
    gens = [m.Generate(group_id=2**40 + g, attempt=7 + g, version=3, prompt_ids=np.zeros(1, np.int32), n_samples=G,
                       max_tokens=4) for g in range(2)]  # fmt: skip
    headers = packed.pack_samples([finished(gen, i, epoch=1) for gen in gens for i in range(G)]).samples
    for some in (headers, headers[:1], ()):
        acks = m.ResultAcks(acks=tuple(m.ResultAck(group_id=x.group_id, attempt=x.attempt, index=x.index, accepted=True)
                                       for x in some))  # fmt: skip
        assert [bytes(f) for f in translate.all_accepted(some)] == [bytes(f) for f in codec.encode(acks)]
        assert codec.decode(translate.all_accepted(some)) == acks


async def test_a_learner_whose_checkpoint_is_ahead_of_the_broker_is_turned_away():
    async with running_broker() as (actor, ep, ctx):
        ahead = Fake(ctx, ep, "learner/ahead")
        await ahead.send(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.LEARNER, peer_id="l", pid=1, host="h",
                                 learner_version=3))  # fmt: skip
        reject = await ahead.recv(m.Reject)
        assert "version 3" in reject.reason and "newest is 0" in reject.reason
        assert actor.learner is None
        fresh = Fake(ctx, ep, "learner/fresh")
        await fresh.send(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.LEARNER, peer_id="l", pid=1, host="h",
                                 learner_version=0))  # fmt: skip
        assert (await fresh.recv(m.Welcome)).newest_version == 0


def held(*leases: tuple[int, int]) -> np.ndarray:
    return np.array(leases, dtype=np.int64).reshape(-1, 2)


async def test_a_lease_whose_generate_was_lost_is_found_by_the_heartbeat_and_leased_again():
    async with running_broker() as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        await w.worker(slots=G)
        lost = await w.recv(m.Generate)  # the worker "never got" this one
        assert lost.seq == 2  # after the Assign (1)
        # a heartbeat saying: nothing past seq 1 seen yet -> the lease is not judged
        await w.send(m.Heartbeat(seen=1, holding=held(), version=0))
        with pytest.raises(TimeoutError):
            await w.recv(m.Generate, timeout_s=0.3)
        # seq 2 went by and the worker holds nothing of it: lost on the way, re-queued whole and leased again
        await w.send(m.Heartbeat(seen=2, holding=held(), version=0))
        again = await w.recv(m.Generate)
        assert again.group_id == lost.group_id and again.attempt != lost.attempt and again.seq == 3
        assert actor.counters["lease lost on the way"] == 1
        # the worker holds it now: no more re-leasing
        await w.send(m.Heartbeat(seen=3, holding=held((again.group_id, again.attempt)), version=0))
        with pytest.raises(TimeoutError):
            await w.recv(m.Generate, timeout_s=0.3)
        assert actor.counters["lease lost on the way"] == 1


async def test_a_void_lease_the_worker_still_holds_gets_its_cancel_again():
    async with running_broker() as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        await w.worker(slots=G)
        gen = await w.recv(m.Generate)
        stale = (gen.group_id, gen.attempt + 1000)  # a lease the broker does not know
        await w.send(m.Heartbeat(seen=gen.seq, holding=held((gen.group_id, gen.attempt), stale), version=0))
        cancel = await w.recv(m.Cancel)
        assert (cancel.group_id, cancel.attempt) == stale and cancel.seq == gen.seq + 1
        assert actor.counters["cancel sent again"] == 1


async def test_a_lost_assign_is_sent_again_and_a_lost_weights_loaded_is_read_from_the_heartbeat():
    async with running_broker() as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        await w.hello(m.Role.ROLLOUT, G)
        first = await w.recv(m.Assign)
        await w.send(m.Heartbeat(seen=first.seq, holding=held(), version=-1, loading=-1))  # it never arrived
        again = await w.recv(m.Assign)
        assert again.version == first.version and again.seq == first.seq + 1
        # the worker loads it, and its WeightsLoaded is lost: the heartbeat says so instead
        await w.send(m.Heartbeat(seen=again.seq, holding=held(), version=again.version))
        gen = await w.recv(m.Generate)
        assert gen.version == again.version
        assert actor.counters["weights_loaded taken from a heartbeat"] == 1


async def test_a_repeated_hello_is_answered_without_voiding_the_session():
    async with running_broker() as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        await w.worker(slots=G)
        gen = await w.recv(m.Generate)
        assert (await w.hello(m.Role.ROLLOUT, G)).broker_epoch == 7  # its Welcome was lost, say
        await w.send(finished(gen, 0, 7))
        ack = await w.ack()
        assert ack.accepted, ack.reason  # the lease survived the repeat
        assert actor.counters["hello repeated"] == 1


async def test_actions_beyond_a_turns_share_go_out_on_later_turns_in_the_cores_order(monkeypatch):
    """One WeightsLoaded leases five groups at once; carried out one per turn, they reach the worker over five turns,
    numbered in the order the core decided them."""
    monkeypatch.setattr(broker_actor, "ACTS_PER_TURN", 1)
    waiting: list[int] = []
    carry_out = BrokerActor.carry_out
    monkeypatch.setattr(BrokerActor, "carry_out", lambda self: (waiting.append(len(self.acts)), carry_out(self)))
    async with running_broker("core.max_staleness=4", "core.train_groups=4") as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        assign = await w.worker(slots=5 * G)
        gens = [await w.recv(m.Generate) for _ in range(5)]
        assert [g.seq for g in gens] == list(range(assign.seq + 1, assign.seq + 6))
        assert [g.group_id for g in gens] == sorted(g.group_id for g in gens) and len({g.group_id for g in gens}) == 5
        assert max(waiting) >= 4, waiting  # they did wait
        assert not actor.acts and not actor.waiting


async def test_a_worker_with_commands_still_to_go_out_is_not_reconciled_until_they_have(monkeypatch):
    """A heartbeat cannot match what the core decided while the commands saying so wait their turn: such a worker
    is not reconciled (a Yield or Cancel would be sent twice); once they are out, it is again."""
    reconciled: list[str] = []
    monkeypatch.setattr(broker_actor, "reconcile", lambda core, peer, hb, **kw: reconciled.append(peer.name))
    monkeypatch.setattr(broker_actor, "ACTS_PER_TURN", 0)  # nothing goes out
    async with running_broker() as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        await w.hello(m.Role.ROLLOUT, G)
        await w.send(m.Heartbeat(seen=0, holding=held(), version=-1, loading=-1))
        await w.recv(m.Heartbeat)
        assert actor.waiting == {"rollout/a/1": 1} and not reconciled  # its Assign waits
        monkeypatch.setattr(broker_actor, "ACTS_PER_TURN", 128)
        assign = await w.recv(m.Assign)
        await w.send(m.Heartbeat(seen=assign.seq, holding=held(), version=-1, loading=assign.version))
        await w.recv(m.Heartbeat)
        assert reconciled == ["rollout/a/1"] and not actor.waiting


async def test_a_stalled_loop_is_logged_with_the_cpu_it_used_meanwhile():
    """A turn of the loop that holds it past STALL_S shows in the log, and its CPU tells a broker busy in its own
    code from one that was not run or waited in a system call."""
    from structlog.testing import capture_logs

    async with running_broker() as _:
        await asyncio.sleep(0.1)  # the lag probe is asleep in the loop
        with capture_logs() as logs:
            until = time.process_time() + 0.8
            while time.process_time() < until:  # busy for 0.8 CPU-s, holding the loop, however loaded the machine
                pass
            await asyncio.sleep(0.1)
            time.sleep(0.8)  # holding the loop without using the CPU, as a write held by the disk would
            await asyncio.sleep(0.1)
    busy, idle = [r for r in logs if r["event"] == "loop_stalled"]
    assert busy["late_s"] > 0.5 and busy["cpu_s"] >= 0.75, busy
    assert idle["late_s"] > 0.5 and idle["cpu_s"] < 0.3, idle
    # the 0.8 s asleep in a system call is neither CPU nor a wait for one, however loaded the machine
    assert idle["late_s"] - idle["cpu_s"] - idle.get("queued_s", 0.0) >= 0.7, idle


async def test_with_replace_the_learner_gets_only_groups_with_a_signal_and_the_audit_counts_those_filtered(tmp_path):
    """learner.filter_uniform_groups = "replace": every third group's samples all get the same reward. The broker
    consumes each of those as filtered when it finishes, leases another in its place, journals it beside the step
    it was filtered in, and the learner trains only groups whose rewards differ; `dora audit` counts the filtered
    groups (dispatched = trained + filtered) and finds every id below steps x B + filtered consumed once."""
    import json

    from dora.broker.journal import replay
    from dora.broker.main import open_journal
    from dora.ops.audit import audit_run, render

    steps = 3
    cfg = load(RunConfig, overrides=[f"broker.bind=inproc://broker-{uuid.uuid4().hex}", "broker.strict=true",
                                     f"core.group_size={G}", f"core.train_groups={B}", "core.max_staleness=1",
                                     f"core.total_steps={steps}", f"broker.journal={tmp_path / 'journal.jsonl'}",
                                     "learner.filter_uniform_groups=replace",
                                     "broker.exit_when_done=false"])  # fmt: skip
    ctx = zmq.asyncio.Context()
    sock, ep = open_router(ctx, cfg)
    core, journal, _ = open_journal(cfg, epoch=7)
    actor = BrokerActor(cfg, sock, core, lambda g: np.arange(3, dtype=np.int32) + g, epoch=7, journal=journal)
    stop = asyncio.Event()
    task = asyncio.create_task(actor.run(stop))

    def flat(group: int) -> bool:
        return group % 3 == 0

    async def serve(w: Fake) -> None:  # load what is assigned, and answer every lease at once
        while True:
            gen = await w.recv((m.Generate, m.Assign), timeout_s=30)
            if isinstance(gen, m.Assign):
                await w.send(m.WeightsLoaded(version=gen.version, load_s=0.0))
                continue
            for i in range(G):
                sample = finished(gen, i, epoch=7)
                if flat(gen.group_id):
                    sample = FinishedSample(**{**{f: getattr(sample, f) for f in sample.__slots__}, "reward": 1.0})
                await w.send(sample)

    try:
        w = Fake(ctx, ep, "rollout/a/1")
        await w.worker(slots=4 * G)
        worker = asyncio.create_task(serve(w))
        learner = Fake(ctx, ep, "learner/x")
        await learner.hello(m.Role.LEARNER)
        audit = []
        for step in range(steps):
            await learner.send(m.RequestBatch(step=step))
            batch = packed.unpack_batch(await learner.recv(m.TrainBatch, timeout_s=10))
            assert batch.step == step and len(batch.groups) == B
            for g in batch.groups:
                assert not flat(g.group_id) and len({s.reward for s in g.samples}) == 2, "a uniform group trained"
            audit.append({"step": step, "groups": sorted(g.group_id for g in batch.groups), "staleness": {},
                          "versions": sorted({g.version for g in batch.groups}), "mixed": 0, "turns": 0})  # fmt: skip
            await learner.send(m.WeightsPublished(version=step + 1, uri=f"sim://v{step + 1}", sha256="0" * 64))
            assert (await learner.recv(m.PublishAck)).version == step + 1
        worker.cancel()
    finally:
        stop.set()
        await task
        journal.close()
        ctx.destroy(linger=0)
    (tmp_path / "audit.jsonl").write_text("".join(json.dumps(r) + "\n" for r in audit))
    past = replay(tmp_path / "journal.jsonl")
    assert past.filtered and all(flat(g) for g in past.filtered) and not past.filtered & past.trained
    assert past.filtered == set(core.transfer.filtered) and actor.counters["groups filtered"] == len(past.filtered)
    r = audit_run(tmp_path / "journal.jsonl", tmp_path / "audit.jsonl", total_steps=steps)
    assert r.ok, r.problems
    assert (r.groups_trained, r.groups_filtered) == (steps * B, len(past.filtered))
    assert f"filtered (every reward equal, never trained): {len(past.filtered)}" in render(r)
