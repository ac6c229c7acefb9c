"""`dora sft` on a GPU and over several ranks: where each rank trains, its share of a batch, and the gather.

- **Device and dtype.** ``sft.device`` resolves as ``learner.device`` does (``auto``: this rank's GPU,
  ``cuda:<local rank>``, else the CPU). ``sft.dtype = auto`` is bfloat16 on a GPU and float32 on the CPU; in
  bf16 the weights stay float32 (autocast on one rank, FSDP2's MixedPrecisionPolicy over several).
- **Ranks.** With ``sft.ranks > 1`` a process that is one rank alone (``ClusterInfo.world == 1``) starts
  itself again under ``python -m torch.distributed.run --standalone --nproc-per-node=<ranks>`` with the same
  arguments; a torchrun child or one of srun's tasks is a rank already. Each rank starts the process group
  (``dora.learner.ranks``: NCCL on GPUs, gloo on CPUs) and shards the model as the learner does
  (``dora.learner.setup.shard``: ``fully_shard`` per decoder block, then the root).
- **A batch over ranks.** Every rank reads the same rows in the same order and takes every world-th row of each
  batch. Its loss is its rows' answer-token NLL summed, over the whole batch's answer-token count, times the
  world (FSDP averages gradients over ranks), so the gradient is the one-rank run's. A rank with no row in a
  short last batch still runs one, weighted 0: FSDP's collectives must pair up.
- **The result.** The full state dict is gathered to rank 0's CPU memory, which alone writes ``sft.out``,
  without tied copies, so the folder is what one rank writes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NoReturn

import torch

from dora.actor.cluster import ClusterInfo
from dora.config import ConfigError
from dora.config.models import SftSection
from dora.learner import setup


@dataclass(frozen=True, slots=True, kw_only=True)
class Placement:
    """Where this rank trains and in what."""

    device: torch.device
    bf16: bool = False
    """Compute in bfloat16 (float32 master weights)."""
    rank: int = 0
    world: int = 1
    owns_group: bool = False
    """This rank started the process group (``place``), and ends it when done (``leave``); a group some other code
    started in this process (vLLM's, say) is left alone."""

    @property
    def autocast(self) -> bool:
        """bf16 by autocast: on one rank (sharded, the FSDP2 policy casts instead)."""
        return self.bf16 and self.world == 1

    def describe(self) -> str:
        ranks = f" x {self.world} ranks (FSDP2)" if self.world > 1 else ""
        return f"{self.device}{ranks}, {'bfloat16 (float32 weights)' if self.bf16 else 'float32'}"


ONE_CPU = Placement(device=torch.device("cpu"))


def relaunches(sft: SftSection, cluster: ClusterInfo) -> bool:
    """More ranks are asked for than this process is one of, alone: it must start them (under torchrun)."""
    return sft.ranks > 1 and cluster.world == 1


def relaunch_command(argv: Sequence[str], ranks: int) -> list[str]:
    """This `dora sft` again, ``ranks`` times on this node, under torchrun."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
            "-m", "dora", "sft", *argv]  # fmt: skip


def relaunch(argv: Sequence[str], sft: SftSection, env: Mapping[str, str]) -> NoReturn:
    """Replace this process with torchrun starting ``sft.ranks`` of it (its exit code is then this command's), in
    ``env`` (the caller's environment) with OMP_NUM_THREADS set, unless set there, to each rank's share of cores."""
    command = relaunch_command(argv, sft.ranks)
    print(f"dora sft: starting {sft.ranks} ranks on this node: python {' '.join(command[1:5])} -m dora sft ...",
          file=sys.stderr)  # fmt: skip
    sys.stdout.flush()
    sys.stderr.flush()
    threads = sft.threads or max(1, (os.cpu_count() or 1) // sft.ranks)
    os.execve(command[0], command, {"OMP_NUM_THREADS": str(threads), **env})


def device_of(sft: SftSection, cluster: ClusterInfo) -> torch.device:
    """This rank's device; a GPU asked for that is not there (or too few of them) is a ConfigError."""
    from dora.learner.ranks import learner_device

    device = learner_device(sft.device, cluster)
    if device.type == "cuda":
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        need = max(sft.ranks, (device.index or 0) + 1) if cluster.world == 1 else cluster.local_rank + 1
        if have < need:
            raise ConfigError(f"sft.device = {sft.device}: torch sees {have} CUDA devices, and this needs {need}"
                              + (f" (sft.ranks = {sft.ranks})" if sft.ranks > 1 else ""))  # fmt: skip
    return device


def place(sft: SftSection, cluster: ClusterInfo) -> Placement:
    """This rank's placement; with several ranks, the process group is started (``leave(placement)`` ends it)."""
    from dora.learner.ranks import init_from_env

    if cluster.world > 1 and cluster.world != sft.ranks:
        raise ConfigError(f"sft.ranks = {sft.ranks}, but this process is rank {cluster.rank} of {cluster.world} "
                          f"(torchrun's WORLD_SIZE or srun's tasks): set sft.ranks = {cluster.world}")  # fmt: skip
    device = device_of(sft, cluster)
    bf16 = sft.dtype == "bfloat16" or (sft.dtype == "auto" and device.type == "cuda")
    owns = cluster.world > 1 and not torch.distributed.is_initialized()
    rank, world = init_from_env(cluster, device)
    return Placement(device=device, bf16=bf16, rank=rank, world=world, owns_group=owns)


def leave(where: Placement) -> None:
    """End the process group ``place`` started, if it did."""
    from dora.learner.ranks import leave as end

    if where.owns_group:
        end()


def shard(model: torch.nn.Module, where: Placement) -> torch.nn.Module:
    """The model on its device; over several ranks, sharded with FSDP2 as the learner's (``dora.learner.setup``)."""
    model.to(where.device)
    setup.shard([model], device=where.device, world=where.world, bf16=where.bf16)
    return model


def total(values: list[float], where: Placement) -> list[float]:
    """``values`` summed over the ranks (every rank gets the sums)."""
    if where.world == 1:
        return values
    import torch.distributed as dist

    summed = torch.tensor(values, dtype=torch.float64, device=where.device)
    dist.all_reduce(summed)
    return summed.tolist()


def full_state(model: torch.nn.Module, copies: dict[str, str], where: Placement) -> dict[str, torch.Tensor] | None:
    """Over several ranks (a collective): the model's full state dict on rank 0's CPU, without the tied copies
    (``dora.hf.tensors``); None on the other ranks. One rank: None (the model saves itself)."""
    if where.world == 1:
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from dora.hf.tensors import publishable

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return publishable(state, copies) if where.rank == 0 else None
