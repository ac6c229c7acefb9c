"""Gloo ranks for the tests that compare a sharded step with the one-process step: each rank a process forked from
a server that has imported torch, transformers and dora's trainer once (multiprocessing's forkserver). Spawned
afresh, each rank imported them itself, about 7 CPU-s a rank: most of what a two-rank step of a tiny model costs.
The server has only imported them and run no torch op: no OpenMP pool or gloo state exists yet to be cut in half by
the fork (torch's own DataLoader workers are forks of a process that has imported torch, on Linux by default)."""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "dora.learner.trainers.torch_trainer",
)


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes; returns when all exited 0, else raises (as ``mp.spawn``). The
    server is stopped and reaped before this returns (multiprocessing's own ``_stop``, which has no public name), so
    the ranks' CPU time counts as this test's child time (tests/cpucost.py): the server reaps the ranks, this process
    the server."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(list(PRELOAD))
    try:
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
    finally:
        multiprocessing.forkserver._forkserver._stop()
