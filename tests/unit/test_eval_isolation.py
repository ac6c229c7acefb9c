"""Held-out evaluation changes no training decision: the core driven through a whole run twice, on the same
events, once alone and once with the broker's evaluation rounds planning, sending and closing rounds after
every event; every action the core takes, and its state at the end, are the same. Plus the rounds' own rules:
every row once per round, on the round's version only, a retired version's round never reported half done."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.broker.evaluation import BrokerEval, EvalRounds
from dora.config import CoreConfig
from dora.core.events import VersionPublished
from dora.ids import Mode, WorkerId
from dora.sim.workload import Workload
from dora.wire import messages as m
from tests.unit.machine import Harness

ROWS = 5


def rounds(every: int, samples: int = 2) -> EvalRounds:
    prompts = [np.arange(3, dtype=np.int32) + i for i in range(ROWS)]
    return EvalRounds(prompts, every_steps=every, samples=samples, temperature=0.7, max_tokens=8, seed=0,
                      retry_s=3.0)  # fmt: skip


def answer(msg: m.Evaluate, correct: int) -> m.EvalFinished:
    rewards = np.array([1.0] * correct + [0.0] * (msg.n_samples - correct), dtype=np.float32)
    return m.EvalFinished(version=msg.version, round=msg.round, row=msg.row, rewards=rewards,
                          lengths=np.full(msg.n_samples, 4, dtype=np.int32))  # fmt: skip


def drive(cfg: CoreConfig, seed: int, slots: int, workers: int, evaluate: bool, answer_seed: int):
    """The core's every action over a whole run; with ``evaluate``, the evaluation rounds work beside it."""
    h = Harness(cfg=cfg, slots=slots, workload=Workload.lognormal(median=8, sigma=1.0, difficulty_sigma=0.7,
                                                                  cap=200, seed=seed, prompt_tokens=4))  # fmt: skip
    log: list[str] = []
    sent: list[tuple[WorkerId, m.Evaluate]] = []
    reports: list[dict] = []
    evals = BrokerEval(rounds(every=2), h.core, lambda w, msg: sent.append((w, msg)), reports.append)
    rng = random.Random(answer_seed)
    feed = h.feed

    def feed_and_evaluate(event):
        actions = feed(event)
        log.append(f"{event!r} -> {actions!r}")
        if evaluate:
            if isinstance(event, VersionPublished):
                evals.published(event.version, h.now)
            evals.tick(h.now)
            while sent and rng.random() < 0.7:  # answers come back in any order, some late
                _, msg = sent.pop(rng.randrange(len(sent)))
                evals.finished(answer(msg, rng.randrange(msg.n_samples + 1)))
            if rng.random() < 0.05 and sent:
                evals.worker_lost(sent[0][0])
        return actions

    h.feed = feed_and_evaluate
    for _ in range(workers):
        h.feed(h.world.join(h.slots))
    h.drain()
    h.check_end()
    return log, h.core.scheduler.cursor, h.core.ledger.alive(), sorted(h.world.learner.trained), reports


@settings(max_examples=25, deadline=None)
@given(
    mode=st.sampled_from([Mode.DORA, Mode.SYNC, Mode.ONE_STEP]),
    k=st.integers(0, 3),
    seed=st.integers(0, 2**16),
    workers=st.integers(1, 4),
    answer_seed=st.integers(0, 2**16),
)
def test_evaluation_rounds_change_no_training_decision(mode, k, seed, workers, answer_seed):
    if mode is Mode.SYNC:
        k = 0
    cfg = CoreConfig(mode=mode, max_staleness=k if mode is not Mode.ONE_STEP else 1, train_groups=2, group_size=2,
                     total_steps=6)  # fmt: skip
    alone = drive(cfg, seed, 4, workers, evaluate=False, answer_seed=answer_seed)
    beside = drive(cfg, seed, 4, workers, evaluate=True, answer_seed=answer_seed)
    assert alone[0] == beside[0]  # every event and every action, in order
    assert alone[1:4] == beside[1:4]
    closed = [r for r in beside[4] if not r.get("dropped")]
    assert alone[4] == [] and closed and all(r["rows"] == ROWS for r in closed)  # rounds did close, whole
    assert len({r["version"] for r in beside[4]}) == len(beside[4])  # each version closed or dropped at most once


