"""The rollout worker against a fake broker (a raw ROUTER) on a lossy link: commands apply in order or
not at all, heartbeats report what it saw and holds, results come again until acknowledged, a
repeated Assign is answered again, and commands that never come are counted lost after a while."""

from __future__ import annotations

import asyncio
import contextlib
import pathlib
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable

import numpy as np
import pytest
import zmq.asyncio

from dora.config import load
from dora.config.run import RunConfig
from dora.rollout.actor import RolloutActor
from dora.rollout.main import make_engine
from dora.wire import messages as m
from tests.unit.test_learner_actor import FakeBroker

pytestmark = pytest.mark.timeout(30)


def generate(group: int, attempt: int, seq: int) -> m.Generate:
    return m.Generate(group_id=group, attempt=attempt, version=0, prompt_ids=np.arange(4, dtype=np.int32),
                      n_samples=2, max_tokens=64, broker_epoch=1, seq=seq)  # fmt: skip


async def beat_until(broker: FakeBroker, pred) -> m.Heartbeat:
    while True:
        hb = await broker.expect(m.Heartbeat)
        if pred(hb):
            return hb


@contextlib.asynccontextmanager
async def welcomed_worker(
    *overrides: str, run_finished: Callable[[int], bool] | None = None
) -> AsyncIterator[tuple[FakeBroker, RolloutActor, asyncio.Task[int]]]:
    """A sim-engine worker that said hello to a fake broker and was welcomed; stopped at the end."""
    endpoint = f"inproc://broker-{uuid.uuid4().hex}"
    cfg = load(RunConfig, overrides=["broker.heartbeat_interval_s=0.05", "broker.liveness=100", *overrides])
    ctx = zmq.asyncio.Context()
    broker = FakeBroker(ctx, endpoint)
    loop = asyncio.get_running_loop()
    worker = RolloutActor(cfg, ctx, endpoint, "w", make_engine(cfg, "sim", loop.time()), clock=loop.time,
                          run_finished=run_finished)  # fmt: skip
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        await broker.expect(m.Hello)
        await broker.welcome(newest=0)
        yield broker, worker, task
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
        ctx.destroy(linger=0)


async def test_commands_in_order_or_not_at_all_and_results_until_acknowledged():
    async with welcomed_worker("run.time_scale=0.0001", "engine.load_s=0") as (broker, worker, _):
        loop = asyncio.get_running_loop()
        await broker.send(m.Assign(version=0, uri="sim://v0", sha256="0" * 64, seq=1))
        await broker.expect(m.WeightsLoaded)
        await broker.send(generate(5, 2, seq=3))
        await broker.send(generate(6, 3, seq=2))  # overtaken by seq 3: as good as lost, never run
        hb = await beat_until(broker, lambda hb: hb.seen == 3)
        assert hb.held() <= {(5, 2)} and hb.version == 0 and hb.loading == -1
        assert worker.dropped_commands == 1

        results = (await broker.expect(m.SamplesFinished)).samples
        assert {(r.group_id, r.attempt) for r in results} == {(5, 2)}
        # no acknowledgement: the results are sent again, and the lease is still reported held
        hb = await beat_until(broker, lambda hb: True)
        assert (5, 2) in hb.held()
        again: set[int] = set()
        while len(again) < 2:
            again |= {r.index for r in (await broker.expect(m.SamplesFinished)).samples}
        acks = tuple(m.ResultAck(group_id=5, attempt=2, index=i, accepted=True) for i in (0, 1))
        await broker.send(m.ResultAcks(acks=acks))
        hb = await beat_until(broker, lambda hb: not hb.held())  # acknowledged: the lease is over
        assert hb.seen == 3

        await broker.send(m.Assign(version=0, uri="sim://v0", sha256="0" * 64, seq=4))  # its answer was lost
        assert (await broker.expect(m.WeightsLoaded)).version == 0
        await broker.send(m.Generate(group_id=7, attempt=4, version=1, prompt_ids=np.arange(4, dtype=np.int32),
                                     n_samples=2, max_tokens=64, broker_epoch=1, seq=5))  # fmt: skip
        hb = await beat_until(broker, lambda hb: hb.seen == 5)
        assert not hb.held(), "a lease for a version it does not serve must not run (C1)"

        # the broker's heartbeat says it sent up to 9: commands 6-9 never come, and after two heartbeat
        # intervals the worker counts them as lost, so its heartbeats let the broker mend them
        await broker.send(m.Heartbeat(seen=9))
        started = loop.time()
        hb = await beat_until(broker, lambda hb: hb.seen == 9)
        assert loop.time() - started >= worker.link.resend_s
        await broker.send(generate(8, 9, seq=8))  # a late copy of one of them: dropped unapplied
        hb = await beat_until(broker, lambda hb: True)
        assert not hb.held() and worker.dropped_commands == 2


