"""The broker names each rollout worker's data-plane sources in its Assign: its node's parent relay in a tree
over the hosts the workers said hello from, then the learner's server; a node lost is left out of the tree."""

from __future__ import annotations

import asyncio
import os

import pytest

from dora.core import events as ev
from dora.ids import WorkerId
from dora.wire import messages as m
from tests.unit.test_broker_actor import Fake, running_broker

pytestmark = pytest.mark.timeout(30)
LEARNER = ("tcp://learner:7000",)


async def join(fake: Fake, host: str) -> m.Assign:
    await fake.send(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id=fake.name, pid=os.getpid(),
                            host=host, slots=8, engine="fake", weights_endpoint=f"tcp://{host}:9000"))  # fmt: skip
    await fake.recv(m.Welcome)
    assign = await fake.recv(m.Assign)
    await fake.send(m.WeightsLoaded(version=assign.version, load_s=0.0))
    return assign


async def test_each_assign_names_the_workers_parent_relay_then_the_learner():
    async with running_broker("rollout.relay_fanout=1") as (actor, ep, ctx):
        workers = {h: Fake(ctx, ep, f"rollout/{h}/1") for h in ("node1", "node2", "node3")}
        for host, fake in workers.items():
            await join(fake, host)
        actor.weights[1] = ("file:///learner/store/v1", "0" * 64)
        actor.carried[1] = (LEARNER, {})
        for fake in workers.values():
            actor.act(ev.Pin(worker_id=WorkerId(fake.name), version=1))
        actor.flush()
        got = {h: (await f.recv(m.Assign)).sources for h, f in workers.items()}
        chain = {"node1": LEARNER, "node2": ("tcp://node1:9000", *LEARNER), "node3": ("tcp://node2:9000", *LEARNER)}
        assert got == chain  # fanout 1: a chain
        await workers["node2"].send(m.Goodbye(reason="lost"))
        async with asyncio.timeout(5):
            while any(p.name == workers["node2"].name for p in actor.peers.values()):
                await asyncio.sleep(0.01)
        actor.act(ev.Pin(worker_id=WorkerId(workers["node3"].name), version=1))
        actor.flush()
        assert (await workers["node3"].recv(m.Assign)).sources == ("tcp://node1:9000", *LEARNER)
