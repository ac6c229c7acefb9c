"""The learner over several ranks (torchrun or srun): rank 0 speaks to the broker, every rank trains.

Rank 0 runs the learner protocol as a single-rank learner does. Its trainer is a ``Leader``, which
first broadcasts each command to the other ranks: the train batch, encoded with the wire codec (no
pickle); the version to publish, to checkpoint or to take from the weight store; and the stop. The
other ranks run ``follow``: they receive each command and make the same collective calls, so FSDP's
reduce-scatters and the full-state-dict gather line up across ranks.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

from dora.actor.cluster import ClusterInfo
from dora.learner.trainers import PendingVersion, Published
from dora.samples import Batch
from dora.wire import codec, packed
from dora.wire.messages import TrainBatch

TRAIN, SNAPSHOT, STOP, CHECKPOINT, ADOPT, RESTORE = 1, 2, 3, 4, 5, 6


def learner_device(setting: str, cluster: ClusterInfo) -> torch.device:
    """``learner.device``: ``auto`` is this rank's GPU when there is one, else the CPU. This rank's GPU is
    ``cuda:<local rank>`` among the node's (torchrun's ranks, or srun's tasks, all seeing the same GPUs), or
    ``cuda:0`` when the process sees exactly one (srun ``--gpus-per-task=1`` binds each task to its own)."""
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    if setting == "cuda":
        return torch.device("cuda", 0 if torch.cuda.device_count() == 1 else cluster.local_rank)
    return torch.device(setting)


def init_from_env(cluster: ClusterInfo, device: torch.device, timeout_s: float = 600.0) -> tuple[int, int]:
    """(rank, world size) from torchrun's or srun's variables (``ClusterInfo``); with more than one rank, the
    process group is started: NCCL on GPUs, gloo on CPUs, meeting at the cluster's rendezvous address."""
    rank, world = cluster.rank, cluster.world
    if world > 1 and not dist.is_initialized():
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{cluster.master_addr}:{cluster.master_port}",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return rank, world


def leave() -> None:
    """Tear this rank's process group down before the interpreter exits: left to exit-time destructors, gloo's
    threads can abort the process ("terminate called without an active exception") once a peer has gone."""
    if dist.is_initialized():
        dist.destroy_process_group()


def _comm_device() -> torch.device:
    """Where broadcast buffers live: NCCL moves only GPU tensors, gloo CPU ones."""
    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _send(kind: int, payload: bytes = b"") -> None:
    header = torch.tensor([kind, len(payload)], dtype=torch.int64, device=_comm_device())
    dist.broadcast(header, src=0)
    if payload:
        dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(_comm_device()), src=0)


def _receive() -> tuple[int, bytes]:
    header = torch.zeros(2, dtype=torch.int64, device=_comm_device())
    dist.broadcast(header, src=0)
    kind, size = int(header[0]), int(header[1])
    if not size:
        return kind, b""
    data = torch.empty(size, dtype=torch.uint8, device=_comm_device())
    dist.broadcast(data, src=0)
    return kind, data.cpu().numpy().tobytes()


def pack(frames: list[Any]) -> bytes:
    """Frames as one byte string: a count, each length, then the bytes (decoded by ``unpack``)."""
    raw = [bytes(f) for f in frames]
    head = len(raw).to_bytes(4, "little") + b"".join(len(r).to_bytes(8, "little") for r in raw)
    return head + b"".join(raw)


def unpack(data: bytes) -> list[bytes]:
    n = int.from_bytes(data[:4], "little")
    sizes = [int.from_bytes(data[4 + 8 * i : 12 + 8 * i], "little") for i in range(n)]
    out, pos = [], 4 + 8 * n
    for size in sizes:
        out.append(data[pos : pos + size])
        pos += size
    return out


class Leader:
    """Rank 0's trainer: each call is first announced to the other ranks, then made here too."""

    keeps_weights = True

    def __init__(self, trainer: Any) -> None:
        self.trainer = trainer

    def train(self, batch: Batch) -> dict[str, float]:
        _send(TRAIN, pack(codec.encode(packed.pack_batch(batch))))
        return self.trainer.train(batch)

    def snapshot(self, version: int) -> PendingVersion | None:
        _send(SNAPSHOT, version.to_bytes(8, "little"))
        return self.trainer.snapshot(version)

    def publish(self, version: int) -> Published | None:
        pending = self.snapshot(version)
        return pending.write() if pending is not None else None

    def checkpoint(self, version: int, trained_groups: list[int]) -> float:
        _send(CHECKPOINT, version.to_bytes(8, "little"))
        return self.trainer.checkpoint(version, trained_groups)

    def adopt(self, version: int) -> None:
        _send(ADOPT, version.to_bytes(8, "little"))
        self.trainer.adopt(version)

    def restore(self) -> dict[str, Any] | None:
        _send(RESTORE)
        return self.trainer.restore()

    def stop(self) -> None:
        _send(STOP)


def follow(trainer: Any) -> int:
    """A rank other than 0: do what rank 0 announces until it says stop."""
    import structlog

    log = structlog.get_logger()
    log.info("rank_following", world=trainer.world)
    steps = 0
    while True:
        kind, payload = _receive()
        if kind == TRAIN:
            batch = codec.decode(unpack(payload))
            assert isinstance(batch, TrainBatch), f"rank 0 announced a train step with a {type(batch).__name__}"
            trainer.train(packed.unpack_batch(batch))
            steps += 1
        elif kind == SNAPSHOT:  # the gather is collective; rank 0 alone writes
            trainer.snapshot(int.from_bytes(payload, "little"))
        elif kind == CHECKPOINT:  # rank 0 alone writes, and holds the trained ids
            trainer.checkpoint(int.from_bytes(payload, "little"), [])
        elif kind == ADOPT:
            trainer.adopt(int.from_bytes(payload, "little"))
        elif kind == RESTORE:
            trainer.restore()
        else:
            log.info("rank_done", steps=steps)
            return 0
