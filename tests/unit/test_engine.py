"""The simulator's timing model: engine batching, KV limits, preemption, prefill, versions; DES time."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.ids import Mode
from dora.sim.des import Simulation
from dora.sim.engine import Engine, Request, decode_step_s
from dora.sim.metrics import summarize
from dora.sim.runner import simulate
from tests.unit.simcfg import small


def req(length: int, prompt: int = 10, group: int = 0, index: int = 0) -> Request:
    return Request(group_id=group, attempt=1, index=index, length=length, prompt_len=prompt)


def drain(e: Engine, limit: int = 10_000) -> list[Request]:
    done = []
    for _ in range(limit):
        step = e.steps_to_next()
        if step is None:
            return done
        e.advance(step)
        finished, _ = e.settle()
        done += finished
    raise AssertionError("engine made no progress")


def test_running_requests_advance_together_and_finish_in_length_order():
    e = Engine(max_slots=4, kv_budget_tokens=10_000)
    e.version = 7
    assert e.submit([req(5, index=0), req(3, index=1)]) == 20, "both prompts are prefilled on admission"
    assert e.steps_to_next() == pytest.approx(3)
    e.advance(3)
    (first,), _ = e.settle()
    assert first.index == 1 and first.segments() == ((7, 3),)
    assert e.steps_to_next() == pytest.approx(2)
    e.advance(2)
    (second,), _ = e.settle()
    assert second.segments() == ((7, 5),) and len(e) == 0


def test_slots_cap_the_batch_and_the_queue_waits_in_order():
    e = Engine(max_slots=2, kv_budget_tokens=10_000)
    e.version = 0
    assert e.submit([req(2, index=0), req(4, index=1), req(1, index=2)]) == 20
    assert len(e.running) == 2 and [r.index for r in e.waiting] == [2]
    e.advance(2)
    done, prefill = e.settle()
    assert [r.index for r in done] == [0] and prefill == 10, "the waiting request is admitted when a slot frees"
    assert [r.index for r in drain(e)] == [2, 1]


def test_kv_overflow_preempts_the_newest_request_which_reprefills_its_prefix():
    e = Engine(max_slots=8, kv_budget_tokens=40)
    e.version = 0
    e.submit([req(30, prompt=5, index=0), req(30, prompt=5, index=1)])
    step = e.steps_to_next()
    assert step == pytest.approx((40 - 10 - 2) / 2), "next step must fit one token per running request"
    e.advance(step)
    done, prefill = e.settle()
    assert not done and e.preemptions == 1 and [r.index for r in e.waiting] == [1]
    assert prefill == 0, "the victim cannot come back while the survivor still needs the room"
    finished = drain(e)
    assert [r.index for r in finished] == [0, 1] and all(r.segments() == ((0, 30),) for r in finished)


def test_weight_swap_splits_the_version_history_and_costs_a_reprefill():
    e = Engine(max_slots=4, kv_budget_tokens=10_000)
    e.version = 1
    e.submit([req(10, prompt=6)])
    e.advance(4)
    e.settle()
    assert e.swap_weights(2) == 6 + 4
    (r,) = drain(e)
    assert r.segments() == ((1, 4), (2, 6))


def test_exported_requests_resume_elsewhere_with_their_prefix():
    a, b = Engine(4, 10_000), Engine(4, 10_000)
    a.version = b.version = 3
    a.submit([req(9, group=5)])
    a.advance(4)
    a.settle()
    (moved,) = a.remove(5, 1)
    assert moved.generated == pytest.approx(4) and len(a) == 0
    moved.has_kv = True
    assert b.submit([moved]) == 0, "with its KV shipped the target does not prefill"
    (r,) = drain(b)
    assert r.segments() == ((3, 9),)


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 300), min_size=1, max_size=30),
    prompts=st.integers(1, 50),
    slots=st.integers(1, 12),
    budget=st.integers(60, 3000),
)
def test_engine_always_finishes_every_request_with_exactly_its_tokens(lengths, prompts, slots, budget):
    e = Engine(max_slots=slots, kv_budget_tokens=budget)
    e.version = 0
    e.submit([req(n, prompt=prompts, index=i) for i, n in enumerate(lengths)])
    done = drain(e, limit=100_000)
    assert sorted(r.index for r in done) == list(range(len(lengths)))
    assert all(r.segments() == ((0, r.length),) for r in done)


# ---------------------------------------------------------------- the discrete-event driver


def test_one_request_takes_prefill_plus_length_decode_steps():
    cfg = small(workers=1, credit=1, steps=1, train_groups=1, group_size=1, median=50, sigma=0.0,
                difficulty_sigma=0.0, load_s=1.0, train_s=2.0, prefill_s_per_token=0.01)  # fmt: skip
    o = Simulation(cfg, Mode.SYNC).run()
    (step,) = o.steps
    prompt = step.tokens - step.response_tokens
    assert step.response_tokens == 50
    assert step.delivered_s == pytest.approx(1.0 + prompt * 0.01 + 50 * decode_step_s(cfg.engine, 1))
    assert o.wall_s == pytest.approx(step.delivered_s + 2.0)


def test_colocated_rollout_pauses_while_the_same_accelerators_train():
    base = small(workers=2, credit=6, steps=3, k=1, train_groups=2, group_size=3, sigma=1.5, train_s=50.0)
    colo = replace(base, cluster=replace(base.cluster, placement={"partial": "colocated"}))
    o = Simulation(colo, Mode.PARTIAL).run()
    end = o.totals_at_step[-1]
    assert end.trainer_busy_s > 0 and end.rollout_active_s == pytest.approx(end.rollout_only_s), (
        "colocated: no decoding while training"
    )
    m = summarize(o, colo)
    assert m["placement"] == "colocated" and m["trainer_gpus"] == base.cluster.total_gpus
    apart = Simulation(base, Mode.PARTIAL).run().totals_at_step[-1]
    assert apart.rollout_active_s > apart.rollout_only_s + 1.0, "disaggregated: rollout overlaps training"


def test_same_seed_same_json():
    cfg = small(workers=3, credit=9, steps=4, k=2, sigma=1.3, seed=11)
    a = json.dumps(simulate(cfg, Mode.DORA).metrics, sort_keys=True)
    b = json.dumps(simulate(cfg, Mode.DORA).metrics, sort_keys=True)
    assert a == b
    c = json.dumps(simulate(replace(cfg, run=replace(cfg.run, seed=12)), Mode.DORA).metrics, sort_keys=True)
    assert a != c


def test_split_search_reports_every_split_it_tried_and_picks_the_fastest():
    from dora.sim.runner import best_split

    cfg = small(workers=5, credit=9, steps=4, k=2, train_groups=4, sigma=1.2, train_s=20.0)
    cfg = replace(cfg, cluster=replace(cfg.cluster, total_gpus=8, rollout_gpus=None))
    best, tried = best_split(cfg, Mode.DORA)
    assert tried and best in {g for g, _ in tried}
    assert dict(tried)[best] == max(t for _, t in tried)
    assert all(1 <= g <= 7 for g, _ in tried)
