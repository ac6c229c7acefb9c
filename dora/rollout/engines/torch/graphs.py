"""CUDA graphs of the torch engine's decode step: one forward and one sampling, replayed as a single launch.

A decode step's shapes are fixed by three things: how many slot rows it runs, the cache's capacity (in a graph the
attention reads every column, the mask hiding those past each row's length) and whether any row has top-p. Each
such key gets one graph, captured on first use. The rows run are a bucket, the next power of two at or above the
running count (or all slots): rows past the running ones hold the state a sequence left there (or the initial
one), so they compute finite numbers nobody reads, and write keys only into their own free slots.

Everything a graph reads and writes lives in tensors that outlive it: the model's weights (a load copies into
them in place), the slot cache's buffers, the per-slot state and the output rows (``batch``).
Whatever replaces one of them makes the graphs be captured anew (``clear``): the cache growing or being freed (a
sleep, which also moves the weights), the stop table widening. The forward only reads the state (the step's token,
position and draw index) and writes keys at each row's own position, so running it twice changes nothing: that is
what lets the capture's warm-up runs happen for real.

Graphs share one memory pool (replays never overlap). A model whose forward cannot be captured (a host sync inside,
as in some mixture-of-experts routers) is run eagerly from then on, with the reason kept in ``broken``. So is one
whose first replay of a new graph does not make what the eager step makes (the engine runs both then, the eager one
last so that the cache holds its keys): a graph that reads something its capture did not pin down is never
trusted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
import torch

log = structlog.get_logger()


class DecodeGraphs:
    def __init__(self, run: Callable[[int, int, bool], None], device: torch.device, slots: int) -> None:
        """``run(rows, width, nucleus)``: the decode step to capture."""
        self.run = run
        self.device = device
        self.slots = slots
        self.graphs: dict[tuple[int, int, bool], torch.cuda.CUDAGraph] = {}
        self.pool: Any = None
        self.broken: str | None = None
        """Why capturing failed (then every step runs eagerly)."""

    def bucket(self, n: int) -> int:
        return min(1 << (n - 1).bit_length(), self.slots)

    def lookup(self, n: int, capacity: int, nucleus: bool) -> tuple[torch.cuda.CUDAGraph | None, bool]:
        """The graph of the step of ``n`` rows, captured now if it is new: (graph, whether it was just captured), or
        (None, False) if steps run eagerly."""
        if self.broken is not None:
            return None, False
        key = (self.bucket(n), capacity, nucleus)
        graph = self.graphs.get(key)
        if graph is not None:
            return graph, False
        try:
            graph = self._capture(*key)
        except RuntimeError as e:  # a forward that syncs with the host, an op graphs do not take, no memory
            self.disable((str(e).strip().splitlines() or [type(e).__name__])[0][:200])
            return None, False
        self.graphs[key] = graph
        return graph, True

    def disable(self, reason: str) -> None:
        """Run every step eagerly from now on."""
        self.broken = reason
        log.warning("cuda_graphs_off", reason=reason)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.clear()

    def _capture(self, rows: int, width: int, nucleus: bool) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: lazy initialisations, kernel choices
                self.run(rows, width, nucleus)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.run(rows, width, nucleus)
        self.pool = graph.pool()
        return graph

    def clear(self) -> None:
        """Forget every graph (what they read was replaced)."""
        self.graphs.clear()
        self.pool = None
