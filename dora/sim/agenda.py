"""What the simulator has scheduled: one typed timer per kind of moment, ordered on the virtual clock.

``dora.sim.des`` sets a timer when something starts that takes time (a decode run, a load, a yield, an export,
a tool call, a train step, a background write) and handles it when the clock gets there. Timers due at the same
instant fire in the order they were set. Ticks recur forever, so only the others keep a run going.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass

from dora.ids import GroupId, WorkerId
from dora.sim.engine import Request


@dataclass(frozen=True, slots=True)
class DecodeDue:
    """The worker's next sample finishes, if nothing rescheduled the worker since (its ``epoch`` is current)."""

    worker: WorkerId
    epoch: int


@dataclass(frozen=True, slots=True)
class LoadDone:
    """The worker has loaded ``version`` (a new one, or the one it yielded under)."""

    worker: WorkerId
    version: int


@dataclass(frozen=True, slots=True)
class YieldDone:
    """The worker has offloaded what it holds and handed its accelerators to the trainer."""

    worker: WorkerId


@dataclass(frozen=True, slots=True)
class ExportDone:
    """The group's running requests (and their KV) have left the worker."""

    worker: WorkerId
    group: GroupId


@dataclass(frozen=True, slots=True)
class ToolDone:
    """An episode's tool call has answered."""

    request: Request


@dataclass(frozen=True, slots=True)
class TrainDone:
    """The trainer has trained the batch and published the next version (or, with ``trainer.overlap_publish``,
    copied it aside to be written in the background)."""


@dataclass(frozen=True, slots=True)
class WriteDone:
    """The version written in the background is durable: it is published."""


@dataclass(frozen=True, slots=True)
class TickDue:
    """The core's periodic tick."""


@dataclass(frozen=True, slots=True)
class Kill:
    """A fault: a live worker dies, the ``victim``-th modulo the live ones."""

    victim: int


@dataclass(frozen=True, slots=True)
class Restart:
    """A killed worker comes back, in the role it had."""

    elastic: bool


Timer = DecodeDue | LoadDone | YieldDone | ExportDone | ToolDone | TrainDone | WriteDone | TickDue | Kill | Restart


class Agenda:
    """The timers set and not yet fired, earliest first."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Timer]] = []
        self._seq = itertools.count()
        self.pending = 0
        """Timers set other than ticks: the run goes on while there is one."""

    def __bool__(self) -> bool:
        return bool(self._heap)

    def at(self, t: float, timer: Timer) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), timer))
        self.pending += not isinstance(timer, TickDue)

    def pop(self) -> tuple[float, Timer]:
        t, _, timer = heapq.heappop(self._heap)
        self.pending -= not isinstance(timer, TickDue)
        return t, timer
