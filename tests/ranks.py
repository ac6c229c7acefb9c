"""Gloo ranks for the tests that compare a sharded step with the one-process step: each rank a process forked from
the server of tests/forks.py, which has imported torch, transformers and dora's trainer once. Spawned afresh, each
rank imported them itself, about 7 CPU-s a rank: most of what a two-rank step of a tiny model costs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from tests import forks


def run_ranks(fn: Callable[..., None], args: tuple[Any, ...], nprocs: int = 2) -> None:
    """``fn(rank, *args)`` in ``nprocs`` processes; returns when all exited 0, else raises (as ``mp.spawn``). The
    server is stopped and reaped before this returns, so the ranks' CPU time counts as this test's child time."""
    forks.context()
    try:
        mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")
    finally:
        forks.stop()
