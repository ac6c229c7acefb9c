"""Held-out evaluation: a model's answers to a dataset it never trains on, scored by the task's reward.

Each row is sampled ``samples`` times (``temperature`` 0: greedy, the one answer the model gives) by a
step engine (``TorchEngine`` or ``VllmEngine``: ``submit`` then ``step`` until every sequence is done), and
each completion is scored by the run's reward; a completion is correct when its reward is at least 1.

Metrics:
- ``accuracy``: the share of all completions that are correct (with greedy decoding, one per row: exact
  match on the held-out rows);
- ``pass@k`` for k = 1, 2, 4, ... up to ``samples``: the unbiased estimator ``1 - C(n-c, k) / C(n, k)``
  averaged over rows (n samples of a row, c of them correct);
- ``mean_reward`` and ``mean_tokens`` (completion length).

Evaluation is never training traffic: it has its own rows, its own requests and its own metrics, and takes
no part in what the broker dispatches or trains.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from typing import Any

from dora.tasks.prompts import TaskRun
from dora.tasks.rewards import score

CORRECT = 1.0
"""A completion whose reward reaches this is correct."""


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


def evaluate(engine: Any, task: TaskRun, *, samples: int = 1, temperature: float = 0.0, max_tokens: int = 32,
             limit: int | None = None, seed: int = 0) -> dict[str, Any]:  # fmt: skip
    """Sample every row (the first ``limit``) with ``engine`` and score it; the metrics and the seconds taken."""
    if samples < 1 or (temperature <= 0 and samples > 1):
        raise ValueError("eval: samples must be >= 1, and 1 with greedy decoding (temperature 0)")
    started = time.perf_counter()
    rows = task.rows[:limit] if limit else task.rows
    for r in rows:
        prompt = task.tokenizer.encode(task.texts[r.index]).ids
        engine.submit(group_id=r.index, attempt=0, prompt=prompt, n=samples, max_tokens=max_tokens,
                      temperature=temperature, seed=seed)  # fmt: skip
    done: dict[int, list[Any]] = {r.index: [] for r in rows}
    left = len(rows) * samples
    while left:
        for seq in engine.step():
            done[seq.group_id].append(seq)
            left -= 1
    per_row, lengths, failed = [], [], 0
    for r in rows:
        scores = []
        for seq in sorted(done[r.index], key=lambda s: s.index):
            text = task.tokenizer.decode(list(seq.tokens), skip_special_tokens=True)
            scored = score(task.reward, text, task.row_item(r.index), timeout_s=task.timeout_s)
            failed += bool(scored.reason)
            scores.append(scored.reward)
        per_row.append(scores)
        lengths.append([len(s.tokens) for s in done[r.index]])
    out: dict[str, Any] = summarize(per_row, lengths)
    out.update(reward_failures=float(failed), seconds=round(time.perf_counter() - started, 3))
    return out
