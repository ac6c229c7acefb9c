"""The learner against a fake broker (a raw ROUTER): a publish counts once the broker acknowledges it, and
a broker that comes back without it makes the learner undo that step and train the batch it is given."""

from __future__ import annotations

import asyncio
import json
import threading
import uuid

import numpy as np
import pytest
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from dora.config import load
from dora.config.run import RunConfig
from dora.ids import Finish
from dora.learner.actor import LearnerActor
from dora.learner.trainers import PendingVersion
from dora.learner.trainers.sim import SimTrainer
from dora.samples import Batch, TrainGroup, TrainSample
from dora.wire import codec, packed
from dora.wire import messages as m

pytestmark = pytest.mark.timeout(30)
B, G = 2, 2


def batch(step: int, first_group: int) -> m.TrainBatch:
    """A batch as the broker sends it: packed."""

    def sample(i: int) -> TrainSample:
        return TrainSample(index=i, token_ids=np.arange(3, dtype=np.int32), logprobs=np.zeros(3, np.float32),
                           reward=float(i), finish=Finish.STOP)  # fmt: skip

    groups = tuple(TrainGroup(group_id=first_group + k, version=step, prompt_ids=np.array([1], np.int32),
                              samples=(sample(0), sample(1))) for k in range(B))  # fmt: skip
    return packed.pack_batch(Batch(step=step, groups=groups))


class FakeBroker:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.peer = b""

    async def expect(self, kind: type) -> object:
        async with asyncio.timeout(10):
            while True:
                frames = await self.sock.recv_multipart()
                self.peer, msg = frames[0], codec.decode(frames[1:])
                if isinstance(msg, kind):
                    return msg

    async def send(self, msg: object) -> None:
        await self.sock.send_multipart([self.peer, *codec.encode(msg)])

    async def welcome(self, newest: int) -> None:
        await self.send(m.Welcome(broker_epoch=1, heartbeat_interval_s=0.05, liveness=100, newest_version=newest))


def config(total_steps: int) -> RunConfig:
    return load(RunConfig, overrides=[f"core.train_groups={B}", f"core.group_size={G}",
                                      f"core.total_steps={total_steps}", "core.max_staleness=1",
                                      "run.time_scale=0.0001", "broker.heartbeat_interval_s=0.05",
                                      "broker.liveness=100"])  # fmt: skip


@pytest.fixture
async def setup(tmp_path):
    endpoint = f"inproc://broker-{uuid.uuid4().hex}"
    cfg = config(total_steps=2)
    ctx = zmq.asyncio.Context()
    broker = FakeBroker(ctx, endpoint)
    audit_path = tmp_path / "audit.jsonl"
    with open(audit_path, "a") as audit:
        learner = LearnerActor(cfg, ctx, endpoint, audit=audit, trainer=SimTrainer(cfg))
        stop = asyncio.Event()
        task = asyncio.create_task(learner.run(stop))
        try:
            yield broker, task, audit_path
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            ctx.destroy(linger=0)


def audited(path) -> list[tuple[int, list[int]]]:
    return [(r["step"], r["groups"]) for r in map(json.loads, path.read_text().splitlines())]


async def test_a_step_the_broker_never_recorded_is_undone_and_trained_again_from_what_it_sends(setup):
    broker, _task, audit = setup
    await broker.expect(m.Hello)
    await broker.welcome(0)
    assert (await broker.expect(m.RequestBatch)).step == 0
    await broker.send(batch(0, first_group=10))
    assert (await broker.expect(m.WeightsPublished)).version == 1
    # the broker "restarts" without having journalled version 1: it does not know the learner, and says so
    await broker.send(m.Disconnect(reason="unknown peer: say hello first"))
    await broker.expect(m.Hello)
    await broker.welcome(0)
    assert (await broker.expect(m.RequestBatch)).step == 0  # step 0 again: the learner undid it
    await broker.send(batch(0, first_group=20))  # a different batch: the groups of 10, 11 were re-queued
    assert (await broker.expect(m.WeightsPublished)).version == 1
    await broker.send(m.PublishAck(version=1))
    assert (await broker.expect(m.RequestBatch)).step == 1
    assert audited(audit) == [(0, [20, 21])]  # only the committed step; groups 10 and 11 were never counted


