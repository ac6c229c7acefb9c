"""A rollout worker's own counters, end to end: a step worker's reward service clients (a real HTTP service on
127.0.0.1) counted and named alike on every worker, carried by the worker's heartbeats, and summed by the broker
over its worker processes into Prometheus and each train step's line, never going down when a worker restarts."""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from rich.console import Console

from dora.broker.metrics import WorkerCounters, serve_http
from dora.broker.sinks import step_scalars
from dora.config.run import TaskSection
from dora.hf.tiny import build_tokenizer
from dora.ids import Finish
from dora.ops.status import render
from dora.rollout.engines.base import Sample
from dora.rollout.engines.stepped import StepWorkerEngine
from dora.rollout.engines.versions import Versions
from dora.tasks import combine
from dora.tasks.prompts import TaskRun
from dora.wire import messages as m
from dora.wire import packed
from tests.unit.test_broker_actor import Fake, G, finished, running_broker
from tests.unit.test_broker_metrics import scrape, value
from tests.unit.test_remote_reward import Answer, Service, by_length
from tests.unit.test_rollout_actor import beat_until, welcomed_worker

pytestmark = pytest.mark.timeout(30)


def failing(_call: int, _requests: list[dict[str, Any]]) -> tuple[int, Any]:
    return 500, {"error": "down"}


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], Service]]:
    started: list[Service] = []

    def start(answer: Answer) -> Service:
        started.append(Service(answer))
        return started[-1]

    yield start
    for s in started:
        s.close()


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer().save_pretrained(path)
    return str(path)


class Engine:
    """A step engine that runs nothing: the worker only scores the samples it is handed."""

    name, version, versions = "fake", 3, Versions(1, 3, None)


def step_worker(task: TaskRun, held_out: TaskRun | None = None) -> StepWorkerEngine:
    return StepWorkerEngine(Engine(), task, held_out)  # type: ignore[arg-type]


def finish_step(w: StepWorkerEngine, texts: list[str], group: int = 0) -> list[float]:
    """A step that finished ``texts`` as samples of ``group``: scored together, their rewards."""
    samples = [Sample(group_id=group, attempt=1, index=i, prompt=[1], max_tokens=8, temperature=1.0, top_p=1.0,
                      tokens=w.task.encode(t), logprobs=[0.0] * len(w.task.encode(t)), finish=Finish.STOP)
               for i, t in enumerate(texts)]  # fmt: skip
    w.end_step(samples)
    return [w.result(s, broker_epoch=0).reward for s in w.take_finished()]


def test_reward_services_are_named_alike_on_every_worker(tokenizer: str) -> None:
    url = "http://127.0.0.1:9/score"
    assert list(combine.services(TaskRun(TaskSection(name="arithmetic", reward=url), tokenizer).reward)) == [
        "reward_service"]  # fmt: skip
    weights = {"http://127.0.0.1:9/a": 1.0, "exact": 0.5, "http://127.0.0.1:9/b": 0.25, "model": 1.0}
    section = TaskSection(name="arithmetic", reward_weights=weights, reward_model="m", reward_server=url)
    named = {name: client.url for name, client in combine.services(combine.resolve(section, None)).items()}
    assert named == {"reward_service_1": "http://127.0.0.1:9/a", "reward_service_2": "http://127.0.0.1:9/b",
                     "reward_server": url}  # fmt: skip
    one = {"http://127.0.0.1:9/a": 1.0, "exact": 0.5, "model": 1.0}
    section = TaskSection(name="arithmetic", reward_weights=one, reward_model="m", reward_server=url)
    assert list(combine.services(combine.resolve(section, None))) == ["reward_service", "reward_server"]
    assert combine.services(TaskRun(TaskSection(name="arithmetic"), tokenizer).reward) == {}  # a rule: none


def test_a_step_workers_counters_are_its_reward_services_calls_failures_and_latency(serve, tokenizer) -> None:
    good = serve(by_length)
    task = TaskRun(TaskSection(name="arithmetic", reward=good.url), tokenizer)
    held_out = TaskRun(TaskSection(name="arithmetic", reward=good.url), tokenizer)
    w = step_worker(task, held_out)
    assert w.counters()["reward_service_calls"] == 0
    assert finish_step(w, ["12", "345", "6"]) == [2.0, 3.0, 1.0]
    held_out.score_many([(0, held_out.encode("78"))])  # the held-out rows' client calls the service too
    counted = w.counters()
    assert counted["reward_service_calls"] == len(good.batches) >= 2  # one POST per batch, none retried
    assert counted["reward_service_samples"] == 4 and counted["reward_service_failures"] == 0
    assert 0 < counted["reward_service_latency_s_sum"] < 5

    before = len(good.batches)
    bad = serve(failing)
    weights = {good.url: 1.0, bad.url: 1.0}
    w = step_worker(TaskRun(TaskSection(name="arithmetic", reward_weights=weights, reward_service_retries=1),
                            tokenizer))  # fmt: skip
    assert finish_step(w, ["12", "3"]) == [0.0, 0.0]  # a source failed: the samples score 0
    counted = w.counters()
    assert counted["reward_service_1_calls"] == len(good.batches) - before
    assert counted["reward_service_1_failures"] == 0
    failed = counted["reward_service_2_failures"]  # batches: each tried twice (retries 1), then failed
    assert failed >= 1 and counted["reward_service_2_calls"] == len(bad.batches) == 2 * failed
    assert counted["reward_service_2_retries"] == failed and counted["reward_service_2_samples"] == 2
    assert "reward_service_calls" not in counted


