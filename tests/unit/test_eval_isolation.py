"""Held-out evaluation changes no training decision: the core driven through a whole run twice, on the same
events, once alone and once with the broker's evaluation rounds planning, sending and closing rounds after
every event; every action the core takes, and its state at the end, are the same. Plus the rounds' own rules:
every row once per round, on the round's version only, a retired version's round never reported half done."""

from __future__ import annotations

import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.broker.evaluation import BrokerEval, EvalRounds
from dora.config import CoreConfig
from dora.core.events import WeightsPublished
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
            if isinstance(event, WeightsPublished):
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
    assert alone[4] == [] and beside[4] and all(r["rows"] == ROWS for r in beside[4])  # rounds did close
    assert len({r["version"] for r in beside[4]}) == len(beside[4])  # each version at most once


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
