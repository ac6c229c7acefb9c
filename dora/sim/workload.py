"""Synthetic RL rollout workloads: long-tailed output lengths with per-prompt difficulty.

Each prompt draws a component (for a mixture) and a difficulty factor, both shared by its G
samples, so the samples of a group have correlated lengths, as real hard prompts produce long
answers for every sample. Each sample then draws its length from a lognormal around the
component's median scaled by the difficulty, capped at ``cap``. A re-run of a group (after a worker
death) draws fresh lengths, as a real regeneration would. Everything is a pure function of
(seed, group, sample, attempt), so runs are reproducible and every mode sees the same prompts.

Agentic (multi-turn) workloads, ``max_turns > 1``: a sample is an **episode** of several assistant
turns. Its turn count is a lognormal around ``turns`` x the prompt's difficulty (a hard task takes
more tool calls as well as longer turns), rounded into [1, max_turns]; each turn's tokens are drawn
like a single-turn answer (component, difficulty, sigma) and the episode's model tokens are capped
at ``cap`` (the turn that reaches it is cut and ends the episode). Every turn but the last ends in a
tool call of lognormal seconds whose result appends lognormal observation tokens. The turn count and
turn lengths come from one random stream, tool seconds and observations from another, and every
draw is made whatever its median, so a sweep over tool latency keeps the same turns and tokens.
With ``max_turns = 1`` none of this runs: lengths are exactly the single-turn ones.

Rewards: a group is uniform (every sample gets the same reward, so it carries no GRPO signal) with probability
``uniform_share``, drawn per (group, attempt) from a stream of its own (a re-run draws afresh, and no length
moves with the share); the samples of any other group get rewards 0 and 1 alternately. What a refill of the
uniform groups costs (``core.filter_uniform``) is then measured on the very lengths a run without it sees.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from dora.config.sim import ComponentSection, WorkloadSection


@dataclass(frozen=True, slots=True)
class Episode:
    """One sample of an agentic workload: assistant turns separated by tool calls."""

    turns: tuple[int, ...]
    """Model tokens of each assistant turn (all >= 1)."""
    observations: tuple[int, ...] = ()
    """Tokens each tool result appends to the context, one per turn but the last."""
    tools_s: tuple[float, ...] = ()
    """Seconds of each tool call, one per turn but the last."""

    @property
    def length(self) -> int:
        return sum(self.turns)


class Workload:
    """The lengths, turns and rewards a ``[workload]`` section (``spec``, the one declaration of its keys and their
    checks) describes, drawn from ``seed``: ``lognormal``, one component; ``mixture``, several (e.g. bimodal agentic
    workloads)."""

    __slots__ = ("components", "seed", "spec")

    def __init__(self, spec: WorkloadSection, seed: int = 0) -> None:
        self.spec = spec
        self.seed = seed
        self.components: tuple[ComponentSection, ...] = (
            spec.components
            if spec.distribution == "mixture"
            else (ComponentSection(median=spec.median, sigma=spec.sigma),)
        )

    @classmethod
    def lognormal(cls, *, seed: int = 0, **keys: Any) -> Workload:
        """A workload of these ``[workload]`` keys (one lognormal component unless they say otherwise), seeded."""
        return cls(WorkloadSection(**keys), seed)

    @property
    def multi_turn(self) -> bool:
        return self.spec.max_turns > 1

    def _prompt(self, group: int) -> tuple[ComponentSection, float]:
        rng = random.Random(f"{self.seed}:{group}")
        pick = rng.random() * sum(c.weight for c in self.components)
        comp = self.components[-1]
        for c in self.components:
            pick -= c.weight
            if pick < 0:
                comp = c
                break
        return comp, rng.lognormvariate(0.0, self.spec.difficulty_sigma)

    def length(self, group: int, index: int, attempt: int) -> int:
        """Output tokens of a sample (of an episode: all its turns)."""
        if self.multi_turn:
            return self.episode(group, index, attempt).length
        comp, difficulty = self._prompt(group)
        rng = random.Random(f"{self.seed}:{group}:{index}:{attempt}")
        raw = rng.lognormvariate(math.log(comp.median * difficulty), comp.sigma)
        return max(1, min(self.spec.cap, round(raw)))

    def episode(self, group: int, index: int, attempt: int) -> Episode:
        """The sample's turns, tool calls and observations (one turn of ``length`` when single-turn)."""
        if not self.multi_turn:
            return Episode(turns=(self.length(group, index, attempt),))
        comp, difficulty = self._prompt(group)
        rng = random.Random(f"{self.seed}:episode:{group}:{index}:{attempt}")
        spec = self.spec
        n = max(1, min(spec.max_turns, round(_lognormal(rng, spec.turns * difficulty, spec.turns_sigma))))
        turns: list[int] = []
        total = 0
        for _ in range(n):
            tokens = max(1, min(spec.cap - total, round(_lognormal(rng, comp.median * difficulty, comp.sigma))))
            turns.append(tokens)
            total += tokens
            if total >= spec.cap:  # cut by length: the episode ends here
                break
        tools = random.Random(f"{self.seed}:tools:{group}:{index}:{attempt}")
        observations, tools_s = [], []
        for _ in range(len(turns) - 1):
            observations.append(round(_lognormal(tools, spec.observation_tokens, spec.observation_sigma)))
            tools_s.append(_lognormal(tools, spec.tool_s, spec.tool_sigma))
        return Episode(turns=tuple(turns), observations=tuple(observations), tools_s=tuple(tools_s))

    def uniform(self, group: int, attempt: int) -> bool:
        """Whether this attempt of the group gives every sample the same reward."""
        if self.spec.uniform_share <= 0.0:
            return False
        return random.Random(f"{self.seed}:uniform:{group}:{attempt}").random() < self.spec.uniform_share

    def reward(self, group: int, index: int, attempt: int) -> float:
        """A sample's reward: 1 for every sample of a uniform group, else 0 and 1 alternately (a group of one
        sample is uniform whatever it gets, as for the learner)."""
        return 1.0 if self.uniform(group, attempt) else float(index % 2)

    def prompt_len(self, group: int) -> int:
        rng = random.Random(f"{self.seed}:prompt:{group}")
        return max(1, round(rng.lognormvariate(math.log(self.spec.prompt_tokens), self.spec.prompt_sigma)))


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    """``median * exp(sigma * z)``; draws ``z`` even when the median is 0, so later draws do not shift."""
    return median * math.exp(sigma * rng.normalvariate(0.0, 1.0))
