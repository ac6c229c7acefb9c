"""Which data-parallel rank trains which trajectory of a batch, in which micro-batches: pure decisions. The
assignment is made by the torch learner (``learner.balance``) and priced by the simulator's trainer model
(``trainer.data_parallel``), so the two agree.

A trajectory's size is the tokens its forward runs (prompt + completion, environment tokens included); a step
lasts as long as its busiest rank, since every rank waits for the others at the gradient reduction. Both
balancings start from the learner's order (``learner_order``): groups by their longest trajectory, a group's
samples together, shortest first within it.

- ``stride``: rank ``r`` takes every world-th trajectory of that order, from the ``r``-th. Equal counts, and
  roughly even tokens when lengths vary smoothly; but a group's longest sample is its last, so when the group
  size is a multiple of the world size every group's longest lands on the same rank (the last): with
  long-tailed lengths, that rank holds the tail.
- ``tokens``: greedy, longest first to the least loaded rank (ties: the lowest rank). A group goes whole (its
  prompt runs once, its samples share a micro-batch) when the rank it lands on stays within an even share
  (total / world): keeping it together costs no balance. Otherwise its trajectories go one by one, longest
  first, each to the least loaded rank (often the same one). The busiest rank holds at most total / world +
  the longest trajectory, the bound of a greedy that splits every group.

Both are deterministic functions of the sizes and groups, so every rank computes the whole assignment (each
its own share and the others' micro-batch counts) without a collective.

Then each rank cuts its share, in that order, into micro-batches (``cut``, ``plan``): ``micro_batch`` trajectories
each, or with ``micro_batch_tokens`` as many as fit a token budget, counted padded (rows x the longest prompt +
completion among them) since that is what the forward's tensors hold; a trajectory longer than the budget is a
micro-batch of its own. Sharded (FSDP), every rank must run as many forward/backward passes as the others, or
their collectives stop pairing up: a rank pads its micro-batches with empty ones up to the most any rank has,
and the trainer runs an empty one as a pass whose loss is zero.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

Balance = Literal["stride", "tokens"]
BALANCES: tuple[str, ...] = ("stride", "tokens")


def learner_order(sizes: Sequence[int], groups: Sequence[int]) -> list[int]:
    """Indices of the trajectories in the learner's order: groups by their longest trajectory (then by group),
    a group's samples together, by size within it (then by index). Groups of like lengths side by side make
    micro-batches with little padding."""
    longest: dict[int, int] = {}
    for size, group in zip(sizes, groups, strict=True):
        longest[group] = max(longest.get(group, 0), size)
    return sorted(range(len(sizes)), key=lambda i: (longest[groups[i]], groups[i], sizes[i], i))


def assign(sizes: Sequence[int], groups: Sequence[int], world: int, balance: str) -> list[list[int]]:
    """Per rank, the indices of the trajectories it trains, each rank's in the learner's order. ``groups[i]``
    names trajectory i's group (any hashable int; a group's samples need not be adjacent)."""
    if world < 1:
        raise ValueError(f"world must be >= 1; got {world}")
    if balance not in BALANCES:
        raise ValueError(f"balance must be one of {', '.join(BALANCES)}; got {balance!r}")
    order = learner_order(sizes, groups)
    if balance == "stride" or world == 1:
        return [order[r::world] for r in range(world)]
    members: dict[int, list[int]] = {}
    for i in order:
        members.setdefault(groups[i], []).append(i)
    cost = {g: sum(sizes[i] for i in ids) for g, ids in members.items()}
    rank_of = [0] * len(sizes)
    even = sum(sizes) / world
    loads = [(0, r) for r in range(world)]  # a heap: the least loaded rank first, ties to the lowest
    for g in sorted(members, key=lambda g: -cost[g]):  # stable: equal costs keep the learner's order
        load, r = loads[0]
        if load + cost[g] <= even:
            heapq.heapreplace(loads, (load + cost[g], r))
            for i in members[g]:
                rank_of[i] = r
            continue
        for i in sorted(members[g], key=lambda i: -sizes[i]):
            load, r = loads[0]
            heapq.heapreplace(loads, (load + sizes[i], r))
            rank_of[i] = r
    return [[i for i in order if rank_of[i] == r] for r in range(world)]


def rank_loads(sizes: Sequence[int], shares: Sequence[Sequence[int]]) -> list[int]:
    """The tokens each rank trains under an assignment."""
    return [sum(sizes[i] for i in share) for share in shares]


def imbalance(loads: Sequence[float]) -> float:
    """The busiest rank's load over the mean load: 1.0 is perfect balance, ``world`` is one rank doing it all."""
    mean = sum(loads) / len(loads) if loads else 0.0
    return max(loads) / mean if mean > 0 else 1.0


@dataclass(frozen=True, slots=True)
class StepPlan:
    micro_batches: list[list[int]]
    """This rank's micro-batches (trajectory indices), padded with empty ones to every rank's count."""
    loads: list[int]
    """Tokens (prompt + completion) each rank trains."""

    @property
    def imbalance(self) -> float:
        """The busiest rank's tokens over the mean (1.0: perfectly even)."""
        return imbalance(self.loads)


def cut(share: Sequence[int], sizes: Sequence[int], *, micro_batch: int, token_budget: int | None) -> list[list[int]]:
    """``share`` (in order) in micro-batches: ``micro_batch`` trajectories each, or with a ``token_budget``
    (> 0) as many consecutive ones as keep rows x the longest of them within it (at least one each)."""
    if not token_budget:
        return [list(share[s : s + micro_batch]) for s in range(0, len(share), micro_batch)]
    parts: list[list[int]] = []
    part: list[int] = []
    longest = 0
    for i in share:
        wider = max(longest, sizes[i])
        if part and (len(part) + 1) * wider > token_budget:
            parts.append(part)
            part, wider = [], sizes[i]
        part.append(i)
        longest = wider
    if part:
        parts.append(part)
    return parts


def plan(sizes: Sequence[int], groups: Sequence[int], *, rank: int, world: int, balance: str, micro_batch: int,
         micro_batch_tokens: int | None = None) -> StepPlan:  # fmt: skip
    """The plan of rank ``rank`` of ``world`` for trajectories of these sizes (prompt + completion tokens) and
    groups."""
    shares = assign(sizes, groups, world, balance)
    counts = [len(cut(s, sizes, micro_batch=micro_batch, token_budget=micro_batch_tokens)) for s in shares]
    mine = cut(shares[rank], sizes, micro_batch=micro_batch, token_budget=micro_batch_tokens)
    return StepPlan(micro_batches=mine + [[] for _ in range(max(counts) - len(mine))],
                    loads=rank_loads(sizes, shares))  # fmt: skip
