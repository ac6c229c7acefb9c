"""Built-in tasks (deterministic, solvable, long-tailed) and the safety of reward calls."""

from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.sim.workload import Workload
from dora.tasks import rewards, synthetic
from dora.tasks.tasks import Item, get


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_items_are_a_pure_function_of_seed_and_index(name):
    a, b, other = get(name, seed=3), get(name, seed=3), get(name, seed=4)
    assert [a.item(i) for i in range(50)] == [b.item(i) for i in range(50)]
    assert [a.item(i) for i in range(50)] != [other.item(i) for i in range(50)]


def test_synthetic_prompts_are_a_pure_function_of_seed_and_group_of_the_workload_length():
    one, again, other = (Workload.lognormal(median=8, sigma=1.0, prompt_tokens=100, seed=s) for s in (3, 3, 4))
    for group in (0, 1, 7, 10**6, 2**40):
        a = synthetic.prompt_ids(one, group)
        assert a.dtype == np.int32 and len(a) == one.prompt_len(group) and a.min() >= 0 and a.max() < synthetic.VOCAB
        assert np.array_equal(a, synthetic.prompt_ids(again, group)) and not a.flags.writeable
        assert not np.array_equal(a[:20], synthetic.prompt_ids(other, group)[:20])
        assert not np.array_equal(a[:20], synthetic.prompt_ids(one, group + 1)[:20])


@pytest.mark.parametrize("name", ["arithmetic", "countdown"])
def test_answer_lengths_are_long_tailed(name):
    lengths = sorted(len(get(name).item(i).answer) for i in range(3000))
    median, p99 = lengths[len(lengths) // 2], lengths[int(0.99 * len(lengths))]
    assert p99 >= 2.5 * median, (median, p99)


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10**9), st.sampled_from(["arithmetic", "countdown"]))
def test_every_item_is_solved_by_its_reference_answer(index, name):
    item = get(name).item(index)
    completion = f"={item.answer}" if name == "arithmetic" else item.answer
    assert rewards.score(rewards.resolve(rewards.DEFAULT[name]), completion, item) == rewards.Scored(1.0, "")


def test_countdown_rejects_numbers_not_given_or_used_twice_and_anything_but_arithmetic():
    item = Item(task="countdown", index=0, prompt="3 4 5 -> 17:", answer="3*4+5",
                meta={"numbers": [3, 4, 5], "target": 17})  # fmt: skip
    assert rewards.countdown("3*4+5", item) == 1.0
    assert rewards.countdown("4*3+5\nmore text", item) == 1.0
    for wrong in ("3*4+6", "3*4+5+0", "3*3+4+4", "17", "__import__('os')", "3*4+5)", "", "(3+4)*5"):
        assert rewards.countdown(wrong, item) == 0.0, wrong


def _raises(completion: str, item: Item) -> float:
    raise KeyError("boom")


def _hangs(completion: str, item: Item) -> float:
    time.sleep(2)
    return 1.0


def _nan(completion: str, item: Item) -> float:
    return float("nan")


def test_a_reward_that_raises_hangs_or_returns_junk_scores_zero_with_a_reason():
    item = get("arithmetic").item(0)
    assert rewards.score(_raises, "x", item) == rewards.Scored(0.0, "reward raised KeyError: 'boom'")
    before = rewards.stuck_reward_calls()
    hung = rewards.score(_hangs, "x", item, timeout_s=0.1)
    assert hung.reward == 0.0 and "timed out" in hung.reason and rewards.stuck_reward_calls() == before + 1
    nan = rewards.score(_nan, "x", item)
    assert nan.reward == 0.0 and "finite" in nan.reason and nan.components == {}


def test_reward_specs_resolve_or_fail_clearly():
    assert rewards.resolve("dora.tasks.rewards:exact_match") is rewards.exact_match
    for bad, msg in (("nocolon", "module:function"), ("dora.nope:f", "No module"), ("dora.tasks.rewards:nope", "nope")):
        with pytest.raises(ValueError, match=msg):
            rewards.resolve(bad)


def test_digits_shaped_reward_by_hand():
    item = get("arithmetic").item(0)
    assert rewards.digits_shaped(f"= {item.answer}", item) == 2.0
    assert rewards.digits_shaped("=12ab", item) == 0.5 and rewards.digits_shaped("no equals", item) == 0.0
