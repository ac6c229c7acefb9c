"""Synthetic prompts and completions for the `sim` engine: deterministic token arrays, no model.

Prompt lengths follow the run's workload; token ids and log-probs are pure functions of
(seed, group, sample, attempt, position), so any process can regenerate them and a migrated request
continues exactly the tokens it would have produced where it started.
"""

from __future__ import annotations

import functools

import numpy as np

from dora.sim.workload import Workload

VOCAB = 32_000


POOL_TOKENS = 1 << 20
"""A group's prompt is a window of one fixed random stream of this many tokens per seed (4 MiB)."""


def prompt_ids(workload: Workload, group: int) -> np.ndarray:
    """The group's prompt: ``workload.prompt_len(group)`` tokens from the seed's token stream, at a place that is a
    pure function of (seed, group). A window costs a slice, where drawing a generator per group cost the broker
    ~10 µs a lease. Read-only (a view on the shared stream)."""
    n = workload.prompt_len(group)
    pool = _pool(workload.seed)
    if n > len(pool):
        return np.resize(pool, n)
    start = ((group + 1) * 0x9E3779B97F4A7C15) % (len(pool) - n + 1)
    return pool[start : start + n]


@functools.cache
def _pool(seed: int) -> np.ndarray:
    pool = np.random.default_rng([seed, 1]).integers(0, VOCAB, size=POOL_TOKENS, dtype=np.int32)
    pool.flags.writeable = False
    return pool


def completion(
    workload: Workload, group: int, index: int, attempt: int, start: int, stop: int
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and behaviour log-probs of positions [start, stop) of one sample."""
    rng = np.random.default_rng([workload.seed, 2, group, index, attempt])
    length = workload.length(group, index, attempt)
    ids = rng.integers(0, VOCAB, size=length, dtype=np.int32)[start:stop]
    logprobs = -rng.exponential(1.0, size=length).astype(np.float32)[start:stop]
    return ids, logprobs


def reward(workload: Workload, group: int, index: int, attempt: int) -> float:
    """A verifiable-looking binary reward: shorter-than-median answers of a prompt are 'correct'; every answer of
    a group the workload draws uniform (``workload.uniform_share``) is."""
    if workload.uniform(group, attempt):
        return 1.0
    return 1.0 if workload.length(group, index, attempt) <= workload.components[0].median else 0.0
