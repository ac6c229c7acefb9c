"""Which rank trains which trajectory and how a rank's share is cut into micro-batches (``dora.balance``), and
the simulator's trainer pricing the same assignment the learner makes."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.balance import assign, cut, imbalance, learner_order, plan, rank_loads
from dora.config.sim import TrainerSection
from dora.sim.trainer import batch_train_s, replica_loads

batches = st.lists(st.tuples(st.integers(1, 8), st.lists(st.integers(1, 3000), min_size=1, max_size=8)),
                   min_size=1, max_size=12)  # fmt: skip
"""Batches as groups: (prompt tokens, each sample's completion tokens)."""


def flatten(groups: list[tuple[int, list[int]]]) -> tuple[list[int], list[int]]:
    sizes = [p + n for p, samples in groups for n in samples]
    return sizes, [g for g, (_, samples) in enumerate(groups) for _ in samples]


def test_stride_takes_every_world_th_trajectory_of_the_learners_length_order():
    sizes, groups = [5, 9, 2, 7, 7, 1], [0, 0, 1, 1, 2, 2]
    order = learner_order(sizes, groups)
    assert order == [2, 3, 5, 4, 0, 1]  # groups 1 and 2 (longest 7, by id), then 0 (9); by size within each
    assert assign(sizes, groups, 2, "stride") == [order[0::2], order[1::2]]
    assert assign(sizes, groups, 1, "tokens") == [order]


def test_token_balance_keeps_groups_whole_when_they_fit_and_splits_one_when_not():
    # four like groups on two ranks: two whole groups each
    sizes, groups = [10, 10, 11, 11, 12, 12, 13, 13], [0, 0, 1, 1, 2, 2, 3, 3]
    shares = assign(sizes, groups, 2, "tokens")
    assert all(len({groups[i] for i in share}) == 2 for share in shares)
    assert rank_loads(sizes, shares) == [46, 46]
    # three like groups on two ranks: the third is split, every rank ends even
    sizes, groups = [10] * 12, [i // 4 for i in range(12)]
    shares = assign(sizes, groups, 2, "tokens")
    assert rank_loads(sizes, shares) == [60, 60]
    assert sorted(len({groups[i] for i in share}) for share in shares) == [2, 2]


def test_a_long_tail_that_stride_piles_on_one_rank_token_balance_spreads():
    """Two groups of one long answer and short ones: stride's length order puts both long answers on the
    same rank (each is its group's last); the greedy puts them apart."""
    sizes = [100, 100, 100, 3000, 100, 100, 100, 3000]
    groups = [0, 0, 0, 0, 1, 1, 1, 1]
    stride = rank_loads(sizes, assign(sizes, groups, 2, "stride"))
    tokens = rank_loads(sizes, assign(sizes, groups, 2, "tokens"))
    assert max(stride) == 6200 and imbalance(stride) > 1.8
    assert tokens == [3300, 3300] and imbalance(tokens) == 1.0


@settings(max_examples=200, deadline=None)
@given(batches, st.integers(1, 9), st.sampled_from(["stride", "tokens"]))
def test_every_trajectory_goes_to_exactly_one_rank_in_order_and_the_greedy_is_within_one_of_even(
    groups_, world, balance
):
    sizes, groups = flatten(groups_)
    shares = assign(sizes, groups, world, balance)
    order = learner_order(sizes, groups)
    assert len(shares) == world and sorted(i for s in shares for i in s) == list(range(len(sizes)))
    assert all(share == [i for i in order if i in set(share)] for share in shares)
    assert shares == assign(sizes, groups, world, balance)  # deterministic: every rank computes the same
    if balance == "tokens":
        assert max(rank_loads(sizes, shares)) <= sum(sizes) / world + max(sizes)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="balance"):
        assign([1], [0], 2, "random")
    with pytest.raises(ValueError, match="world"):
        assign([1], [0], 0, "tokens")


def test_a_token_budget_cuts_rows_times_the_longest_within_it():
    sizes = [3, 4, 4, 9, 10, 30]
    assert cut(range(6), sizes, micro_batch=4, token_budget=None) == [[0, 1, 2, 3], [4, 5]]
    assert cut(range(6), sizes, micro_batch=4, token_budget=12) == [[0, 1, 2], [3], [4], [5]]
    assert cut(range(6), sizes, micro_batch=4, token_budget=20) == [[0, 1, 2], [3, 4], [5]]
    assert cut(range(6), sizes, micro_batch=4, token_budget=10**6) == [list(range(6))]


@settings(max_examples=200, deadline=None)
@given(batches, st.integers(1, 5), st.sampled_from(["stride", "tokens"]), st.integers(1, 6),
       st.sampled_from([None, 1, 500, 4000, 10**9]))  # fmt: skip
def test_every_rank_runs_as_many_micro_batches_and_together_they_hold_the_batch_once(
    groups_, world, balance, micro_batch, budget
):
    sizes, groups = flatten(groups_)
    plans = [plan(sizes, groups, rank=r, world=world, balance=balance, micro_batch=micro_batch,
                  micro_batch_tokens=budget) for r in range(world)]  # fmt: skip
    assert len({len(p.micro_batches) for p in plans}) == 1
    held = [i for p in plans for part in p.micro_batches for i in part]
    assert sorted(held) == list(range(len(sizes)))
    for p in plans:
        assert p.loads == plans[0].loads and p.imbalance >= 1.0
        for part in p.micro_batches:
            if budget and len(part) > 1:
                assert len(part) * max(sizes[i] for i in part) <= budget
            if not budget:
                assert len(part) <= micro_batch


def test_the_simulated_trainer_prices_the_learners_own_assignment():
    """``trainer.data_parallel = stride | tokens`` is ``learner.balance``: the replicas' loads are the learner's
    ranks' loads under the same function, groups (consecutive ``group_size`` sequences) included."""
    sizes = [100, 100, 100, 3000, 100, 100, 100, 3000, 50, 60, 70, 80]
    groups = [i // 4 for i in range(len(sizes))]
    for split in ("stride", "tokens"):
        want = rank_loads(sizes, assign(sizes, groups, 3, split))
        assert replica_loads(sizes, 3, split, groups) == want
        t = TrainerSection(gpu_s_per_token=1.0, step_fixed_s=0.0, publish_s=0.0, data_parallel=split)
        assert batch_train_s(t, sizes, 3, group_size=4) == max(want)
    stride = TrainerSection(gpu_s_per_token=1.0, step_fixed_s=0.0, publish_s=0.0, data_parallel="stride")
    tokens = TrainerSection(gpu_s_per_token=1.0, step_fixed_s=0.0, publish_s=0.0, data_parallel="tokens")
    assert batch_train_s(tokens, sizes, 2, group_size=4) < batch_train_s(stride, sizes, 2, group_size=4)
