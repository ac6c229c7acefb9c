"""A module's tensors parked in host memory while its accelerator is lent out, and brought back.

An elastic worker's torch engine sleeps through each train step (``rollout.sleep_on_yield``) and the learner's
weights and AdamW moments wait in host memory between steps (``learner.offload_between_steps``). A plain
``module.to("cpu")`` allocates pageable host memory tensor by tensor and waits for each copy, a fraction of what the
host link moves into pinned memory (``bench/role_switch.py``; the figures are in docs/benchmarks.md, "Measurements
the code is built on").

``Parking`` copies every tensor into one pinned host buffer instead, made at the first park and reused by every later
one, with all copies issued at once and waited for once; coming back, each copy leaves pinned memory
asynchronously. The buffer stays allocated between parks (host memory the size of what was parked, held for the
life of the engine or trainer), as a pageable offload would hold it while parked.

Pinning host memory is itself slow (over a second per GB), so an owner that will park
``reserve``s the buffer at startup, in a background thread. Where there is no CUDA (CPU tests) the buffer is plain
host memory and the same code runs.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import torch

ALIGN = 512
"""Bytes between the starts of two tensors in the buffer: every dtype's alignment, and a DMA-friendly one."""


def aligned(size: int) -> int:
    return -(-size // ALIGN) * ALIGN


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Parking:
    """One host buffer for the tensors of one owner (an engine's model, a trainer's model and optimizer state)."""

    def __init__(self, *, pin: bool | None = None) -> None:
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.buffer: torch.Tensor | None = None
        self._reserving: threading.Thread | None = None
        self.reserve_s: float | None = None
        """How long the reservation took (pinning host memory takes over a second per GB)."""

    def reserve(self, tensors: Sequence[torch.Tensor]) -> None:
        """Make the buffer for tensors of these sizes now, in a background thread, so that the first park does not
        pay for pinning it: an owner calls this at startup, and the pinning overlaps what comes before its first
        park (a learner's wait for its first batch, an elastic worker's first rollout)."""

        def make(total: int = sum(aligned(nbytes(t)) for t in tensors)) -> None:
            started = time.perf_counter()
            self.buffer = torch.empty(total, dtype=torch.uint8, pin_memory=self.pin)
            self.reserve_s = time.perf_counter() - started

        # not a daemon: the interpreter's exit waits for it, as a daemon thread cut off inside a torch call aborts
        # the process (exit 134); pinning ends on its own, in seconds
        self._reserving = threading.Thread(target=make, name="dora-hostmem-reserve")
        self._reserving.start()

    def ready(self) -> None:
        """Wait for the reservation, if one is being made."""
        if self._reserving is not None:
            self._reserving.join()
            self._reserving = None

    def park(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies of ``tensors`` (views of the buffer, same dtypes and shapes), landed when this returns. The
        views of the previous park are overwritten: park each owner's tensors in one call, with one Parking."""
        self.ready()
        starts, end = [], 0
        for t in tensors:
            starts.append(end)
            end += aligned(nbytes(t))
        if self.buffer is None or self.buffer.numel() < end:
            self.buffer = None  # the smaller one goes first
            self.buffer = torch.empty(end, dtype=torch.uint8, pin_memory=self.pin)
        out = []
        for t, start in zip(tensors, starts, strict=True):
            view = self.buffer[start : start + nbytes(t)].view(t.dtype).view(t.shape)
            view.copy_(t.detach(), non_blocking=self.pin)
            out.append(view)
        if self.pin:
            torch.cuda.synchronize()  # every copy has landed before the caller drops the device's tensors
        return out

    def unpark(self, tensors: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """``tensors`` (parked views) on ``device``, copied when this returns."""
        out = [t.to(device, non_blocking=self.pin) for t in tensors]
        if self.pin and device.type == "cuda":
            torch.cuda.synchronize(device)
        return out


def module_tensors(module: torch.nn.Module) -> tuple[list[torch.Tensor], Callable[[Sequence[torch.Tensor]], None]]:
    """The module's parameters and buffers, each once (tied ones too), and a function that puts replacements in
    their places: a parameter keeps its identity (``param.data`` changes, as ``module.to`` does it), so an
    optimizer's references to it stay valid; a buffer is replaced in every module that holds it."""
    params: dict[int, torch.nn.Parameter] = {}
    buffers: dict[int, list[tuple[torch.nn.Module, str]]] = {}
    kept: dict[int, torch.Tensor] = {}
    for mod in module.modules():
        for p in mod._parameters.values():
            if p is not None:
                params.setdefault(id(p), p)
        for name, b in mod._buffers.items():
            if b is not None:
                buffers.setdefault(id(b), []).append((mod, name))
                kept[id(b)] = b
    order = list(params.values())
    tensors = [p.data for p in order] + [kept[k] for k in buffers]

    def put(new: Sequence[torch.Tensor]) -> None:
        if len(new) != len(tensors):
            raise ValueError(f"{len(new)} tensors for {len(tensors)} places")
        for p, t in zip(order, new[: len(order)], strict=True):
            p.data = t
            if p.grad is not None:
                p.grad = p.grad.to(t.device)
        for holders, t in zip(buffers.values(), new[len(order) :], strict=True):
            for mod, name in holders:
                mod._buffers[name] = t

    return tensors, put
