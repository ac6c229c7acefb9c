"""The sim trainer: `dora learner --trainer sim`, the learner without torch.

A step takes the trainer timing model's time for the batch's sequences (``[trainer]``: ``step_fixed_s +
tokens x gpu_s_per_token / learner.sim_gpus`` when fluid, else each update as long as its busiest
data-parallel replica; then the version's copy aside and its write, ``dora.sim.trainer``), scaled by
``run.time_scale``, and publishes ``sim://v<N>`` with a sha256 named after the version. There are no weights,
so there is nothing to checkpoint, restore or adopt. Everything else a learner does (the protocol, the batch
checks, the audit) is the learner actor's, the same as with the torch trainer.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

from dora.config.run import RunConfig
from dora.learner.trainers import PendingVersion, Published
from dora.samples import Batch
from dora.sim.trainer import batch_train_s


class SimTrainer:
    keeps_weights = False

    def __init__(self, cfg: RunConfig) -> None:
        self.cfg = cfg

    def train(self, batch: Batch) -> dict[str, float]:
        sequences = [len(s.token_ids) for g in batch.groups for s in g.samples]
        train_s = batch_train_s(self.cfg.trainer, sequences, self.cfg.learner.sim_gpus, self.cfg.core.group_size)
        train_s *= self.cfg.run.time_scale
        time.sleep(train_s)
        return {"train_s": train_s}

    def snapshot(self, version: int) -> PendingVersion:
        """The trainer model's copy aside (``weights_gb x snapshot_s_per_gb``; nothing without ``weights_gb``), slept
        here, and its write (``weights_gb x write_s_per_gb``, else ``publish_s``), slept on the writer's thread."""
        scale = self.cfg.run.time_scale
        snapshot_s = self.cfg.trainer.snapshot_s * scale
        time.sleep(snapshot_s)

        def write() -> Published:
            publish_s = self.cfg.trainer.write_s * scale
            time.sleep(publish_s)
            return f"sim://v{version}", hashlib.sha256(f"sim-weights-{version}".encode()).hexdigest(), publish_s

        return PendingVersion(version=version, write=write, snapshot_s=snapshot_s)

    def publish(self, version: int) -> Published:
        return self.snapshot(version).write()

    def checkpoint(self, version: int, trained_groups: list[int]) -> float:
        raise TypeError("the sim trainer keeps no weights to checkpoint")

    def restore(self) -> dict[str, Any] | None:
        return None

    def adopt(self, version: int) -> None:
        raise TypeError("the sim trainer keeps no weights to adopt")
