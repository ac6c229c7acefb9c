"""Agentic (multi-turn, tool-using) episodes in the simulator: workload, engine, invariants, costs.

An episode is several assistant turns separated by tool calls. While its tool runs it holds its lease
(the core counts it in flight, C2) but no decode slot; it resumes with its KV cache (keep_kv) or after
re-prefilling its whole context. Every turn runs on the episode's one version (C1), except in
``partial``, where a weight swap moves the rest of the episode to new weights and is counted.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from dora.config import ConfigError, load
from dora.config.sim import SimConfig, WorkloadSection
from dora.ids import Mode
from dora.sim.des import Simulation
from dora.sim.engine import Engine, Request, decode_step_s
from dora.sim.metrics import summarize
from dora.sim.runner import simulate
from dora.sim.workload import Episode, Workload
from tests.unit.simcfg import SIM_EXAMPLES, small
from tests.unit.test_sim_properties import check_run

COLOCATED = {m.value: "colocated" for m in Mode}


def agentic(
    cfg: SimConfig,
    *,
    turns: float = 3.0,
    turns_sigma: float = 0.6,
    max_turns: int = 6,
    tool_s: float = 1.0,
    tool_sigma: float = 0.5,
    observation_tokens: float = 10.0,
    keep_kv: bool = True,
) -> SimConfig:
    wl = replace(cfg.workload, turns=turns, turns_sigma=turns_sigma, max_turns=max_turns, tool_s=tool_s,
                 tool_sigma=tool_sigma, observation_tokens=observation_tokens, observation_sigma=0.5)  # fmt: skip
    return replace(cfg, workload=wl, engine=replace(cfg.engine, keep_kv=keep_kv))


def episode_req(ends: tuple[int, ...], obs: int = 0, prompt: int = 10, index: int = 0) -> Request:
    turns = len(ends)
    return Request(group_id=0, attempt=1, index=index, length=ends[-1], prompt_len=prompt, ends=ends,
                   observations=(obs,) * (turns - 1), tools_s=(1.0,) * (turns - 1))  # fmt: skip


def run_until_parked(e: Engine) -> list[Request]:
    """Decode until some episode ends a turn (or everything finishes); returns the parked ones."""
    for _ in range(1000):
        if e.turn_ends:
            return e.take_turn_ends()
        step = e.steps_to_next()
        if step is None:
            return []
        e.advance(step)
        e.settle()
    raise AssertionError("no progress")


# ---------------------------------------------------------------- single-turn stays what it was


@pytest.mark.parametrize("mode", list(Mode))
def test_single_turn_runs_ignore_every_agentic_setting(mode):
    """max_turns = 1 is the existing path: tool, observation and KV settings change no number."""
    cfg = small(workers=3, credit=9, max_running=6, steps=4, k=2, sigma=1.3, seed=5, prefill_s_per_token=1e-3,
                kv_budget_tokens=500)  # fmt: skip
    knobs = agentic(cfg, turns=1.0, turns_sigma=0.9, max_turns=1, tool_s=7.0, tool_sigma=1.0,
                    observation_tokens=300.0, keep_kv=False)  # fmt: skip
    a = simulate(cfg, mode).metrics
    b = simulate(knobs, mode).metrics
    assert json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)
    assert a["turns_per_episode"] == 1.0 and a["mean_waiting_on_tools"] == 0 and a["resume_prefill_tokens"] == 0


def test_single_turn_workload_draws_the_lengths_it_always_drew():
    plain = Workload.lognormal(median=300.0, sigma=1.2, seed=3)
    knobs = Workload(replace(plain.spec, tool_s=2.0, tool_sigma=0.8, observation_tokens=50.0, turns_sigma=0.7), 3)
    for g, i, a in [(0, 0, 0), (5, 3, 1), (77, 15, 2)]:
        assert knobs.length(g, i, a) == plain.length(g, i, a)
        assert knobs.episode(g, i, a) == Episode(turns=(plain.length(g, i, a),))


@settings(max_examples=25, deadline=None)
@given(turns=st.integers(1, 5), seed=st.integers(0, 1000), prefill=st.sampled_from([0.0, 1e-3]))
def test_an_episode_with_instant_tools_costs_what_one_sample_of_its_length_costs(turns, seed, prefill):
    """No tool time, no observation, KV kept: the turns decode back to back, exactly the single-turn cost model
    (load + prompt prefill + length decode steps of one sequence)."""
    cfg = small(workers=1, credit=1, steps=1, train_groups=1, group_size=1, median=30, sigma=0.5,
                difficulty_sigma=0.0, load_s=1.0, train_s=2.0, prefill_s_per_token=prefill, seed=seed)  # fmt: skip
    cfg = agentic(cfg, turns=turns, turns_sigma=0.0, max_turns=max(turns, 2), tool_s=0.0, observation_tokens=0.0)
    o = Simulation(cfg, Mode.SYNC, strict=True).run()
    (step,) = o.steps
    prompt = step.tokens - step.response_tokens
    assert step.turns == turns
    expect = 1.0 + prompt * prefill + step.response_tokens * decode_step_s(cfg.engine, 1)
    assert step.delivered_s == pytest.approx(expect, rel=1e-9, abs=1e-6)


# ---------------------------------------------------------------- workload


@settings(max_examples=60, deadline=None)
@given(
    turns=st.floats(1.0, 6.0),
    extra=st.integers(0, 10),
    sigma=st.floats(0.0, 1.5),
    cap=st.integers(1, 5000),
    group=st.integers(0, 10_000),
    index=st.integers(0, 15),
    tool_s=st.floats(0.0, 5.0),
    scale=st.floats(0.1, 10.0),
)
def test_episodes_have_their_shape_and_a_latency_sweep_keeps_their_tokens(
    turns, extra, sigma, cap, group, index, tool_s, scale
):
    max_turns = max(2, math.ceil(turns) + extra)
    wl = Workload.lognormal(median=200.0, sigma=1.0, cap=cap, seed=1, turns=turns, turns_sigma=sigma,
                            max_turns=max_turns, tool_s=tool_s, tool_sigma=0.8, observation_tokens=40.0,
                            observation_sigma=0.6)  # fmt: skip
    ep = wl.episode(group, index, 0)
    assert 1 <= len(ep.turns) <= max_turns and all(n >= 1 for n in ep.turns)
    assert ep.length <= cap and ep.length == wl.length(group, index, 0)
    assert len(ep.observations) == len(ep.tools_s) == len(ep.turns) - 1
    assert all(n >= 0 for n in ep.observations) and all(t >= 0 for t in ep.tools_s)
    assert ep == wl.episode(group, index, 0), "a pure function of (seed, group, sample, attempt)"
    other = Workload(replace(wl.spec, tool_s=tool_s * scale), wl.seed).episode(group, index, 0)
    assert (other.turns, other.observations) == (ep.turns, ep.observations)
    assert other.tools_s == pytest.approx([t * scale for t in ep.tools_s])


def test_workload_settings_are_checked():
    with pytest.raises(ConfigError, match="turns <= max_turns"):
        WorkloadSection(turns=4.0)
    with pytest.raises(ConfigError, match=">= 0"):
        WorkloadSection(max_turns=4, tool_s=-1.0)
    wl = Workload(load(SimConfig, path="examples/sim/agentic.toml").workload, seed=0)
    assert wl.multi_turn and wl.spec.max_turns == 16


# ---------------------------------------------------------------- engine


@settings(max_examples=50, deadline=None)
@given(first=st.integers(1, 50), second=st.integers(1, 50), other=st.integers(1, 200), wait=st.floats(0, 500))
def test_an_episode_waiting_on_a_tool_frees_its_slot_for_the_others(first, second, other, wait):
    """One slot: the other request decodes while the episode's tool runs, and finishes exactly when it would
    have if the episode did not exist after its first turn, however long the tool takes."""
    e = Engine(max_slots=1, kv_budget_tokens=100_000)
    e.version = 0
    ep = episode_req((first, first + second), index=0)
    b = Request(group_id=0, attempt=1, index=1, length=other, prompt_len=10)
    e.submit([ep, b])
    assert run_until_parked(e) == [ep] and e.counter == pytest.approx(first)
    assert list(e.running.values()) == [b] and len(e) == 2, "parked: no slot, still held"
    finished_at = {}

    def decode(until: float) -> None:
        while e.running and e.counter < until - 1e-9:
            e.advance(min(e.steps_to_next(), until - e.counter))
            finished_at.update((r.index, e.counter) for r in e.settle()[0])

    decode(first + wait)  # the tool answers `wait` decode steps later
    assert e.resume(ep) == 0, "its KV was kept and the tool result is empty"
    decode(float("inf"))
    assert finished_at[1] == pytest.approx(first + other), "the other request never waited for the episode"
    assert b.segments() == ((0, other),) and ep.segments() == ((0, first + second),)


def test_without_kv_the_resumed_episode_reprefills_its_context_and_with_it_only_the_observation():
    for keep, expect in ((True, 7), (False, 10 + 4 + 7)):
        e = Engine(max_slots=2, kv_budget_tokens=100_000, keep_kv=keep)
        e.version = 0
        ep = episode_req((4, 9), obs=7)
        e.submit([ep])
        run_until_parked(e)
        assert e.resume(ep) == expect
        assert e.resume_prefill == (0 if keep else 14)
        e.advance(e.steps_to_next())
        (done,), _ = e.settle()
        assert done.segments() == ((0, 9),) and done.context == 10 + 7 + 9


def test_running_sequences_evict_a_parked_cache_before_anything_is_preempted():
    e = Engine(max_slots=4, kv_budget_tokens=60, kv_watermark=0.0)
    e.version = 0
    ep = episode_req((5, 10), prompt=10)
    big = Request(group_id=1, attempt=1, index=0, length=45, prompt_len=5)
    e.submit([ep, big])
    run_until_parked(e)
    assert e.parked_kv == 15
    for _ in range(100):
        if e.evictions:
            break
        e.advance(e.steps_to_next())
        e.settle()
    assert e.evictions == 1 and e.preemptions == 0 and not ep.has_kv and e.parked_kv == 0
    e.resume(ep)
    assert e.resume_prefill == 15, "its whole prefix is re-prefilled when it runs again"


def test_a_weight_swap_during_a_tool_call_moves_the_next_turn_to_the_new_version():
    """partial: the episode's later turns run on the new weights (a C1 violation), after a full re-prefill."""
    e = Engine(max_slots=2, kv_budget_tokens=100_000)
    e.version = 1
    ep = episode_req((4, 9), obs=3)
    e.submit([ep])
    run_until_parked(e)
    assert e.swap_weights(2) == 0, "nothing runs: the parked episode pays when it resumes"
    assert e.resume(ep) == 10 + 4 + 3
    e.advance(e.steps_to_next())
    e.settle()
    assert ep.segments() == ((1, 4), (2, 5))


