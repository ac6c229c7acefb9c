"""Held-out metrics: accuracy, pass@k and mean length from per-row rewards, the same wherever a model is evaluated
(`dora eval`, `dora run` before and after, the broker's rounds run by the rollout workers).

- ``accuracy``: the share of all completions that are correct, that is whose reward reaches 1 (with greedy
  decoding, one per row: exact match on the held-out rows);
- ``pass@k`` for k = 1, 2, 4, ... up to the samples per row: the unbiased estimator
  ``1 - C(n-c, k) / C(n, k)`` averaged over rows (n samples of a row, c of them correct);
- ``mean_reward`` and ``mean_tokens`` (completion length).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

CORRECT = 1.0
"""A completion whose reward reaches this is correct."""


def row_seed(seed: int, row: int) -> int:
    """The sampling seed of held-out row ``row``: one per row. With one seed for every row, sample i of each row
    would draw the same uniform numbers, so a sampled success rate would move in steps of 1/samples as the
    policy's probabilities cross those few draws, not with the probabilities themselves."""
    return seed * 1_000_003 + row


def pass_at_k(n: int, c: int, k: int) -> float:
    """The probability that at least one of k samples drawn without replacement from n (c correct) is correct."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(rewards: Sequence[Sequence[float]], lengths: Sequence[Sequence[int]]) -> dict[str, float]:
    """The metrics of per-row rewards and completion lengths (every row with the same number of samples)."""
    if not rewards or any(len(r) != len(rewards[0]) for r in rewards) or not rewards[0]:
        raise ValueError("every row needs the same number of samples, at least one")
    n = len(rewards[0])
    correct = [sum(x >= CORRECT for x in row) for row in rewards]
    out = {
        "rows": float(len(rewards)),
        "samples": float(n),
        "accuracy": sum(correct) / (n * len(rewards)),
        "mean_reward": sum(map(sum, rewards)) / (n * len(rewards)),
        "mean_tokens": sum(map(sum, lengths)) / (n * len(rewards)),
    }
    k = 1
    while k <= n:
        out[f"pass@{k}"] = sum(pass_at_k(n, c, k) for c in correct) / len(rewards)
        k *= 2
    return out