async def test_a_publish_the_broker_recorded_before_losing_its_ack_is_committed_on_rejoin(setup):
    broker, task, audit = setup
    await broker.expect(m.Hello)
    await broker.welcome(0)
    await broker.expect(m.RequestBatch)
    await broker.send(batch(0, first_group=10))
    await broker.expect(m.WeightsPublished)
    await broker.send(m.Disconnect(reason="unknown peer: say hello first"))
    await broker.expect(m.Hello)
    await broker.welcome(1)  # the journal has version 1
    assert (await broker.expect(m.RequestBatch)).step == 1
    assert audited(audit) == [(0, [10, 11])]
    await broker.send(batch(1, first_group=12))
    await broker.expect(m.WeightsPublished)
    await broker.send(m.PublishAck(version=1))  # an ack for another version changes nothing
    await broker.send(m.PublishAck(version=2))
    await broker.expect(m.Goodbye)  # total_steps = 2: done
    assert await asyncio.wait_for(task, 5) == 0
    assert audited(audit) == [(0, [10, 11]), (1, [12, 13])]


async def test_a_batch_whose_payload_does_not_match_its_checksums_is_refused_naming_the_group(setup):
    """The broker forwards payload frames unread: a sample corrupted on the way is caught here, before training."""
    broker, task, audit = setup
    await broker.expect(m.Hello)
    await broker.welcome(0)
    await broker.expect(m.RequestBatch)
    frames = [bytearray(bytes(f)) for f in codec.encode(batch(0, first_group=10))]
    frames[5][4] ^= 0x40  # the second token id of group 10's first sample (frame 4 is the prompts)
    with capture_logs() as logs:
        await broker.sock.send_multipart([broker.peer, *frames])
        assert await asyncio.wait_for(task, 5) == 3
    corrupt = next(e for e in logs if e["event"] == "batch_corrupt")
    assert (corrupt["step"], corrupt["group_id"], corrupt["index"]) == (0, 10, 0)
    assert "does not match its checksum" in corrupt["error"]
    assert not audit.exists() or audited(audit) == []  # nothing of it was trained


class KeepsWeights(SimTrainer):
    """A trainer that holds weights, as the torch trainer does: a learner behind the broker takes the newest from
    the store (recorded here) instead of training on from its checkpoint's."""

    keeps_weights = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.adopted: list[int] = []

    def adopt(self, version: int) -> None:
        self.adopted.append(version)


async def test_a_learner_resumed_behind_the_broker_adopts_the_newest_weights_and_audits_the_steps_it_took(tmp_path):
    endpoint = f"inproc://broker-{uuid.uuid4().hex}"
    cfg = config(total_steps=4)
    ctx = zmq.asyncio.Context()
    broker, trainer = FakeBroker(ctx, endpoint), KeepsWeights(cfg)
    audit_path = tmp_path / "audit.jsonl"
    audit_path.write_text(json.dumps({"step": 0, "groups": [0, 1]}) + "\n")  # the killed learner's line for step 0
    stop = asyncio.Event()
    with open(audit_path, "a") as audit:
        # its checkpoint holds version 1; it had published versions 2 and 3 (the broker journalled both) and was
        # killed before it wrote step 2's line
        learner = LearnerActor(cfg, ctx, endpoint, audit=audit, trainer=trainer,
                               resumed={"version": 1, "trained_groups": [0, 1]})  # fmt: skip
        task = asyncio.create_task(learner.run(stop))
        try:
            await broker.expect(m.Hello)
            await broker.welcome(3)
            assert (await broker.expect(m.RequestBatch)).step == 3
            assert trainer.adopted == [3]
            await broker.send(batch(3, first_group=6))
            assert (await broker.expect(m.WeightsPublished)).version == 4
            await broker.send(m.PublishAck(version=4))
            await broker.expect(m.Goodbye)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            ctx.destroy(linger=0)
    rows = [json.loads(x) for x in audit_path.read_text().splitlines()]
    assert [(r["step"], bool(r.get("adopted"))) for r in rows] == [(0, False), (1, True), (2, True), (3, False)]
    assert [r["version"] for r in rows[1:3]] == [2, 3]