def test_a_waiting_episode_migrates_with_its_state_and_its_tool_result_finds_it():
    a, b = Engine(2, 100_000), Engine(2, 100_000)
    a.version = b.version = 3
    ep = episode_req((4, 9), obs=2)
    a.submit([ep])
    run_until_parked(a)
    (moved,) = a.remove(0, 1)
    assert moved is ep and len(a) == 0 and a.parked_kv == 0
    assert b.submit([moved]) == 0 and b.is_parked(ep), "still waiting on its tool, now on b"
    assert b.resume(ep) == 2, "KV shipped with it: only the observation is prefilled"
    b.advance(b.steps_to_next())
    b.settle()
    assert ep.segments() == ((3, 9),)
    # its tool answered while it was in transit: the target resumes it at once
    c, d = Engine(2, 100_000), Engine(2, 100_000)
    c.version = d.version = 0
    ep2 = episode_req((4, 9))
    c.submit([ep2])
    run_until_parked(c)
    (moved,) = c.remove(0, 1)
    moved.tool_back = True
    d.submit([moved])
    assert not d.is_parked(ep2) and list(d.running.values()) == [ep2]


# ---------------------------------------------------------------- whole runs: invariants


KEEPERS = [Mode.DORA, Mode.DORA, Mode.PARTIAL, Mode.ONE_STEP, Mode.SYNC]