def test_the_isolation_check_sees_a_difference_when_there_is_one():
    """The comparison above is not vacuous: a run with one more worker takes other actions."""
    cfg = CoreConfig(mode=Mode.DORA, max_staleness=2, train_groups=2, group_size=2, total_steps=6)
    assert drive(cfg, 1, 4, 2, False, 0)[0] != drive(cfg, 1, 4, 3, False, 0)[0]


def test_a_round_sends_every_row_once_to_the_ready_workers_of_its_version_and_reports_once():
    r = rounds(every=2)
    assert r.published(0, 0.0) and not r.published(1, 0.0) and r.published(2, 0.0) and not r.published(2, 1.0)
    sends = r.plan(1.0, {0: [WorkerId("a"), WorkerId("b")], 1: [WorkerId("c")]})
    assert sorted((msg.version, msg.row) for _, msg in sends) == [(0, row) for row in range(ROWS)]
    assert {w for w, _ in sends} == {"a", "b"} and r.plan(1.5, {0: [WorkerId("a")]}) == []
    done = [r.finished(answer(msg, 1)) for _, msg in sends]
    assert done[:-1] == [None] * (ROWS - 1) and done[-1]["version"] == 0
    assert done[-1]["accuracy"] == 0.5 and done[-1]["pass@2"] == 1.0 and done[-1]["rows"] == ROWS
    assert r.finished(answer(sends[0][1], 2)) is None  # a late copy of a closed round


def test_rows_out_too_long_or_at_a_lost_worker_go_again_and_a_retired_round_with_rows_left_is_dropped():
    r = rounds(every=1)
    r.published(3, 0.0)
    first = r.plan(0.0, {3: [WorkerId("a"), WorkerId("b")]})
    r.worker_lost(WorkerId("a"))
    again = r.plan(1.0, {3: [WorkerId("b")]})
    assert sorted(msg.row for _, msg in again) == sorted(msg.row for w, msg in first if w == "a")
    assert r.plan(2.0, {3: [WorkerId("b")]}) == [] and len(r.plan(4.5, {3: [WorkerId("b")]})) == ROWS
    assert r.drop_retired(lambda v: False, 5.0) == []  # every row is out: the answers may still come
    r.finished(answer(first[0][1], 1))
    assert r.drop_retired(lambda v: False, 20.0) == [3] and r.rounds == {}


def test_answers_of_another_size_are_refused():
    r = rounds(every=1, samples=2)
    r.published(0, 0.0)
    [(_, msg), *_] = r.plan(0.0, {0: [WorkerId("a")]})
    odd = m.EvalFinished(version=0, round=0, row=msg.row, rewards=np.ones(3, np.float32), lengths=np.ones(3, np.int32))
    assert r.finished(odd) is None and msg.row not in r.rounds[0].results


async def test_a_live_broker_sends_a_round_to_its_worker_and_records_the_answers(tmp_path):
    """The actor's side: the round for version 0 goes out once the worker is ready, beside its leases and
    without taking any of its slots; the answers close the round into the eval file and the gauge."""
    import asyncio
    import json

    from tests.unit.test_broker_actor import Fake, G, running_broker

    path = tmp_path / "eval.jsonl"
    async with running_broker(f"broker.eval_file={path}", evals=rounds(every=5, samples=1)) as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        await w.worker(slots=2 * G)
        asks = [await w.recv(m.Evaluate) for _ in range(ROWS)]
        assert sorted(a.row for a in asks) == list(range(ROWS)) and {a.version for a in asks} == {0}
        assert actor.snapshot()["workers"]["rollout/a/1"]["used"] == 2 * G  # its leases alone fill its slots
        for a in asks:
            await w.send(answer(a, 1 if a.row < 2 else 0))
        for _ in range(100):
            if path.exists() and path.read_text():
                break
            await asyncio.sleep(0.02)
        [line] = [json.loads(x) for x in path.read_text().splitlines()]
        assert line["version"] == line["step"] == 0 and line["rows"] == ROWS and line["accuracy"] == 2 / ROWS
        assert actor.metrics.held_out["accuracy"] == 2 / ROWS


