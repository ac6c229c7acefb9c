"""The learner's own check of every batch it is handed (C1, C2, C3, exact size, nothing trained twice)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from dora.learner.checks import InvariantBroken, check_batch
from dora.samples import Batch, TrainGroup, TrainSample
from dora.wire import messages as m

G = 2  # samples per group
TWO_VERSIONS = np.array([[5, 2], [4, 1]], np.int32)  # 2 tokens from version 5, then 1 from version 4


def sample(index: int, *, tokens: int = 3, segments=None) -> TrainSample:
    return TrainSample(index=index, token_ids=np.arange(tokens, dtype=np.int32),
                       logprobs=np.full(tokens, -0.5, np.float32), reward=float(index), finish=m.Finish.STOP,
                       segments=segments)  # fmt: skip


def group(gid: int, version: int, samples=None) -> TrainGroup:
    return TrainGroup(group_id=gid, version=version, prompt_ids=np.array([1, 2], np.int32),
                      samples=tuple(samples or [sample(i) for i in range(G)]))  # fmt: skip


def batch(*groups: TrainGroup, step: int = 5) -> Batch:
    return Batch(step=step, groups=groups)


def check(b: Batch, **kw):
    args = {"step": 5, "groups": 2, "group_size": G, "k": 2, "mixed_ok": False, **kw}
    return check_batch(b, **args)


def test_a_good_batch_passes_with_its_staleness_histogram_and_tokens():
    facts = check(batch(group(1, 5), group(2, 3)))
    assert facts == {"staleness": {0: 2, 2: 2}, "mixed_version_trajectories": 0, "tokens": 12, "turns": 0}


@pytest.mark.parametrize(
    ("b", "kw", "words"),
    [
        (batch(group(1, 5), group(2, 5), step=4), {}, "asked for batch 5"),
        (batch(group(1, 5)), {}, "1 groups"),
        (batch(group(1, 5), group(1, 5)), {}, "distinct"),
        (batch(group(1, 5), group(2, 2)), {}, "C3"),
        (batch(group(1, 5), group(2, 6)), {}, "C3"),  # from the future
        (batch(group(1, 5), group(2, 5, [sample(0)])), {}, "not whole"),
        (batch(group(1, 5), group(2, 5, [sample(0), sample(0)])), {}, "not whole"),
        (batch(group(1, 5), group(2, 5, [sample(0), sample(1, segments=TWO_VERSIONS)])), {}, "C1"),
        (batch(group(1, 5), group(2, 5)), {"trained": {2, 9}}, "trained before: [2]"),
    ],
)
def test_a_broken_batch_is_refused_with_the_reason(b, kw, words):
    with pytest.raises(InvariantBroken, match=words.replace("[", r"\[").replace("]", r"\]")):
        check(b, **kw)


def test_mixed_versions_are_counted_where_the_mode_swaps_weights_in_flight():
    mixed = sample(1, segments=np.array([[4, 2], [5, 1]], np.int32))
    facts = check(batch(group(1, 4, [sample(0), mixed]), group(2, 5)), mixed_ok=True)
    assert facts["mixed_version_trajectories"] == 1


def test_log_probs_must_match_the_tokens():
    bad = dataclasses.replace(sample(1), logprobs=np.zeros(2, np.float32))
    with pytest.raises(InvariantBroken, match="differ in length"):
        check(batch(group(1, 5, [sample(0), bad]), group(2, 5)))


def episode(index: int, *, turns, mask=(1, 1, 0, 0, 1, 1)) -> TrainSample:
    """Six tokens: a model turn, two environment tokens, a model turn."""
    return TrainSample(index=index, token_ids=np.arange(6, dtype=np.int32), logprobs=np.zeros(6, np.float32),
                       reward=0.0, finish=m.Finish.STOP, loss_mask=np.array(mask, np.uint8),
                       turns=np.array(turns, np.int32).reshape(-1, 3))  # fmt: skip


def test_an_episodes_turns_are_checked_one_by_one():
    good = [episode(i, turns=[[0, 2, 5], [4, 6, 5]]) for i in range(G)]
    facts = check(batch(group(1, 5), group(2, 5, good)))
    assert facts["turns"] == 4 and facts["mixed_version_trajectories"] == 0
    late = [good[0], episode(1, turns=[[0, 2, 5], [4, 6, 4]])]
    with pytest.raises(InvariantBroken, match=r"C1: group 2 sample 1 has a turn \[4, 6\) of version 4"):
        check(batch(group(1, 5), group(2, 5, late)))
    assert check(batch(group(1, 5), group(2, 5, late)), mixed_ok=True)["mixed_version_trajectories"] == 1


@pytest.mark.parametrize(
    ("turns", "mask", "words"),
    [
        ([[0, 3, 5], [4, 6, 5]], (1, 1, 0, 0, 1, 1), "disagree at token 2"),  # a turn over an env token
        ([[0, 2, 5]], (1, 1, 0, 0, 1, 1), "disagree at token 4"),  # a model token in no turn
        ([[4, 6, 5], [0, 2, 5]], (1, 1, 0, 0, 1, 1), "out of order"),
        ([[0, 2, 5], [4, 7, 5]], (1, 1, 0, 0, 1, 1), "out of order or out of its 6 tokens"),
        ([[0, 2, 5], [2, 2, 5]], (1, 1, 0, 0, 1, 1), "out of order"),  # an empty turn
    ],
)
def test_turns_that_do_not_match_the_loss_mask_are_refused(turns, mask, words):
    bad = [episode(0, turns=turns, mask=mask), episode(1, turns=[[0, 2, 5], [4, 6, 5]])]
    with pytest.raises(InvariantBroken, match=words):
        check(batch(group(1, 5), group(2, 5, bad)))