@settings(max_examples=SIM_EXAMPLES // 2, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(KEEPERS),
    colocated=st.booleans(),
    k=st.integers(0, 3),
    train_groups=st.integers(1, 6),
    group_size=st.integers(1, 4),
    steps=st.integers(2, 6),
    workers=st.integers(1, 6),
    slot_groups=st.integers(1, 3),
    running_frac=st.floats(0.3, 1.0),
    kv=st.one_of(st.none(), st.integers(60, 600)),
    turns=st.floats(1.0, 4.0),
    tool_s=st.floats(0.0, 20.0),
    keep_kv=st.booleans(),
    kv_transfer=st.booleans(),
    deaths=st.lists(st.tuples(st.floats(0.0, 200.0), st.integers(0, 99)), max_size=3),
    seed=st.integers(0, 2**20),
)
def test_agentic_runs_keep_every_invariant(
    mode, colocated, k, train_groups, group_size, steps, workers, slot_groups, running_frac, kv, turns, tool_s,
    keep_kv, kv_transfer, deaths, seed,
):  # fmt: skip
    """C1 per episode (the world refuses a mixed one outside partial), C2 (every group trained whole, waiting
    episodes included), C3, at most K + 1 versions, and the run ends."""
    credit = slot_groups * group_size
    cfg = small(
        workers=workers, credit=credit, max_running=max(1, round(credit * running_frac)), steps=steps, k=k,
        train_groups=train_groups, group_size=group_size, sigma=1.0, median=15, train_s=5.0, tick_s=1.5,
        restart_s=2.0, seed=seed, prefill_s_per_token=1e-3, kv_budget_tokens=kv or 1 << 40,
        placement=COLOCATED if colocated else None,
    )  # fmt: skip
    cfg = agentic(cfg, turns=turns, max_turns=6, tool_s=tool_s, keep_kv=keep_kv)
    cfg = replace(cfg, engine=replace(cfg.engine, kv_transfer=kv_transfer))
    sim = Simulation(cfg, mode, deaths=tuple(sorted(deaths)), strict=True)
    o = sim.run()
    check_run(o, cfg, mode)
    assert all(s.turns >= s.episodes for s in o.steps)
    event(f"mode={mode.value}")
    event(f"migrated waiting episodes={'yes' if sim.world.migrated_waiting else 'no'}")
    event(f"mixed-version episodes={'yes' if o.mixed_version_trajectories else 'no'}")


