"""The sim trainer's timing model: how long a train step takes, for `dora sim` and for the live ``sim`` trainer
(scaled by ``run.time_scale``). ``[trainer]`` (``dora.config.sim.TrainerSection``) holds its numbers.

``data_parallel = "fluid"``: a step takes step_fixed_s + tokens x gpu_s_per_token / trainer accelerators. Otherwise
the batch's sequences are trained in ``updates_per_step`` optimizer updates, each split over the data-parallel
replicas (``model_parallel_gpus`` accelerators each) and ended by a barrier, so every update lasts as long as its
busiest replica.

Then the version is published: written in line (``publish_s``, or ``weights_gb x write_s_per_gb``), or with
``overlap_publish`` copied aside (``weights_gb x snapshot_s_per_gb``) and written in the background while the next
batch trains, one write at a time (``dora.sim.des``).
"""

from __future__ import annotations

from dora.balance import assign, rank_loads
from dora.config import ConfigError
from dora.config.sim import TrainerSection


def replicas(trainer: TrainerSection, gpus: int) -> int:
    """Data-parallel replicas of a trainer of ``gpus`` accelerators (0: too few for one)."""
    return gpus if trainer.data_parallel == "fluid" else gpus // trainer.model_parallel_gpus


def batch_train_s(trainer: TrainerSection, sequences: list[int], gpus: int, group_size: int = 1) -> float:
    """A step on a batch of sequences of these token counts (in the batch's order, each ``group_size`` consecutive
    ones a group) on ``gpus``."""
    if trainer.data_parallel == "fluid":
        return trainer.step_fixed_s + sum(sequences) * trainer.gpu_s_per_token / gpus
    dp = replicas(trainer, gpus)
    if dp < 1:
        raise ConfigError(f"the trainer has {gpus} accelerators, fewer than one data-parallel replica "
                          f"(trainer.model_parallel_gpus = {trainer.model_parallel_gpus})")  # fmt: skip
    n, u = len(sequences), min(trainer.updates_per_step, max(1, len(sequences)))
    busiest = 0
    for i in range(u):
        update = range(i * n // u, (i + 1) * n // u)
        groups = [j // group_size for j in update]
        busiest += max(replica_loads([sequences[j] for j in update], dp, trainer.data_parallel, groups), default=0)
    return trainer.step_fixed_s + busiest * trainer.gpu_s_per_token / trainer.model_parallel_gpus


def replica_loads(sequences: list[int], replicas: int, split: str, groups: list[int] | None = None) -> list[int]:
    """Tokens each data-parallel replica trains of one update's ``sequences``: ``count``, consecutive equal
    shares (sizes differ by at most one); ``stride`` and ``tokens``, the learner's assignment
    (``dora.balance.assign``) with ``groups[i]`` sequence i's group (None: each its own)."""
    if split == "count":
        n = len(sequences)
        return [sum(sequences[r * n // replicas : (r + 1) * n // replicas]) for r in range(replicas)]
    groups = list(range(len(sequences))) if groups is None else groups
    return rank_loads(sequences, assign(sequences, groups, replicas, split))


def publish_cost_s(trainer: TrainerSection, train_s: float) -> float:
    """What publishing a version adds to the trainer's cadence when its steps train ``train_s`` each: the write in
    line; with ``overlap_publish``, the copy aside plus whatever of the write the next step's training does not
    hide (one write in flight: a step waits for the previous write before its copy). A lower bound where the next
    batch waits for the publish (K = 0, elastic workers), which hides nothing."""
    if not trainer.overlap_publish:
        return trainer.write_s
    return trainer.snapshot_s + max(0.0, trainer.write_s - train_s)
