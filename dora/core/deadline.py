"""Deadline arithmetic: the rule that keeps C2 (nothing dropped), C3 (staleness <= K) and liveness together.

A group dispatched on version ``v`` gets a deadline ``d``: the last learner step allowed to consume it,
``v + K`` (fixed), or with adaptive deadlines the earliest admissible step in ``[v + 1, v + K]``.
With ``s`` the next step the learner will consume and ``B`` groups per batch, the
**feasibility invariant** is

    for every d >= s:   #{unconsumed groups with deadline <= d}  <=  (d - s + 1) * B

i.e. the groups that must be trained by step ``d`` fit in the batches ``s..d``. Admission keeps it
(a group is dispatched only if the invariant still holds with it added), and consumption keeps it
(a batch is taken only if the invariant holds for ``s + 1`` after removing it). Taking the ``B``
finished groups with the earliest deadlines removes, for every ``d``, as many groups with deadline
``<= d`` as any choice of ``B`` finished groups can, so if that choice does not keep the invariant
no choice does, and waiting for running groups is the only option. Once every unconsumed group has
finished, the earliest-deadline choice always keeps it, so the wait always ends.

Counts are ``{deadline: number of unconsumed groups}``; at most K + 1 deadlines are ever present.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping


def slack(counts: Mapping[int, int], step: int, batch: int) -> dict[int, int]:
    """Free room ``(d - s + 1) * B - #{deadline <= d}`` at every deadline present (negative = violated)."""
    room: dict[int, int] = {}
    total = 0
    for d in sorted(counts):
        total += counts[d]
        room[d] = (d - step + 1) * batch - total
    return room


def feasible(counts: Mapping[int, int], step: int, batch: int) -> bool:
    """True if the feasibility invariant holds at ``step`` (an overdue group is never feasible)."""
    for d, free in slack(counts, step, batch).items():
        if free < 0 or (d < step and counts[d] > 0):
            return False
    return True


def admits(counts: Mapping[int, int], step: int, batch: int, deadline: int) -> bool:
    """May one more group with ``deadline`` be dispatched without breaking the invariant?"""
    if deadline < step:
        return False
    # feasible(counts with one more at ``deadline``), without building that mapping: it runs on every dispatch
    total = 0
    for d in sorted(counts.keys() | {deadline}):
        n = counts.get(d, 0) + (d == deadline)
        total += n
        if total > (d - step + 1) * batch or (d < step and n > 0):
            return False
    return True


def admissible(counts: Mapping[int, int], step: int, batch: int, deadline: int) -> int:
    """How many more groups with ``deadline`` can be dispatched (0 if the deadline is already past)."""
    if deadline < step:
        return 0
    room = slack(counts, step, batch)
    # Adding n groups at `deadline` lowers the room of every d >= deadline by n.
    bounds = [free for d, free in room.items() if d >= deadline]
    below = sum(n for d, n in counts.items() if d <= deadline)
    bounds.append((deadline - step + 1) * batch - below)
    return max(0, min(bounds))


def keeps_invariant_after(
    counts: Mapping[int, int], step: int, batch: int, taken: Iterable[int] | Mapping[int, int]
) -> bool:
    """Would the invariant hold for ``step + 1`` once groups with deadlines ``taken`` are consumed?
    ``taken``: one deadline per group, or {deadline: number of groups}."""
    rest = dict(counts)
    for d, n in taken.items() if isinstance(taken, Mapping) else ((d, 1) for d in taken):
        rest[d] -= n
    return feasible({d: n for d, n in rest.items() if n}, step + 1, batch)