async def test_the_run_finished_goodbye_ends_the_worker_even_with_a_weights_load_pending():
    """The broker's last words can come with an Assign still loading: the worker leaves (exit 0) and sends
    nothing more, instead of taking the closed broker for a lost one and reconnecting until killed."""
    async with welcomed_worker("run.time_scale=0.001", "engine.load_s=100") as (broker, worker, task):  # 0.1 s load
        await broker.send(m.Assign(version=3, uri="sim://v3", sha256="0" * 64, seq=1))
        await broker.send(m.Goodbye(reason="run finished"))
        broker.sock.close(linger=0)
        assert await asyncio.wait_for(task, 5) == 0
        assert worker.version != 3  # the pending load was dropped with the session


async def test_a_worker_away_at_the_goodbye_leaves_once_the_broker_that_welcomed_it_says_its_run_is_over():
    """Declared dead near the end, a worker can miss the goodbye: each lost session it asks whether the broker that
    welcomed it (epoch 1) finished its run, and leaves (exit 0) when it did, instead of calling it forever."""
    over: dict[int, bool] = {}
    asked: list[int] = []

    def finished(epoch: int) -> bool:
        asked.append(epoch)
        return over.get(epoch, False)

    async with welcomed_worker(run_finished=finished) as (broker, _, task):
        await broker.send(m.Disconnect(reason="stalled"))
        await broker.expect(m.Hello)  # the run goes on: it says hello again
        assert asked == [1] and not task.done()
        await broker.welcome(newest=0)
        over[1] = True
        await broker.send(m.Disconnect(reason="stalled"))
        assert await asyncio.wait_for(task, 5) == 0
        assert asked == [1, 1]


async def test_a_turn_that_holds_the_workers_loop_is_logged_with_the_cpu_it_used():
    """A worker falls silent while one turn of its loop holds it (a long decode step, a weight load): the lag probe
    logs that turn, and its CPU tells a worker busy in its own code from one the machine did not run."""
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        async with welcomed_worker("run.time_scale=0.0001", "engine.load_s=0") as (broker, worker, _):
            advance = worker.engine.advance

            def busy_advance(now: float) -> None:  # one step that computes for 0.8 CPU-s, however loaded the machine
                worker.engine.advance = advance
                until = time.process_time() + 0.8
                while time.process_time() < until:
                    pass
                advance(now)

            await asyncio.sleep(0.1)  # the probe is asleep in the loop
            worker.engine.advance = busy_advance
            while worker.engine.advance is not advance:  # until the busy step has run
                await broker.expect(m.Heartbeat)
            await asyncio.sleep(0.1)  # the loop's next turns: the probe wakes, late, before the worker stops
    stalls = [r for r in logs if r["event"] == "loop_stalled"]
    assert stalls and stalls[0]["late_s"] > 0.5 and stalls[0]["cpu_s"] >= 0.75, stalls
    # the rest of the stall, if any, was the loop's thread waiting for a CPU (this machine's other work)
    assert "queued_s" not in stalls[0] or 0 <= stalls[0]["queued_s"] <= stalls[0]["late_s"], stalls


