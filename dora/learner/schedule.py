"""The update schedule of one train batch: its mini-batches (whole groups, optimizer steps) and the learning rate at
each optimizer step. Pure functions of integers; every rank computes the same.

- A train batch of ``n`` groups is cut into ``mini_batches`` parts of whole groups, as even as they come
  (``numpy.array_split``: sizes differ by at most one group), and passed over ``epochs`` times: ``mini_batches x
  epochs`` optimizer steps per batch. The first pass takes the groups in the batch's order (earliest deadline
  first); each later pass a permutation drawn from (seed, step, epoch), the same on every rank.
- The learning rate at optimizer step ``k`` of the run (counted from 0 over every batch's steps) rises linearly over
  ``warmup_steps`` (step k has ``lr x (k + 1) / warmup_steps``), then stays (``constant``) or falls to
  ``lr x min_lr_ratio`` at the run's last step, linearly or along a half cosine.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

SCHEDULES = ("constant", "linear", "cosine")


@dataclass(frozen=True, slots=True, kw_only=True)
class LrSchedule:
    lr: float
    kind: str = "constant"
    warmup_steps: int = 0
    min_lr_ratio: float = 0.0
    total_steps: int | None = None
    """Optimizer steps in the run (train batches x steps per batch); needed by a decay, unused by ``constant``."""

    def __post_init__(self) -> None:
        if self.kind not in SCHEDULES:
            raise ValueError(f"lr_schedule must be one of {', '.join(SCHEDULES)}; got {self.kind!r}")
        if self.warmup_steps < 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need warmup_steps >= 0 and 0 <= min_lr_ratio <= 1; got {self.warmup_steps}, "
                             f"{self.min_lr_ratio}")  # fmt: skip
        if self.kind != "constant" and not self.total_steps:
            raise ValueError(f"a {self.kind} decay needs the run's length (core.total_steps)")

    def at(self, step: int) -> float:
        """The learning rate of optimizer step ``step`` (0-based)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.kind == "constant":
            return self.lr
        assert self.total_steps is not None
        span = max(self.total_steps - 1 - self.warmup_steps, 1)
        done = min(max(step - self.warmup_steps, 0) / span, 1.0)
        floor = self.lr * self.min_lr_ratio
        if self.kind == "linear":
            return floor + (self.lr - floor) * (1 - done)
        return floor + (self.lr - floor) * 0.5 * (1 + math.cos(math.pi * done))


def mini_batches(n_groups: int, parts: int, *, epoch: int, seed: int, step: int) -> list[list[int]]:
    """The group indices of each mini-batch of pass ``epoch`` over a batch of ``n_groups`` groups (``parts`` of
    them, at most one per group)."""
    order = np.arange(n_groups)
    if epoch > 0:
        order = np.random.default_rng([seed, step, epoch]).permutation(n_groups)
    return [part.tolist() for part in np.array_split(order, min(parts, n_groups))]
