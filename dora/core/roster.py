"""Roster: for each version, the worker serving it with the most free slots, without looking at every worker.

The scheduler leases a group to the ready, not leaving worker of the group's version with the most free
slots (join order breaks ties). Scanning the fleet for it on every lease costs a lease as much as the
fleet is large; this keeps, per version, a heap of ``(-free slots, join order, worker)`` entries instead.

The heap is lazy. The scheduler offers a worker's current entry whenever its free slots, readiness,
leaving flag or version may have changed; an entry that no longer matches its worker (it left the
version, stopped being ready, or its free slots changed since) is dropped when it comes to the top.
So the top valid entry is always the best worker, and a lookup costs O(log n) amortized. Entries that
sink under valid ones are only dropped by a rebuild, made when a heap holds more than a few entries per
worker, so memory stays O(workers).

Pure: no I/O, no clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable

from dora.ids import WorkerId

Entry = tuple[int, int, WorkerId]
"""(-free slots, join order, worker)."""

SLACK = 4
"""A version's heap is rebuilt once it holds more than SLACK entries per worker (plus a few)."""


class Roster:
    """Per version, the serving workers by free slots (most first), then by join order."""

    def __init__(self) -> None:
        self._heaps: dict[int, list[Entry]] = {}

    def offer(self, version: int, worker: WorkerId, free: int, order: int) -> None:
        """The worker serves ``version`` (ready, not leaving) with ``free`` slots now."""
        heapq.heappush(self._heaps.setdefault(version, []), (-free, order, worker))

    def best(self, version: int, current: Callable[[WorkerId], tuple[int, int] | None]) -> WorkerId | None:
        """The worker of ``version`` with the most free slots, the earliest joined among equals; None if none
        serves it. ``current(worker)``: its (free slots, join order) if it serves ``version`` now (ready, not
        leaving), else None."""
        heap = self._heaps.get(version)
        while heap:
            free, order, worker = heap[0]
            if current(worker) == (-free, order):
                return worker
            heapq.heappop(heap)
        return None

    def crowded(self, version: int, workers: int) -> bool:
        """Whether the version's heap holds enough dropped entries to be worth a rebuild."""
        return len(self._heaps.get(version, ())) > SLACK * workers + 64

    def rebuild(self, version: int, entries: Iterable[tuple[WorkerId, int, int]]) -> None:
        """Replace the version's heap with ``(worker, free, order)`` of exactly the workers serving it."""
        heap = [(-free, order, worker) for worker, free, order in entries]
        heapq.heapify(heap)
        if heap:
            self._heaps[version] = heap
        else:
            self._heaps.pop(version, None)

    def listed(self, version: int) -> set[tuple[WorkerId, int, int]]:
        """Every ``(worker, free, order)`` the version's heap holds, dropped ones included (for checks)."""
        return {(worker, -free, order) for free, order, worker in self._heaps.get(version, ())}

    def forget(self, versions: Iterable[int]) -> None:
        """Drop the heaps of versions no worker serves any more (retired)."""
        for v in list(versions):
            self._heaps.pop(v, None)

    def versions(self) -> list[int]:
        return sorted(self._heaps)
