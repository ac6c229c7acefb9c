"""Synthetic RL rollout workloads: long-tailed output lengths with per-prompt difficulty.

Each prompt draws a component (for a mixture) and a difficulty factor, both shared by its G
samples, so the samples of a group have correlated lengths, as real hard prompts produce long
answers for every sample. Each sample then draws its length from a lognormal around the
component's median scaled by the difficulty, capped at ``cap``. A re-run of a group (after a worker
death) draws fresh lengths, as a real regeneration would. Everything is a pure function of
(seed, group, sample, attempt), so runs are reproducible and every mode sees the same prompts.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from dora.config import ConfigError
from dora.config.sim import WorkloadSection


@dataclass(frozen=True, slots=True, kw_only=True)
class Component:
    weight: float = 1.0
    median: float = 1200.0
    sigma: float = 1.18


@dataclass(frozen=True, slots=True, kw_only=True)
class Workload:
    """``lognormal``: one component; ``mixture``: several (e.g. bimodal agentic workloads)."""

    components: tuple[Component, ...] = field(default_factory=lambda: (Component(),))
    difficulty_sigma: float = 0.5
    """Spread of the per-prompt factor shared by a group's samples (0 = independent samples)."""
    cap: int = 30_720
    prompt_tokens: float = 150.0
    """Median prompt length."""
    prompt_sigma: float = 0.3
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.components or any(c.weight <= 0 or c.median <= 0 or c.sigma < 0 for c in self.components):
            raise ValueError("workload components need weight > 0, median > 0 and sigma >= 0")
        if self.cap < 1 or self.prompt_tokens < 1:
            raise ValueError("workload cap and prompt_tokens must be >= 1")

    @classmethod
    def lognormal(cls, median: float = 1200.0, sigma: float = 1.18, **kw: object) -> Workload:
        return cls(components=(Component(median=median, sigma=sigma),), **kw)  # type: ignore[arg-type]

    def _prompt(self, group: int) -> tuple[Component, float]:
        rng = random.Random(f"{self.seed}:{group}")
        pick = rng.random() * sum(c.weight for c in self.components)
        comp = self.components[-1]
        for c in self.components:
            pick -= c.weight
            if pick < 0:
                comp = c
                break
        return comp, rng.lognormvariate(0.0, self.difficulty_sigma)

    def length(self, group: int, index: int, attempt: int) -> int:
        comp, difficulty = self._prompt(group)
        rng = random.Random(f"{self.seed}:{group}:{index}:{attempt}")
        raw = rng.lognormvariate(math.log(comp.median * difficulty), comp.sigma)
        return max(1, min(self.cap, round(raw)))

    def prompt_len(self, group: int) -> int:
        rng = random.Random(f"{self.seed}:prompt:{group}")
        return max(1, round(rng.lognormvariate(math.log(self.prompt_tokens), self.prompt_sigma)))

    def mean_length(self, samples: int = 20_000) -> float:
        """Monte-Carlo mean output length (for documentation and ideal-time bounds)."""
        return sum(self.length(g // 16, g % 16, 0) for g in range(samples)) / samples


def from_section(section: WorkloadSection, seed: int) -> Workload:
    """The workload a ``[workload]`` config section describes, seeded."""
    comps = (
        tuple(Component(weight=c.weight, median=c.median, sigma=c.sigma) for c in section.components)
        if section.distribution == "mixture"
        else (Component(median=section.median, sigma=section.sigma),)
    )
    try:
        return Workload(components=comps, difficulty_sigma=section.difficulty_sigma, cap=section.cap,
                        prompt_tokens=section.prompt_tokens, prompt_sigma=section.prompt_sigma, seed=seed)  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"workload: {e}") from None
