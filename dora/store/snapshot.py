"""``HostSnapshot``: a learner's publishable state copied into one reused host buffer, laid out as the version's
safetensors files will be, so the learner can train on while the copy is written to the store.

The learner waits for the copy and nothing else: ``take`` copies every tensor (floating ones cast to the publish
dtype) into the buffer and returns views of it, then ``WeightStore.publish`` of those views (on another thread)
writes each file's data as one span of the buffer (``dora.store.writer``: the views follow the files' layout,
largest item size first, sharded as ``publish`` shards). The copy is the one copy the learner pays for a version.

Memory that a process touches for the first time costs a page fault per page (on the machines measured, fresh
memory is written at a fifth of the speed of memory already touched: ``bench/weights.py``), so the buffer is made
once, every page touched at allocation (pinned where CUDA is, so a GPU's tensors land by DMA), grown only when a
version is larger, and reused by every later take. Large tensors are copied in pieces by a few threads (torch
releases the GIL while it copies).

**The views of one take are overwritten by the next**: a caller finishes with them (the publish has returned)
before it takes again. The buffer stays allocated for the life of the snapshot (host memory the size of a version).
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor

import torch

from dora.store.dirs import FILE
from dora.store.writer import plan

PAGE = 4096
PIECE_BYTES = 32 << 20
"""A copy job: large enough that a thread's overhead is nothing, small enough to spread a tensor over the threads."""
THREADS = min(4, os.cpu_count() or 1)
GROW = 2 << 20
"""The buffer's size is rounded up to this."""


class HostSnapshot:
    """One host buffer that every version's state is copied into, as views laid out as its files."""

    def __init__(self, *, shard_bytes: int | None = None, file: str = FILE, pin: bool | None = None,
                 threads: int = THREADS, piece_bytes: int = PIECE_BYTES) -> None:  # fmt: skip
        """``shard_bytes`` and ``file``: the store's (``WeightStore.shard_bytes``, the weights' file name), so the
        views follow its files; ``pin``: page-locked (default: where CUDA is)."""
        from dora.store.publish import SHARD_BYTES

        self.shard_bytes = SHARD_BYTES if shard_bytes is None else shard_bytes
        self.file = file
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.threads = max(1, threads)
        self.piece_bytes = piece_bytes
        self.buffer: torch.Tensor | None = None
        self.seconds = 0.0
        """How long the last take took (its allocation included)."""
        self.bytes = 0
        """The bytes the last take copied in (the version's tensors, in the dtype taken)."""
        self.alloc_s = 0.0
        """Of ``seconds``: making (and touching) the buffer, 0 when the last take reused it."""

    def take(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
        """Copies of ``state`` (floating tensors cast to ``dtype``; None: as they are) in the buffer, in the files'
        order; landed when this returns. The views of the previous take are overwritten."""
        started = time.perf_counter()
        files = plan(state, dtype, shard_bytes=self.shard_bytes, file=self.file)
        total = sum(f.data_bytes for f in files)
        self.alloc_s = self._reserve(total)
        buf = self.buffer
        assert buf is not None
        out: dict[str, torch.Tensor] = {}
        jobs: list[tuple[torch.Tensor, torch.Tensor]] = []
        offset = 0
        for f in files:
            for slot in f.slots:
                src = state[slot.key].detach()
                want = dtype if dtype is not None and src.is_floating_point() else src.dtype
                view = buf[offset : offset + slot.nbytes].view(want).view(slot.shape)
                out[slot.key] = view
                jobs += self._pieces(view, src)
                offset += slot.nbytes
        self._copy(jobs)
        self.bytes = total
        self.seconds = time.perf_counter() - started
        return out

    def _reserve(self, total: int) -> float:
        """The buffer, of at least ``total`` bytes (made, or grown, and touched now); seconds spent making it."""
        if self.buffer is not None and self.buffer.numel() >= total:
            return 0.0
        started = time.perf_counter()
        size = -(-max(total, 1) // GROW) * GROW
        self.buffer = None  # the smaller one goes first
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
        if not self.pin:  # page-locked memory is resident already
            buf[::PAGE].zero_()  # one byte per page: every page faulted in now, not during a take
        self.buffer = buf
        return time.perf_counter() - started

    def _pieces(self, dst: torch.Tensor, src: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The copy of ``src`` into ``dst`` as jobs: a contiguous CPU tensor in pieces of ``piece_bytes``."""
        n = dst.numel()
        if not n:
            return []
        if src.device.type != "cpu" or not src.is_contiguous():
            return [(dst, src)]
        step = max(1, self.piece_bytes // dst.element_size())
        flat_dst, flat_src = dst.view(-1), src.view(-1)
        return [(flat_dst[i : i + step], flat_src[i : i + step]) for i in range(0, n, step)]

    def _copy(self, jobs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        device = [(d, s) for d, s in jobs if s.device.type != "cpu"]
        for d, s in device:  # cast on the device (fewer bytes over the link), then one DMA into the pinned buffer
            d.copy_(s.to(d.dtype), non_blocking=self.pin)
        host = [(d, s) for d, s in jobs if s.device.type == "cpu"]
        if len(host) > 1 and self.threads > 1:
            with ThreadPoolExecutor(min(self.threads, len(host)), thread_name_prefix="snapshot") as pool:
                for _ in pool.map(lambda job: job[0].copy_(job[1]), host):
                    pass
        else:
            for d, s in host:
                d.copy_(s)
        if device:
            torch.cuda.synchronize()