async def test_a_worker_goes_on_heartbeating_while_it_loads_full_weights():
    """A full-weight load of a real model takes seconds (read, copy), longer than the broker's silence window: the
    worker loads in a thread and says, every heartbeat interval meanwhile, that it is loading that version."""
    async with welcomed_worker("run.time_scale=0.0001", "engine.load_s=0") as (broker, worker, _):
        loaded = worker.engine.loaded

        def slow_load(version: int, uri: str = "", sha256: str = "", *_: object) -> None:
            time.sleep(1.0)  # a disk read: the GIL is free meanwhile
            loaded(version, uri, sha256)

        worker.engine.loaded = slow_load
        await broker.send(m.Assign(version=3, uri="sim://v3", sha256="0" * 64, seq=1))
        beats = []
        while not isinstance(msg := await broker.expect(object), m.WeightsLoaded):
            if isinstance(msg, m.Heartbeat):
                beats.append(msg)
        during = [hb for hb in beats if hb.loading == 3 and hb.version == -1]
        assert len(during) >= 3, beats  # 1 s at 0.05 s a beat: on however loaded a machine, several
        assert msg.version == 3 and worker.version == 3


@pytest.mark.parametrize("successor", [True, False], ids=["newer-beside-it", "nothing-newer"])
async def test_a_version_retired_before_its_load_waits_for_the_newer_order_and_a_version_gone_alone_ends_the_session(
    tmp_path, successor: bool
):
    """A worker stopped with a load pending can wake after the broker moved it on and retired that version: the
    read fails, but the version is superseded, not bad, so the worker stays in its session on what it holds and
    loads the newer order when it comes. A version gone with nothing newer beside it (a store this host does not
    see) is refused as before: the session ends and the broker re-plans."""
    from dora.rollout.engines.base import EngineError

    if successor:
        (tmp_path / "v4").mkdir()
        (tmp_path / "v4" / "manifest.json").write_text("{}")
    async with welcomed_worker("run.time_scale=0.0001", "engine.load_s=0") as (broker, worker, _):
        loaded = worker.engine.loaded

        def load(version: int, uri: str = "", sha256: str = "", *_: object) -> None:
            if uri.startswith("file://") and not pathlib.Path(uri.removeprefix("file://")).is_dir():
                raise EngineError(f"v{version}: cannot read {uri}/manifest.json: No such file or directory")
            loaded(version, "sim://", sha256)

        worker.engine.loaded = load
        await broker.send(m.Assign(version=3, uri=f"file://{tmp_path}/v3", sha256="0" * 64, seq=1))
        if not successor:
            await broker.expect(m.Hello)  # a new session
            return
        hb = await beat_until(broker, lambda hb: hb.seen == 1 and hb.loading == -1)
        assert hb.version == -1  # still what it held, in the same session
        await broker.send(m.Assign(version=4, uri=f"file://{tmp_path}/v4", sha256="0" * 64, seq=2))
        assert (await broker.expect(m.WeightsLoaded)).version == 4 and worker.version == 4


async def test_a_worker_goes_on_heartbeating_while_its_engine_takes_a_long_step():
    """A step of a real engine (a prefill of long prompts, a first step that compiles, a step on a loaded machine)
    can take longer than the broker's silence window: the step runs on the engine's thread, the worker heartbeats
    every interval meanwhile, and what the step finished is taken on the loop once it is done."""
    async with welcomed_worker("run.time_scale=0.0001", "engine.load_s=0") as (broker, worker, _):
        loop, ran, ended = asyncio.get_running_loop(), [], []

        def slow_step() -> list[str]:
            ran.append((threading.current_thread().name, loop.time()))
            time.sleep(1.0)  # a step that holds its thread, not the GIL (a decode step mostly waits on kernels)
            ran.append((threading.current_thread().name, loop.time()))
            return ["finished sample"]

        worker.engine.begin_step = lambda now: slow_step if not ran else None
        worker.engine.end_step = ended.append
        arrivals = []
        while ["finished sample"] not in ended:
            await broker.expect(m.Heartbeat)
            arrivals.append(loop.time())
        [(thread, started), (_, done)] = ran
        assert thread == "engine" and thread != threading.current_thread().name
        during = [t for t in arrivals if started < t < done]
        assert len(during) >= 3, (started, done, arrivals)  # 1 s at 0.05 s a beat: on however loaded a machine, several
        assert [e for e in ended if e] == [["finished sample"]]  # taken once; the turns without a step end empty
