"""Synthetic prompts and completions for the `sim` engine: deterministic token arrays, no model.

Prompt lengths follow the run's workload; token ids and log-probs are pure functions of
(seed, group, sample, attempt, position), so any process can regenerate them and a migrated request
continues exactly the tokens it would have produced where it started.
"""

from __future__ import annotations

import numpy as np

from dora.sim.workload import Workload

VOCAB = 32_000


def prompt_ids(workload: Workload, group: int) -> np.ndarray:
    rng = np.random.default_rng([workload.seed, 1, group])
    return rng.integers(0, VOCAB, size=workload.prompt_len(group), dtype=np.int32)


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
    """A verifiable-looking binary reward: shorter-than-median answers of a prompt are 'correct'."""
    return 1.0 if workload.length(group, index, attempt) <= workload.components[0].median else 0.0
