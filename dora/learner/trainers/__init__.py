"""The trainers behind the learner actor: what turns a checked train batch into a new published version.

``sim`` waits the trainer timing model's time and publishes a named, weightless version (no torch);
``torch_trainer`` trains each batch in mini-batches on a transformers model (FSDP2 over several ranks) and writes
the version to the weight store. ``dora.learner.ranks.Leader`` wraps the torch trainer on rank 0 of
several and announces every call to the other ranks first.

The contract (``Trainer``): the actor calls each method from a worker thread, one at a time, while its
own loop keeps heartbeating; ``train`` then ``snapshot`` make one step, and the snapshot's ``write`` makes
its version durable, on a thread of its own, while the next step may train (``dora.learner.actor``). A trainer whose
``keeps_weights`` is False has no weights to checkpoint, restore or adopt, and the actor never asks it to.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from dora.samples import Batch

Published = tuple[str, str, float]
"""A durable version: (uri, digest, seconds its write took)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class PendingVersion:
    """A version copied aside at the end of its step (the learner's critical path ends here): ``write`` makes it
    durable in the store and may run on another thread while the weights train on; ``inline``: a small version's
    files (LoRA adapters with their manifest), carried in the messages that announce it."""

    version: int
    write: Callable[[], Published]
    snapshot_s: float
    inline: dict[str, bytes] = field(default_factory=dict)


def timed_write(version: int, write: Callable[[], Published], started: float, *,
                inline: dict[str, bytes] | None = None) -> PendingVersion:  # fmt: skip
    """A pending version whose copy took since ``started``."""
    return PendingVersion(version=version, write=write, snapshot_s=time.perf_counter() - started, inline=inline or {})


class Trainer(Protocol):
    keeps_weights: bool
    """True: its weights are the run's (checkpointed, restored after a crash, adopted from the store)."""

    def train(self, batch: Batch) -> dict[str, float]:
        """One step on the batch; the step's metrics (logged by the broker with the step)."""
        ...

    def snapshot(self, version: int) -> PendingVersion | None:
        """Copy the weights aside as version ``version`` (sharded: a collective); what writes them, on the rank that
        writes, else None. The weights may train on as soon as this returns; the next ``snapshot`` comes only once
        the previous write has returned (one copy buffer, reused)."""
        ...

    def publish(self, version: int) -> Published | None:
        """``snapshot`` and its write, in one go: (uri, sha256, seconds); None on a rank that does not write."""
        ...

    def checkpoint(self, version: int, trained_groups: list[int]) -> float:
        """Save weights, optimizer and the groups trained so far; the seconds it took."""
        ...

    def restore(self) -> dict[str, Any] | None:
        """Load the newest checkpoint (or the starting weights); its meta, or None without one."""
        ...

    def adopt(self, version: int) -> None:
        """Take a published version's weights from the weight store."""
        ...