@settings(max_examples=SIM_EXAMPLES // 5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    k=st.integers(1, 3),
    workers=st.integers(4, 8),
    keep_kv=st.booleans(),
    kv_transfer=st.booleans(),
    seed=st.integers(0, 2**20),
)
def test_dora_fleets_migrate_waiting_episodes_on_their_version(k, workers, keep_kv, kv_transfer, seed):
    cfg = small(workers=workers, credit=12, steps=6, k=k, train_groups=6, group_size=3, sigma=1.4, median=20,
                cap=3000, train_s=4.0, seed=seed, prefill_s_per_token=1e-3)  # fmt: skip
    cfg = agentic(cfg, turns=3.0, max_turns=10, tool_s=3.0, keep_kv=keep_kv)
    cfg = replace(cfg, engine=replace(cfg.engine, kv_transfer=kv_transfer))
    sim = Simulation(cfg, Mode.DORA, strict=True)
    check_run(sim.run(), cfg, Mode.DORA)
    event(f"migrated waiting episodes={'yes' if sim.world.migrated_waiting else 'no'}")


def test_dora_migrates_episodes_that_wait_on_tools():
    cfg = small(workers=6, credit=12, steps=6, k=2, train_groups=6, group_size=3, sigma=1.4, median=20, cap=3000,
                train_s=4.0, seed=1, prefill_s_per_token=1e-3)  # fmt: skip
    cfg = agentic(cfg, turns=3.0, max_turns=10, tool_s=3.0)
    sim = Simulation(cfg, Mode.DORA, strict=True)
    o = sim.run()
    check_run(o, cfg, Mode.DORA)
    assert sim.world.migrated_waiting > 0 and o.c1_violations == 0