async def test_the_worker_sends_its_engines_counters_in_heartbeats_and_none_without_any(serve, tokenizer) -> None:
    service = serve(by_length)
    scorer = step_worker(TaskRun(TaskSection(name="arithmetic", reward=service.url), tokenizer))
    async with welcomed_worker("run.time_scale=0.0001", "engine.load_s=0") as (broker, worker, _):
        hb = await beat_until(broker, lambda hb: True)
        assert hb.counted() == {}  # the sim engine counts nothing: no counters travel
        worker.engine.counters = scorer.counters  # type: ignore[method-assign]
        finish_step(scorer, ["12", "345"])
        hb = await beat_until(broker, lambda hb: hb.counted())
        assert hb.counted() == scorer.counters() and hb.counted()["reward_service_samples"] == 2


def test_the_sums_never_go_down_across_reconnects_and_restarts() -> None:
    c = WorkerCounters()
    a, a_restarted, b = ("w-a", "n1", 10), ("w-a", "n1", 11), ("w-b", "n2", 10)
    c.update(a, {"reward_service_calls": 3.0})
    c.update(b, {"reward_service_calls": 2.0, "agent_failed": 1.0})
    c.update(a, {"reward_service_calls": 5.0})  # the same process in a new session: it goes on counting
    assert c.totals() == {"agent_failed": 1.0, "reward_service_calls": 7.0}
    c.update(a_restarted, {"reward_service_calls": 1.0})  # a restart starts at 0; the one gone keeps its 5
    assert c.totals()["reward_service_calls"] == 8.0
    c.update(b, {"reward_service_calls": 1.0, "agent_failed": 1.0})  # its pid reused by a restart: a new start
    assert c.totals() == {"agent_failed": 1.0, "reward_service_calls": 9.0}


async def counting_worker(w: Fake, counters: list[dict[str, float]], pid: int) -> None:
    """Join as process ``pid``, report each of ``counters`` in a heartbeat, then finish every group it is given."""
    await w.send(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id="rollout/a", pid=pid,
                         host="test", slots=2 * G, engine="fake"))  # fmt: skip
    await w.recv(m.Welcome)
    for c in counters:
        await w.send(m.Heartbeat(counters=c))
    while True:
        msg = await w.recv(timeout_s=60)
        match msg:
            case m.Assign():
                await w.send(m.WeightsLoaded(version=msg.version, load_s=0.0))
            case m.Generate():
                await w.send(packed.pack_samples([finished(msg, i, epoch=7) for i in range(G)]))


async def test_the_broker_sums_its_workers_counters_into_prometheus_and_each_train_step(tmp_path) -> None:
    metrics_file = tmp_path / "metrics.jsonl"
    async with running_broker(f"broker.metrics_file={metrics_file}", "broker.exit_when_done=false",
                              "core.total_steps=2") as (actor, ep, ctx):  # fmt: skip
        server, url = await serve_http(actor.metrics.registry, "127.0.0.1:0")
        try:
            first = Fake(ctx, ep, "rollout/a/1")
            before = {"reward_service_calls": 4.0, "reward_service_latency_s_sum": 0.5, "agent_failed": 1.0}
            await counting_worker_until_counted(first, before, actor)
            await first.send(m.Goodbye(reason="restarting"))  # the process restarts: it counts from 0 again
            again = Fake(ctx, ep, "rollout/a/2")
            task = asyncio.create_task(counting_worker(again, [{"reward_service_calls": 1.0}], os.getpid() + 1))
            learner = Fake(ctx, ep, "learner/x")
            await learner.hello(m.Role.LEARNER)
            for step in range(2):
                await learner.send(m.RequestBatch(step=step))
                await learner.recv(m.TrainBatch)
                await learner.send(m.WeightsPublished(version=step + 1, uri="sim://v", sha256="0" * 8, metrics={}))
                await learner.recv(m.PublishAck)
            got = await scrape(url)
            snap = actor.snapshot()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        finally:
            server.close()

    def counted(name: str) -> float:
        return value(got, "dora_worker_counters", "dora_worker_counters_total", name=name)

    assert counted("reward_service_calls") == 5.0 and counted("reward_service_latency_s_sum") == 0.5
    assert counted("agent_failed") == 1.0
    rows = [json.loads(x) for x in metrics_file.read_text().splitlines()]
    assert [r["worker_counters"] for r in rows] == [
        {"agent_failed": 1.0, "reward_service_calls": 5.0, "reward_service_latency_s_sum": 0.5}] * 2  # fmt: skip
    scalars = step_scalars(rows[-1], learner=())  # TensorBoard's and wandb's names
    assert scalars["worker/reward_service_calls"] == 5.0 and scalars["worker/agent_failed"] == 1.0
    shown = io.StringIO()  # and `dora status` shows them
    render(snap, Console(file=shown, width=200))
    assert ("workers counted: agent_failed 1  reward_service_calls 5  reward_service_latency_s_sum 0.5"
            in shown.getvalue().splitlines()), shown.getvalue()  # fmt: skip


async def counting_worker_until_counted(w: Fake, counters: dict[str, float], actor: Any) -> None:
    """Join as this process, report ``counters`` and wait until the broker has them (before it leases anything
    to it: a worker with no groups leaves cleanly)."""
    await w.send(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id="rollout/a", pid=os.getpid(),
                         host="test", slots=2 * G, engine="fake"))  # fmt: skip
    await w.recv(m.Welcome)
    await w.send(m.Heartbeat(counters=counters))
    async with asyncio.timeout(5):
        while actor.metrics.workers.totals() != counters:
            await asyncio.sleep(0.01)
