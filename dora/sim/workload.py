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
from dataclasses import dataclass, field

from dora.config import ConfigError
from dora.config.sim import WorkloadSection


@dataclass(frozen=True, slots=True, kw_only=True)
class Component:
    weight: float = 1.0
    median: float = 1200.0
    sigma: float = 1.18


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
    turns: float = 1.0
    """Median assistant turns per episode (scaled by the prompt's difficulty)."""
    turns_sigma: float = 0.0
    max_turns: int = 1
    """1: single-turn samples (the default); more: agentic episodes."""
    tool_s: float = 0.0
    """Median seconds of one tool call."""
    tool_sigma: float = 0.0
    observation_tokens: float = 0.0
    """Median tokens of one tool result."""
    observation_sigma: float = 0.0
    uniform_share: float = 0.0
    """Probability that a group's samples all get the same reward (a prompt solved, or failed, by every sample)."""

    def __post_init__(self) -> None:
        if not self.components or any(c.weight <= 0 or c.median <= 0 or c.sigma < 0 for c in self.components):
            raise ValueError("workload components need weight > 0, median > 0 and sigma >= 0")
        if self.cap < 1 or self.prompt_tokens < 1:
            raise ValueError("workload cap and prompt_tokens must be >= 1")
        if self.max_turns < 1 or not 1 <= self.turns <= self.max_turns:
            raise ValueError("workload turns must be in [1, max_turns]")
        if min(self.turns_sigma, self.tool_s, self.tool_sigma, self.observation_tokens, self.observation_sigma) < 0:
            raise ValueError("workload tool and observation medians and every sigma must be >= 0")
        if not 0.0 <= self.uniform_share <= 1.0:
            raise ValueError(f"workload uniform_share must be in [0, 1]; got {self.uniform_share}")

    @property
    def multi_turn(self) -> bool:
        return self.max_turns > 1

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
        """Output tokens of a sample (of an episode: all its turns)."""
        if self.multi_turn:
            return self.episode(group, index, attempt).length
        comp, difficulty = self._prompt(group)
        rng = random.Random(f"{self.seed}:{group}:{index}:{attempt}")
        raw = rng.lognormvariate(math.log(comp.median * difficulty), comp.sigma)
        return max(1, min(self.cap, round(raw)))

    def episode(self, group: int, index: int, attempt: int) -> Episode:
        """The sample's turns, tool calls and observations (one turn of ``length`` when single-turn)."""
        if not self.multi_turn:
            return Episode(turns=(self.length(group, index, attempt),))
        comp, difficulty = self._prompt(group)
        rng = random.Random(f"{self.seed}:episode:{group}:{index}:{attempt}")
        n = max(1, min(self.max_turns, round(_lognormal(rng, self.turns * difficulty, self.turns_sigma))))
        turns: list[int] = []
        total = 0
        for _ in range(n):
            tokens = max(1, min(self.cap - total, round(_lognormal(rng, comp.median * difficulty, comp.sigma))))
            turns.append(tokens)
            total += tokens
            if total >= self.cap:  # cut by length: the episode ends here
                break
        tools = random.Random(f"{self.seed}:tools:{group}:{index}:{attempt}")
        observations, tools_s = [], []
        for _ in range(len(turns) - 1):
            observations.append(round(_lognormal(tools, self.observation_tokens, self.observation_sigma)))
            tools_s.append(_lognormal(tools, self.tool_s, self.tool_sigma))
        return Episode(turns=tuple(turns), observations=tuple(observations), tools_s=tuple(tools_s))

    def uniform(self, group: int, attempt: int) -> bool:
        """Whether this attempt of the group gives every sample the same reward."""
        if self.uniform_share <= 0.0:
            return False
        return random.Random(f"{self.seed}:uniform:{group}:{attempt}").random() < self.uniform_share

    def reward(self, group: int, index: int, attempt: int) -> float:
        """A sample's reward: 1 for every sample of a uniform group, else 0 and 1 alternately (a group of one
        sample is uniform whatever it gets, as for the learner)."""
        return 1.0 if self.uniform(group, attempt) else float(index % 2)

    def prompt_len(self, group: int) -> int:
        rng = random.Random(f"{self.seed}:prompt:{group}")
        return max(1, round(rng.lognormvariate(math.log(self.prompt_tokens), self.prompt_sigma)))


def _lognormal(rng: random.Random, median: float, sigma: float) -> float:
    """``median * exp(sigma * z)``; draws ``z`` even when the median is 0, so later draws do not shift."""
    return median * math.exp(sigma * rng.normalvariate(0.0, 1.0))


def from_section(section: WorkloadSection, seed: int) -> Workload:
    """The workload a ``[workload]`` config section describes, seeded."""
    comps = (
        tuple(Component(weight=c.weight, median=c.median, sigma=c.sigma) for c in section.components)
        if section.distribution == "mixture"
        else (Component(median=section.median, sigma=section.sigma),)
    )
    try:
        return Workload(components=comps, difficulty_sigma=section.difficulty_sigma, cap=section.cap,
                        prompt_tokens=section.prompt_tokens, prompt_sigma=section.prompt_sigma, seed=seed,
                        turns=section.turns, turns_sigma=section.turns_sigma, max_turns=section.max_turns,
                        tool_s=section.tool_s, tool_sigma=section.tool_sigma,
                        observation_tokens=section.observation_tokens,
                        observation_sigma=section.observation_sigma,
                        uniform_share=section.uniform_share)  # fmt: skip
    except ValueError as e:
        raise ConfigError(f"workload: {e}") from None