def test_partial_counts_the_episodes_whose_later_turns_ran_on_newer_weights():
    cfg = small(workers=3, credit=9, steps=5, k=2, train_groups=3, group_size=3, median=20, sigma=0.8,
                train_s=2.0, prefill_s_per_token=1e-3, placement=COLOCATED)  # fmt: skip
    cfg = agentic(cfg, turns=4.0, turns_sigma=0.3, max_turns=8, tool_s=5.0, tool_sigma=0.3)
    o = Simulation(cfg, Mode.PARTIAL, strict=True).run()
    check_run(o, cfg, Mode.PARTIAL)
    assert o.c1_violations > 0 and o.mixed_version_trajectories > 0
    assert o.resume_prefill_tokens > 0, "the swap dropped the waiting episodes' caches"
    for mode in (Mode.SYNC, Mode.ONE_STEP, Mode.DORA):  # the same workload keeps C1 everywhere else
        assert Simulation(cfg, mode, strict=True).run().c1_violations == 0


# ---------------------------------------------------------------- whole runs: costs


def test_a_waiting_episode_holds_no_slot_in_a_run():
    """One worker with one decode slot, four 2-turn episodes, 1,000 s tools: holding the slot through the tool call
    would take at least 4 x 1,000 s; the run takes one tool call plus the decoding."""
    cfg = small(workers=1, credit=4, max_running=1, steps=1, train_groups=1, group_size=4, median=20, sigma=0.3,
                difficulty_sigma=0.0, train_s=1.0)  # fmt: skip
    cfg = agentic(cfg, turns=2.0, turns_sigma=0.0, max_turns=2, tool_s=1000.0, tool_sigma=0.0, observation_tokens=0.0)
    o = Simulation(cfg, Mode.SYNC, strict=True).run()
    (step,) = o.steps
    assert step.turns == 8
    decode = step.response_tokens * decode_step_s(cfg.engine, 1)
    assert 1000.0 < step.delivered_s <= 1000.0 + decode + cfg.engine.load_s + 1e-6
    m = summarize(o, cfg)
    assert m["mean_waiting_on_tools"] > 3.0 and m["turns_per_episode"] == 2.0


def test_keep_kv_false_costs_reprefill_time():
    cfg = small(workers=2, credit=6, steps=3, k=1, train_groups=2, group_size=3, median=40, sigma=0.5,
                train_s=1.0, prefill_s_per_token=0.02)  # fmt: skip
    keep = agentic(cfg, turns=4.0, max_turns=8, tool_s=0.5, keep_kv=True)
    drop = agentic(cfg, turns=4.0, max_turns=8, tool_s=0.5, keep_kv=False)
    a = Simulation(keep, Mode.SYNC, strict=True).run()
    b = Simulation(drop, Mode.SYNC, strict=True).run()
    assert a.resume_prefill_tokens == 0 and a.kv_evictions == 0
    assert b.resume_prefill_tokens > 0
    assert [s.tokens for s in a.steps] == [s.tokens for s in b.steps], "the same episodes"
    assert b.wall_s > a.wall_s + 0.02 * b.resume_prefill_tokens * 0.5, "most of the re-prefill is on the path"
    assert Simulation(drop, Mode.DORA, strict=True).run().resume_prefill_tokens > 0