async def test_a_dropped_round_is_counted_and_on_the_timeline_never_in_the_eval_file(tmp_path):
    import json

    from tests.unit.test_broker_actor import running_broker

    files = f"broker.eval_file={tmp_path / 'eval.jsonl'}", f"broker.timeline_file={tmp_path / 'timeline.jsonl'}"
    async with running_broker(*files, evals=rounds(every=1)) as (actor, _, _):
        actor.metrics.eval_round({"version": 3, "dropped": True})
        assert actor.metrics.registry.get_sample_value("dora_eval_rounds_dropped_total") == 1.0
    events = [json.loads(x) for x in (tmp_path / "timeline.jsonl").read_text().splitlines()]
    assert {"event": "eval_round_dropped", "version": 3} in [{k: e[k] for k in ("event", "version") if k in e}
                                                             for e in events]  # fmt: skip
    assert (tmp_path / "eval.jsonl").read_text() == ""


def test_an_open_round_can_close_while_its_rows_are_out_or_its_version_has_a_ready_worker():
    r = rounds(every=1)
    r.published(2, 0.0)
    assert r.answerable({2: [WorkerId("a")]}, 0.0) and not r.answerable({}, 0.0)  # rows left, nobody to take them
    r.plan(0.0, {2: [WorkerId("a")]})
    assert r.answerable({}, 1.0)  # every row out: the answers may still come
    assert not r.answerable({}, 3.5)  # out too long, and no worker of the version left
    r.published(3, 4.0)
    assert r.abandon() == ([2], [3]) and r.rounds == {} and r.dropped == [2]  # round 3 never started


async def end_of_run(tmp_path, retry_s: float, answer_rows: bool):
    """A one-step run whose worker holds the version-0 round's rows when the step is published; the worker
    answers them (``answer_rows``) or never does. What the broker writes, and how long after the rows reached
    the worker it says goodbye."""
    import asyncio
    import contextlib
    import json

    from tests.unit.test_broker_actor import Fake, finished, running_broker

    path = tmp_path / "eval.jsonl"
    evals = rounds(every=1, samples=1)
    evals.retry_s = retry_s
    async with running_broker(f"broker.eval_file={path}", "core.total_steps=1", evals=evals) as (actor, ep, ctx):
        w = Fake(ctx, ep, "rollout/a/1")
        await w.worker(slots=64)
        learner = Fake(ctx, ep, "learner/x")
        await learner.hello(m.Role.LEARNER)
        await learner.send(m.RequestBatch(step=0))
        asks = [await w.recv(m.Evaluate) for _ in range(ROWS)]
        asked = asyncio.get_running_loop().time()
        batch = None
        while batch is None:
            gen = await w.recv(m.Generate)
            for i in range(gen.n_samples):
                await w.send(finished(gen, i, epoch=7))
            with contextlib.suppress(TimeoutError):
                batch = await learner.recv(m.TrainBatch, timeout_s=0.2)
        assert batch.step == 0
        await learner.send(m.WeightsPublished(version=1, uri="", sha256=""))
        if answer_rows:
            with pytest.raises(TimeoutError):  # the run is over, but the round is still open
                await learner.recv(m.Goodbye, timeout_s=0.5)
            for a in asks:
                await w.send(answer(a, 1))
        await learner.recv(m.Goodbye, timeout_s=retry_s + 5)
        waited = asyncio.get_running_loop().time() - asked
        await asyncio.wait_for(actor.done.wait(), 5)
        lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        dropped = actor.metrics.registry.get_sample_value("dora_eval_rounds_dropped_total")
    return lines, dropped, waited


async def test_the_end_of_the_run_waits_for_an_open_round_then_says_goodbye(tmp_path):
    lines, dropped, _ = await end_of_run(tmp_path, retry_s=30.0, answer_rows=True)
    assert [(x["version"], x["rows"], x["accuracy"]) for x in lines] == [(0, ROWS, 1.0)] and dropped == 0


async def test_a_round_still_unanswered_when_the_wait_runs_out_is_reported_dropped(tmp_path):
    lines, dropped, waited = await end_of_run(tmp_path, retry_s=1.0, answer_rows=False)
    assert lines == [] and dropped == 1 and waited >= 0.8  # the rows' answers were awaited retry_s
