"""A version's safetensors files written from the tensors' own memory: laid out, written in large spans, hashed
from memory as they are written, and synced to the disk while later bytes are still being written.

**The layout** (``plan``): every tensor in the order of its item size, largest first (stable: a state of one
dtype keeps its order), cut into shards of at most ``shard_bytes`` in that order. Each file is the safetensors
format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header
``{"__metadata__": {"format": "pt"}, name: {"dtype", "shape", "data_offsets"}}`` padded with spaces to a multiple
of 8 bytes, then the tensors' bytes back to back, each at an offset its item size divides. The layout of a state
already in layout order is the same layout, so ``dora.store.snapshot.HostSnapshot`` lays its buffer out as the
files will be, and a publish of its views writes each file's data as one span of that buffer.

**The write** (``write_files``): each file's bytes are its header, then the spans of tensor memory (adjacent
tensors of one storage merged), written with ``os.pwritev`` 1 MiB a call, digest chunk after digest chunk: one
copy, from the tensors into the page cache, and no bytes object the size of a tensor. Each chunk is hashed from
the same memory in worker threads as its bytes are written (``dora.store.digest.hash_pieces``: exactly what
``digest_file`` finds in the file), and the disk is told to start writing the bytes back a step behind the write
(``sync_file_range`` every ``SYNC_STEP``, on its own thread), then each file is fsync'd on that thread while the
next one is written: the disk writes while the page cache fills, instead of only once the last byte is in it. The
caller must not change the tensors until this returns.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dora.store.digest import THREADS, chunk_pieces, hash_pieces
from dora.store.dirs import FILE
from dora.store.manifest import FileEntry

if TYPE_CHECKING:
    import torch

METADATA = {"format": "pt"}
IOV_PIECES = 512
"""Pieces per ``pwritev`` call (below every system's IOV_MAX)."""
WRITE_BYTES = 1 << 20
"""Bytes per write call: a version written 1 MiB a call took 0.6 of the time it took 16 MiB a call (a 0.5 GB
version, ext4, 2 cores; each write paired with a ``dd`` of the same size, six pairs each)."""
SYNC_FILE_RANGE_WRITE = 2
SYNC_STEP = 256 << 20
"""The disk is told to write a file's bytes back in steps of this, each once the write is a step past it (steps of
16 and 64 MiB, right behind the write, slowed the write more than they saved: measured on ext4)."""


@dataclass(frozen=True, slots=True)
class Slot:
    """One tensor of a file: its name, safetensors dtype, shape and bytes."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class FilePlan:
    """One safetensors file of a version: its name, its tensors in the order of their bytes, and its header."""

    name: str
    slots: tuple[Slot, ...]
    header: bytes

    @property
    def data_bytes(self) -> int:
        return sum(s.nbytes for s in self.slots)


def dtype_code(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype (``BF16``); ValueError for one safetensors has no name for."""
    from dora.store.tensorfile import DTYPES

    for code, d in DTYPES.items():
        if d == dtype:
            return code
    raise ValueError(f"safetensors has no dtype for {dtype}")


def header(slots: Sequence[Slot]) -> bytes:
    """A safetensors file's first bytes: the header's length, then the header, padded with spaces to 8 bytes."""
    entries: dict[str, Any] = {"__metadata__": METADATA}
    offset = 0
    for s in slots:
        entries[s.key] = {"dtype": s.dtype, "shape": list(s.shape), "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


def plan(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None, *, shard_bytes: int,
         file: str = FILE) -> list[FilePlan]:  # fmt: skip
    """The files ``state`` is written as, floating tensors cast to ``dtype`` (None: as they are): one ``file``, or
    shards ``model-0000i-of-0000n.safetensors`` past ``shard_bytes`` (never for a ``file`` other than
    ``model.safetensors``: an adapter is one file)."""
    slots = []
    for key, t in state.items():
        d = dtype if dtype is not None and t.is_floating_point() else t.dtype
        slots.append((d.itemsize, Slot(key, dtype_code(d), tuple(t.shape), t.numel() * d.itemsize)))
    slots.sort(key=lambda s: -s[0])  # stable: each tensor at an offset its item size divides
    shards: list[list[Slot]] = [[]]
    size = 0
    for _, slot in slots:
        if shards[-1] and size + slot.nbytes > shard_bytes and file == FILE:
            shards.append([])
            size = 0
        shards[-1].append(slot)
        size += slot.nbytes
    n = len(shards)
    names = [file] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    return [FilePlan(name, tuple(s), header(s)) for name, s in zip(names, shards, strict=True)]


def index(plans: Sequence[FilePlan]) -> bytes:
    """The shards' index (``model.safetensors.index.json``), as ``save_pretrained`` writes it."""
    where = {s.key: p.name for p in plans for s in p.slots}
    total = sum(p.data_bytes for p in plans)
    return (json.dumps({"metadata": {"total_size": total}, "weight_map": where}, indent=2, sort_keys=True)
            + "\n").encode()  # fmt: skip


def writable(state: Mapping[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` as tensors whose memory can be written as it is: contiguous, on the CPU, in the dtype written.
    Those already so are kept (nothing copied: a ``HostSnapshot``'s views); the others are copied here."""
    out = {}
    for key, t in state.items():
        t = t.detach()
        want = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if t.dtype != want or t.device.type != "cpu" or not t.is_contiguous():
            t = t.to(device="cpu", dtype=want).contiguous()
        out[key] = t
    return out


def spans(file: FilePlan, tensors: Mapping[str, torch.Tensor]) -> list[memoryview]:
    """The file's bytes as views of memory: its header, then its tensors' bytes (``writable`` ones), tensors that
    follow each other in one storage merged into one span."""
    import torch

    runs: list[tuple[Any, int, int]] = []  # (storage, first byte, end)
    for slot in file.slots:
        t = tensors[slot.key]
        if not slot.nbytes:
            continue
        storage = t.untyped_storage()
        lo = t.storage_offset() * t.element_size()
        if runs and runs[-1][0].data_ptr() == storage.data_ptr() and runs[-1][2] == lo:
            runs[-1] = (runs[-1][0], runs[-1][1], lo + slot.nbytes)
        else:
            runs.append((storage, lo, lo + slot.nbytes))
    views: dict[int, memoryview] = {}
    out = [memoryview(file.header)]
    for storage, lo, hi in runs:
        if storage.data_ptr() not in views:
            whole = torch.empty(0, dtype=torch.uint8).set_(storage)
            views[storage.data_ptr()] = memoryview(whole.numpy())
        out.append(views[storage.data_ptr()][lo:hi])
    return out


def _sync_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (start writing a file's range back, without waiting), where there is one."""
    try:
        fn = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True).sync_file_range
    except (AttributeError, OSError, TypeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_RANGE = _sync_range()


def write_at(fd: int, pieces: Sequence[memoryview], offset: int) -> None:
    """Write ``pieces`` one after the other at ``offset``, ``WRITE_BYTES`` a call (short writes resumed)."""
    todo = [p[i : i + WRITE_BYTES] for p in pieces for i in range(0, len(p), WRITE_BYTES)]
    while todo:
        batch: list[memoryview] = []
        size = 0
        for p in todo[:IOV_PIECES]:
            if batch and size + len(p) > WRITE_BYTES:
                break
            batch.append(p)
            size += len(p)
        n = os.pwritev(fd, batch, offset)
        offset += n
        while todo and n >= len(todo[0]):
            n -= len(todo[0])
            todo.pop(0)
        if todo and n:
            todo[0] = todo[0][n:]


def write_files(folder: pathlib.Path, files: Sequence[tuple[str, Sequence[memoryview]]], *, algo: str, chunk_bytes: int,
                fsync: bool, threads: int = THREADS) -> tuple[dict[str, FileEntry], dict[str, float]]:  # fmt: skip
    """Write each (name, pieces) as ``folder/name``, hashing every chunk from memory while it is written and, with
    ``fsync``, syncing each file while the next bytes are written. Returns each file's entry (size and chunk
    digests) and the seconds spent: ``write`` (the bytes into the page cache), then waiting on ``hash`` and
    ``fsync``. Nothing is left open, whatever is raised."""
    started = time.perf_counter()
    fds: list[int] = []
    hashed: dict[str, list[Future[str]]] = {}
    synced: list[Future[Any]] = []
    with ThreadPoolExecutor(max(1, threads), thread_name_prefix="hash") as pool, \
            ThreadPoolExecutor(1, thread_name_prefix="fsync") as disk:  # fmt: skip
        try:
            for name, pieces in files:
                fd = os.open(folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
                fds.append(fd)
                hashed[name] = _write_one(fd, pieces, algo, chunk_bytes, pool, disk if fsync else None, synced)
            written = time.perf_counter()
            entries = {n: FileEntry(sum(len(p) for p in pieces), tuple(f.result() for f in hashed[n]))
                       for n, pieces in files}  # fmt: skip
            done_hashing = time.perf_counter()
            for f in synced:
                f.result()
        finally:
            for f in synced:
                f.cancel()
            disk.shutdown(wait=True)
            for fd in fds:
                os.close(fd)
    timings = {"write": written - started, "hash": done_hashing - written, "fsync": time.perf_counter() - done_hashing}
    return entries, timings


def _write_one(fd: int, pieces: Sequence[memoryview], algo: str, chunk_bytes: int, pool: ThreadPoolExecutor,
               disk: ThreadPoolExecutor | None, synced: list[Future[Any]]) -> list[Future[str]]:  # fmt: skip
    """One file's chunks: each hashed on ``pool`` and written here; on ``disk``, the bytes started to the disk a
    step behind the write, and the file fsync'd after its last chunk. The chunks' digests, to come."""
    digests = []
    offset = behind = 0
    for chunk in chunk_pieces(list(pieces), chunk_bytes):
        digests.append(pool.submit(hash_pieces, algo, chunk))
        write_at(fd, chunk, offset)
        offset += sum(len(p) for p in chunk)
        if disk is not None and _SYNC_RANGE is not None and SYNC_STEP and offset - behind >= 2 * SYNC_STEP:
            synced.append(disk.submit(_SYNC_RANGE, fd, behind, SYNC_STEP, SYNC_FILE_RANGE_WRITE))
            behind += SYNC_STEP
    if disk is not None:
        synced.append(disk.submit(os.fsync, fd))
    return digests