class SeesTheAudit(KeepsWeights):
    """Records, at each checkpoint, the steps the audit file on disk already names."""

    def __init__(self, cfg: RunConfig, audit_path) -> None:
        super().__init__(cfg)
        self.audit_path = audit_path
        self.seen: dict[int, list[int]] = {}

    def checkpoint(self, version: int, trained_groups: list[int]) -> float:
        self.seen[version] = [s for s, _ in audited(self.audit_path)]
        return 0.0


async def test_a_step_is_in_the_audit_on_disk_before_its_checkpoint_starts(tmp_path):
    """A learner killed after a checkpoint and before the audit line would resume from that checkpoint with no line
    for its last step (dora audit: steps not 0, 1, 2, ...). So the line comes first; a kill between the two leaves
    an older checkpoint, and the step is adopted again on resume."""
    endpoint = f"inproc://broker-{uuid.uuid4().hex}"
    cfg = load(RunConfig, overrides=[f"core.train_groups={B}", f"core.group_size={G}", "core.total_steps=2",
                                     "core.max_staleness=1", "run.time_scale=0.0001",
                                     "broker.heartbeat_interval_s=0.05", "broker.liveness=100",
                                     f"learner.checkpoint_dir={tmp_path / 'ckpt'}",
                                     "learner.checkpoint_every=1"])  # fmt: skip
    ctx = zmq.asyncio.Context()
    broker, audit_path = FakeBroker(ctx, endpoint), tmp_path / "audit.jsonl"
    trainer = SeesTheAudit(cfg, audit_path)
    stop = asyncio.Event()
    with open(audit_path, "a") as audit:
        task = asyncio.create_task(LearnerActor(cfg, ctx, endpoint, audit=audit, trainer=trainer).run(stop))
        try:
            await broker.expect(m.Hello)
            await broker.welcome(0)
            for step in range(2):
                assert (await broker.expect(m.RequestBatch)).step == step
                await broker.send(batch(step, first_group=10 + 2 * step))
                assert (await broker.expect(m.WeightsPublished)).version == step + 1
                await broker.send(m.PublishAck(version=step + 1))
            await broker.expect(m.Goodbye)
        finally:
            stop.set()
            await asyncio.wait_for(task, 10)
            ctx.destroy(linger=0)
    assert trainer.seen == {1: [0], 2: [0, 1]}


class GatedTrainer(SimTrainer):
    """A trainer whose weights are a counter and whose every version's write waits until the test opens its gate."""

    keeps_weights = True

    def __init__(self, cfg: RunConfig) -> None:
        super().__init__(cfg)
        self.gates: dict[int, threading.Event] = {}
        self.weights = 0
        self.checkpoints: list[tuple[int, int]] = []

    def gate(self, version: int) -> threading.Event:
        return self.gates.setdefault(version, threading.Event())

    def train(self, batch: Batch) -> dict[str, float]:
        self.weights += 1
        return {"train_s": 0.0}

    def snapshot(self, version: int) -> PendingVersion:
        assert version == self.weights, "the copy is of the weights just trained"
        gate = self.gate(version)

        def write() -> tuple[str, str, float]:
            assert gate.wait(10), f"v{version}'s write was never let through"
            return f"sim://v{version}", "0" * 64, 0.0

        return PendingVersion(version=version, write=write, snapshot_s=0.0)

    def checkpoint(self, version: int, trained_groups: list[int]) -> float:
        self.checkpoints.append((version, self.weights))
        return 0.0

    def restore(self) -> dict | None:
        self.weights = 0
        return None

    def adopt(self, version: int) -> None:
        self.weights = version


