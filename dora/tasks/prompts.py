"""A run's prompts and scoring: the task's items, encoded and scored with the model's own tokenizer.

Uses the ``tokenizers`` library alone (no torch), so the broker can encode prompts cheaply.
"""

from __future__ import annotations

import functools
import pathlib
from collections.abc import Callable

import numpy as np

from dora.sim.workload import from_section
from dora.tasks import rewards, tasks


class TaskRun:
    def __init__(self, name: str, seed: int, tokenizer_dir: str, reward: str | None, timeout_s: float) -> None:
        from tokenizers import Tokenizer

        path = pathlib.Path(tokenizer_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"no tokenizer.json in {tokenizer_dir}")
        self.tokenizer = Tokenizer.from_file(str(path))
        self.task = tasks.get(name, seed)
        self.reward = rewards.resolve(reward or rewards.DEFAULT[name])
        self.timeout_s = timeout_s
        self.item = functools.lru_cache(maxsize=8192)(self.task.item)

    def prompt_ids(self, group: int) -> np.ndarray:
        return np.array(self.tokenizer.encode(self.item(group).prompt).ids, dtype=np.int32)

    def score(self, group: int, tokens: list[int]) -> tuple[float, str]:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return rewards.score(self.reward, text, self.item(group), timeout_s=self.timeout_s)


def prompt_source(cfg) -> Callable[[int], np.ndarray]:  # cfg: RunConfig
    """The broker's prompts for a run: the task's, or synthetic token arrays for the sim engine."""
    if cfg.task.name == "synthetic":
        from dora.tasks.synthetic import prompt_ids

        workload = from_section(cfg.workload, cfg.run.seed)
        return functools.lru_cache(maxsize=8192)(lambda g: prompt_ids(workload, g))
    t = cfg.task
    if not t.tokenizer:
        raise ValueError(f"task {t.name!r} needs task.tokenizer (the model folder with tokenizer.json)")
    return TaskRun(t.name, t.seed, t.tokenizer, t.reward, t.reward_timeout_s).prompt_ids
