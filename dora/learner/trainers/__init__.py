"""The trainers behind the learner actor: what turns a checked train batch into a new published version.

``sim`` waits the trainer timing model's time and publishes a named, weightless version (no torch);
``torch_trainer`` trains each batch in mini-batches on a transformers model (FSDP2 over several ranks) and writes
the version to the weight store. ``dora.learner.ranks.Leader`` wraps the torch trainer on rank 0 of
several and announces every call to the other ranks first.

The contract (``Trainer``): the actor calls each method from a worker thread, one at a time, while its
own loop keeps heartbeating; ``train`` then ``publish`` make one step. A trainer whose
``keeps_weights`` is False has no weights to checkpoint, restore or adopt, and the actor never asks it to.
"""

from __future__ import annotations

from typing import Any, Protocol

from dora.samples import Batch


class Trainer(Protocol):
    keeps_weights: bool
    """True: its weights are the run's (checkpointed, restored after a crash, adopted from the store)."""

    def train(self, batch: Batch) -> dict[str, float]:
        """One step on the batch; the step's metrics (logged by the broker with the step)."""
        ...

    def publish(self, version: int) -> tuple[str, str, float] | None:
        """Make the weights version ``version``: (uri, sha256, seconds); None on a rank that does not write."""
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