@pytest.fixture
async def gated(tmp_path):
    endpoint = f"inproc://broker-{uuid.uuid4().hex}"
    cfg = load(RunConfig, overrides=[f"core.train_groups={B}", f"core.group_size={G}", "core.total_steps=4",
                                     "core.max_staleness=1", "broker.heartbeat_interval_s=0.05",
                                     "broker.liveness=100", f"learner.checkpoint_dir={tmp_path / 'ckpt'}",
                                     "learner.checkpoint_every=2"])  # fmt: skip
    ctx = zmq.asyncio.Context()
    broker = FakeBroker(ctx, endpoint)
    trainer = GatedTrainer(cfg)
    with open(tmp_path / "audit.jsonl", "a") as audit:
        learner = LearnerActor(cfg, ctx, endpoint, audit=audit, trainer=trainer)
        stop = asyncio.Event()
        task = asyncio.create_task(learner.run(stop))
        try:
            yield broker, trainer, task
        finally:
            for g in trainer.gates.values():
                g.set()
            stop.set()
            await asyncio.wait_for(task, 10)
            ctx.destroy(linger=0)


async def next_message(broker: FakeBroker) -> object:
    """The next message that is not a heartbeat."""
    while isinstance(msg := await broker.expect(object), m.Heartbeat):
        pass
    return msg


async def test_the_next_batch_is_asked_for_while_the_version_is_written_and_the_version_is_announced_once_durable(
    gated,
):
    """The step ends with the copy: the learner asks for batch 1 before version 1 is durable, trains it, and waits
    for version 1's write (one write at a time) before it copies version 2 aside; versions are announced in order,
    each once its write is done. Version 2 is checkpointed: batch 2 is asked for only once version 2 is announced,
    and the checkpoint finds the weights still at 2."""
    broker, trainer, task = gated
    await broker.expect(m.Hello)
    await broker.welcome(0)
    assert (await next_message(broker)).step == 0
    await broker.send(batch(0, first_group=10))
    assert (await next_message(broker)) == m.RequestBatch(step=1), "asked before version 1 is written"
    await broker.send(batch(1, first_group=12))  # trained at once; the copy of version 2 waits for version 1's write
    await asyncio.sleep(0.3)
    assert trainer.weights == 2 and 2 not in trainer.gates, "version 2 copied aside while version 1 is written"
    trainer.gate(1).set()
    published = await next_message(broker)
    assert isinstance(published, m.WeightsPublished) and published.version == 1
    await broker.send(m.PublishAck(version=1))
    trainer.gate(2).set()
    published = await next_message(broker)
    assert isinstance(published, m.WeightsPublished) and published.version == 2, "checkpointed: no early batch"
    assert published.metrics["write_wait_s"] > 0.2, "step 2 waited for version 1's write"
    assert (await next_message(broker)) == m.RequestBatch(step=2)
    await broker.send(m.PublishAck(version=2))
    await asyncio.sleep(0.2)
    assert trainer.checkpoints == [(2, 2)]
    assert not task.done()


async def test_a_broker_that_never_heard_of_a_version_in_flight_has_its_step_trained_again(gated):
    """Version 1 is still being written when the broker comes back without it: the learner forgets the step (the
    write, durable or not, is never announced), goes back to its checkpoint, and trains the batch it is sent."""
    broker, trainer, _task = gated
    await broker.expect(m.Hello)
    await broker.welcome(0)
    await next_message(broker)
    await broker.send(batch(0, first_group=10))
    assert (await next_message(broker)) == m.RequestBatch(step=1)
    await broker.send(m.Disconnect(reason="unknown peer: say hello first"))
    assert isinstance(await next_message(broker), m.Hello)
    trainer.gate(1).set()  # the write ends after the broker lost the step
    await broker.welcome(0)
    assert (await next_message(broker)) == m.RequestBatch(step=0)
    assert trainer.weights == 0, "back to the checkpoint's (here the start's) weights"
    trainer.gates.clear()
    await broker.send(batch(0, first_group=20))
    assert (await next_message(broker)) == m.RequestBatch(step=1)
    trainer.gate(1).set()
    published = await next_message(broker)
    assert isinstance(published, m.WeightsPublished) and published.version == 1
