"""A version broadcast from the learner to a group of rollout workers with torch.distributed, checked against its
manifest before a worker adopts it: no store, no files, one pass of the bytes over NCCL (GPUs) or gloo (CPUs).

The group is a process group of its own (``WeightGroup``: a ``TCPStore`` the learner's rank 0 serves and a gloo or
NCCL group built on it directly), never the default group, so it lives beside the learner's FSDP group and the
workers' own. Rank 0 is the learner and sends; ranks 1..n are workers and receive.

**What travels.** First an offer, as bytes (msgpack): the version, its manifest (``dora.store.manifest``: every
file with its chunk digests) and, per safetensors file of the version, its header, the very bytes the file starts
with. Then the data: every file's tensors back to back in the files' order and layout (``dora.store.writer.plan``:
what ``WeightStore.publish`` writes, so a ``HostSnapshot``'s views are already in it), cut into flat buckets of
``bucket_bytes`` (64 MiB): one broadcast per bucket, not per tensor, two buckets in flight on the sender (one
filled while the other is sent).

**The check.** A worker receives into one staging buffer of the version's size (kept and reused by the next
version, as ``HostSnapshot`` keeps its own), and hashes each digest chunk of each file (its header, then its
tensors' bytes: what ``digest_file`` finds in the file) in threads as soon as its bytes are in, against the
manifest's chunks; the manifest itself must be the one the version's digest names (``Manifest.vouched``, and the
digest the worker was told, when given). Only then are the tensors copied into the worker's own (``into``: its
model's, of the same names and shapes). A mismatch raises ``DigestMismatch`` naming the file and chunk, with
nothing adopted. A worker that finds the offer unfit for its model still receives every bucket (a broadcast
is collective: the others would hang) and raises after.

On GPUs the staging buffer is on the device and each bucket is also copied to a pinned host mirror to be hashed
(xxh3 and sha256 run on the CPU): the check costs one device-to-host copy of the version, on a stream of its own,
overlapped with the broadcast of the next buckets, and host memory the size of the version.
"""

from __future__ import annotations

import datetime
import json
import time
from collections import deque
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgspec
import structlog
import torch
import torch.distributed as dist

from dora.store.digest import THREADS, Digest, DigestMismatch, chunk_pieces, hash_pieces
from dora.store.dirs import FILE
from dora.store.manifest import Manifest
from dora.store.writer import plan

log = structlog.get_logger()

BUCKET_BYTES = 64 << 20
"""One broadcast: large enough that a collective's latency is nothing, small enough to keep two in flight."""
LOOPBACK = ("127.0.0.1", "localhost", "::1")
SHARD_BYTES = 5 << 30
"""``WeightStore``'s default: the files a sender lays its tensors out as must be the version's."""


class WeightGroup:
    """A process group of its own for weights: rank 0 (the learner) serves its store, ranks 1..n join it."""

    def __init__(self, host: str, port: int, rank: int, world_size: int, *, backend: str = "gloo",
                 device: str | torch.device = "cpu", timeout_s: float = 60.0,
                 interface: str | None = None) -> None:  # fmt: skip
        """``host``:``port``: rank 0's store (``port`` 0 on rank 0: a free one, ``self.port``, for the others to
        join). ``backend``: ``gloo`` (CPU tensors) or ``nccl`` (``device`` a GPU, one per rank). ``interface``: the
        address gloo binds to (default: ``host`` when it is a loopback address, else the host's name's). Returns
        once the store is up; the group itself is made at the first broadcast, which waits for every rank."""
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"weight group backend must be gloo or nccl; got {backend!r}")
        if world_size < 2 or not 0 <= rank < world_size:
            raise ValueError(f"a weight group needs a sender and a receiver: rank {rank} of {world_size}")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.device = torch.device(device)
        if (backend == "nccl") != (self.device.type == "cuda"):
            raise ValueError(f"backend {backend} with tensors on {self.device}: nccl needs cuda, gloo the cpu")
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.interface = interface if interface is not None else (host if host in LOOPBACK else None)
        self.store = dist.TCPStore(host, port, world_size, rank == 0, timeout=self.timeout, wait_for_workers=False)
        self.port: int = self.store.port
        self._pg: Any = None

    @property
    def pg(self) -> Any:
        """The gloo or NCCL group on the store, made on first use (gloo connects every rank to every other then)."""
        if self._pg is None:
            if self.backend == "nccl":
                torch.cuda.set_device(self.device)
                opts = dist.ProcessGroupNCCL.Options()
                if hasattr(opts, "_timeout"):
                    opts._timeout = self.timeout
                self._pg = dist.ProcessGroupNCCL(self.store, self.rank, self.world_size, opts)
            else:
                opts = dist.ProcessGroupGloo._Options()
                opts._timeout = self.timeout
                opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.interface or "")]
                self._pg = dist.ProcessGroupGloo(self.store, self.rank, self.world_size, opts)
        return self._pg

    def broadcast(self, tensor: torch.Tensor) -> Any:
        """Start a broadcast of ``tensor`` (contiguous, on the group's device) from rank 0; its work, to wait on."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        return self.pg.broadcast([tensor], opts)

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (its length first, then its bytes)."""
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64, device=self.device)
        self.broadcast(size).wait()
        buf = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        if self.rank == 0 and data:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(buf).wait()
        return bytes(buf.cpu().numpy())

    def close(self) -> None:
        """Release the group (NCCL's communicator; gloo's sockets go with the object)."""
        shutdown = getattr(self._pg, "shutdown", None)
        if callable(shutdown):
            shutdown()
        self._pg = None


@dataclass(frozen=True, slots=True)
class Item:
    """One tensor of the stream: its name, dtype, shape, and where its bytes lie among the version's data."""

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int
    nbytes: int


@dataclass(frozen=True, slots=True)
class Offer:
    """What a sender announces before the data: the version, its manifest, each weight file's header."""

    version: int
    manifest: Manifest
    files: tuple[tuple[str, bytes], ...]
    bucket_bytes: int

    def encode(self) -> bytes:
        return msgspec.msgpack.encode({"version": self.version, "manifest": self.manifest.to_json(),
                                       "files": [list(f) for f in self.files],
                                       "bucket_bytes": self.bucket_bytes})  # fmt: skip

    @classmethod
    def decode(cls, data: bytes) -> Offer:
        raw = msgspec.msgpack.decode(data)
        manifest = Manifest.parse(raw["manifest"], where=f"the offer of v{raw['version']}")
        files = tuple((str(n), bytes(h)) for n, h in raw["files"])
        return cls(int(raw["version"]), manifest, files, int(raw["bucket_bytes"]))

    def items(self) -> tuple[list[Item], list[int]]:
        """Every tensor in stream order, and where each file's data starts in the stream (then the total)."""
        from dora.store.tensorfile import DTYPES

        items, starts, at = [], [], 0
        for name, head in self.files:
            starts.append(at)
            n = int.from_bytes(head[:8], "little")
            entries = json.loads(head[8 : 8 + n])
            size = 0
            for key, e in sorted(((k, e) for k, e in entries.items() if k != "__metadata__"),
                                 key=lambda ke: int(ke[1]["data_offsets"][0])):  # fmt: skip
                lo, hi = (int(x) for x in e["data_offsets"])
                if e["dtype"] not in DTYPES:
                    raise ValueError(f"{name}: tensor {key!r} has dtype {e['dtype']}, which this torch has not")
                items.append(Item(key, DTYPES[e["dtype"]], tuple(int(d) for d in e["shape"]), at + lo, hi - lo))
                size = max(size, hi)
            at += size
        starts.append(at)
        return items, starts


@dataclass(slots=True)
class Received:
    """A version a worker received: its tensors (views of the staging buffer, valid until the next receive)."""

    version: int
    digest: str
    bytes: int
    tensors: dict[str, torch.Tensor]
    seconds: dict[str, float] = field(default_factory=dict)
    """``receive`` (offer to last bucket), ``check`` (waiting for the last hashes), ``adopt`` (copy into ``into``)."""


def send(group: WeightGroup, manifest: Manifest, tensors: Mapping[str, torch.Tensor], *,
         shard_bytes: int = SHARD_BYTES, file: str = FILE, bucket_bytes: int = BUCKET_BYTES) -> float:  # fmt: skip
    """Broadcast version ``manifest.version`` from rank 0: ``tensors`` as published (the dtype written, tied tensors
    once: a ``HostSnapshot``'s views, or the learner's own on its device), laid out as the version's files
    (``shard_bytes``, ``file``: the store's). Returns the seconds it took."""
    started = time.perf_counter()
    plans = plan(tensors, None, shard_bytes=shard_bytes, file=file)
    if [p.name for p in plans] != manifest.weight_files():
        raise ValueError(f"v{manifest.version}: the tensors lay out as {[p.name for p in plans]}, the version's "
                         f"files are {manifest.weight_files()} (another shard size?)")  # fmt: skip
    offer = Offer(manifest.version, manifest, tuple((p.name, p.header) for p in plans), bucket_bytes)
    group.broadcast_bytes(offer.encode())
    items, starts = offer.items()
    sources = [_flat(tensors[i.key]) for i in items]
    total = starts[-1]
    buckets = [torch.empty(min(bucket_bytes, max(total, 1)), dtype=torch.uint8, device=group.device)
               for _ in range(2)]  # fmt: skip
    works: list[Any] = [None, None]
    j = 0  # the first item that may overlap the bucket
    for n, lo in enumerate(range(0, total, bucket_bytes)):
        hi = min(lo + bucket_bytes, total)
        buf = buckets[n % 2]
        if works[n % 2] is not None:
            works[n % 2].wait()  # the bucket's previous broadcast is done with it
        while items[j].start + items[j].nbytes <= lo:
            j += 1
        k = j
        while k < len(items) and items[k].start < hi:
            a, b = max(lo, items[k].start), min(hi, items[k].start + items[k].nbytes)
            buf[a - lo : b - lo].copy_(sources[k][a - items[k].start : b - items[k].start], non_blocking=True)
            k += 1
        if group.device.type == "cuda":
            torch.cuda.current_stream(group.device).synchronize()
        works[n % 2] = group.broadcast(buf[: hi - lo])
    for w in works:
        if w is not None:
            w.wait()
    seconds = time.perf_counter() - started
    log.info("weights_broadcast", version=manifest.version, bytes=total, receivers=group.world_size - 1,
             seconds=round(seconds, 3), gb_per_s=round(total / max(seconds, 1e-9) / 1e9, 2))  # fmt: skip
    return seconds


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (a view where it is contiguous)."""
    t = t.detach()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


class Receiver:
    """A worker's side: one staging buffer (and, on a GPU, its pinned host mirror), kept for the next version."""

    def __init__(self, group: WeightGroup, *, threads: int = THREADS) -> None:
        self.group = group
        self.threads = max(1, threads)
        self.staging: torch.Tensor | None = None
        self.host: torch.Tensor | None = None

    def receive(self, *, into: Mapping[str, torch.Tensor] | None = None, digest: str | None = None,
                version: int | None = None) -> Received:  # fmt: skip
        """The next version rank 0 sends, checked against its manifest (and that manifest against ``digest``, the
        version's published digest, when given), then copied into ``into`` (the same names and shapes; None: left in
        the staging buffer, as ``Received.tensors``). DigestMismatch or ValueError, with ``into`` untouched, when the
        bytes, the manifest or the tensors do not fit, or the version sent is not ``version`` (when given)."""
        started = time.perf_counter()
        offer = Offer.decode(self.group.broadcast_bytes(None))
        items, starts = offer.items()
        staging, host = self._reserve(starts[-1])
        problem = _unfit(offer, items, into, digest)
        if problem is None and version is not None and offer.version != version:
            problem = ValueError(f"v{offer.version} was sent, v{version} expected")
        checks = _Checks(offer, starts, host, self.threads if problem is None else 0)
        mirror = _Mirror(staging, host, copy=problem is None)
        try:
            for lo in range(0, starts[-1], offer.bucket_bytes):
                hi = min(lo + offer.bucket_bytes, starts[-1])
                self.group.broadcast(staging[lo:hi]).wait()
                checks.arrived(mirror.arrived(lo, hi))
            checks.arrived(mirror.drain(starts[-1]))
            received = time.perf_counter()
            if problem is not None:
                raise problem
            checks.verify()
        finally:
            checks.close()
        checked = time.perf_counter()
        views = {i.key: staging[i.start : i.start + i.nbytes].view(i.dtype).view(i.shape) for i in items}
        if into is not None:
            for key, t in views.items():
                into[key].copy_(t)
        m = offer.manifest
        seconds = {"receive": received - started, "check": checked - received, "adopt": time.perf_counter() - checked}
        log.info("weights_received", version=offer.version, bytes=starts[-1], digest=str(m.digest),
                 **{f"{k}_s": round(v, 3) for k, v in seconds.items()})  # fmt: skip
        return Received(offer.version, str(m.digest), starts[-1], views, seconds)

    def _reserve(self, total: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The staging buffer (on the group's device) and the host bytes hashed (the same on a CPU), of ``total``."""
        if self.staging is None or self.staging.numel() < total:
            self.staging = self.host = None
            self.staging = torch.empty(max(total, 1), dtype=torch.uint8, device=self.group.device)
            self.host = self.staging
            if self.group.device.type == "cuda":
                self.host = torch.empty(max(total, 1), dtype=torch.uint8, pin_memory=True)
        assert self.host is not None
        return self.staging, self.host


def _unfit(offer: Offer, items: Sequence[Item], into: Mapping[str, torch.Tensor] | None,
           digest: str | None) -> Exception | None:  # fmt: skip
    """Why this offer cannot be checked or adopted (raised once the data is drained), or None."""
    m, what = offer.manifest, f"v{offer.version}"
    try:
        want = Digest.parse(digest) if digest is not None else None
    except ValueError as e:
        return e
    if want is not None and m.digest != want:
        return DigestMismatch(f"{what}: the manifest sent is of {m.digest}, not the published {digest}")
    if not m.vouched() or not m.digest.chunk_bytes:
        return DigestMismatch(f"{what}: the manifest sent does not make its digest {m.digest} (edited?)")
    if [n for n, _ in offer.files] != m.weight_files():
        return DigestMismatch(f"{what}: files {[n for n, _ in offer.files]} sent, the manifest lists "
                              f"{m.weight_files()}")  # fmt: skip
    if into is None:
        return None
    sent = {i.key: i for i in items}
    if sent.keys() != into.keys():
        extra, missing = sorted(sent.keys() - into.keys()), sorted(into.keys() - sent.keys())
        return ValueError(f"{what}: its tensors are not the model's (not in the model: {extra[:3]}, not sent: "
                          f"{missing[:3]})")  # fmt: skip
    bad = [k for k, i in sent.items() if tuple(into[k].shape) != i.shape]
    if bad:
        return ValueError(f"{what}: tensor {bad[0]!r} is {list(sent[bad[0]].shape)} sent, "
                          f"{list(into[bad[0]].shape)} in the model")  # fmt: skip
    return None


class _Mirror:
    """The staging buffer's bytes on the host as the buckets arrive, for the hashes: on a GPU each bucket is copied
    to the pinned mirror on a stream of its own while the next one is broadcast; on a CPU they are there already."""

    def __init__(self, staging: torch.Tensor, host: torch.Tensor, *, copy: bool) -> None:
        self.staging, self.host = staging, host
        self.stream = torch.cuda.Stream(staging.device) if copy and staging.device.type == "cuda" else None
        self.pending: deque[tuple[int, Any]] = deque()
        self.landed = 0

    def arrived(self, lo: int, hi: int) -> int:
        """Bytes ``lo:hi`` are in the staging buffer (on the current stream): start their copy to the host; how
        many bytes from the start have landed there."""
        if self.stream is None:
            self.landed = hi
            return hi
        received = torch.cuda.Event()
        received.record()
        self.stream.wait_event(received)
        with torch.cuda.stream(self.stream):
            self.host[lo:hi].copy_(self.staging[lo:hi], non_blocking=True)
        done = torch.cuda.Event()
        done.record(self.stream)
        self.pending.append((hi, done))
        while self.pending and self.pending[0][1].query():
            self.landed = self.pending.popleft()[0]
        return self.landed

    def drain(self, total: int) -> int:
        """Every copy landed: ``total``."""
        if self.stream is not None:
            self.stream.synchronize()
            self.pending.clear()
        self.landed = total
        return total


class _Checks:
    """The digest chunks of a version's files, hashed in threads as soon as their bytes have arrived."""

    def __init__(self, offer: Offer, starts: list[int], host: torch.Tensor, threads: int) -> None:
        self.offer = offer
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="check") if threads else None
        data = memoryview(host.numpy()) if host.numel() else memoryview(b"")
        algo, step = offer.manifest.digest.algo, offer.manifest.digest.chunk_bytes
        self.todo: list[tuple[int, int, int, list[memoryview]]] = []  # (needed up to, file, chunk, pieces)
        for f, (_, head) in enumerate(offer.files):
            lo, hi = starts[f], starts[f + 1]
            chunks = chunk_pieces([memoryview(head), data[lo:hi]], step) if step else []
            for c, pieces in enumerate(chunks):
                end = min((c + 1) * step, len(head) + hi - lo)
                self.todo.append((lo + max(0, end - len(head)), f, c, pieces))
        self.todo.sort(key=lambda t: t[0])
        self.next = 0
        self.algo = algo
        self.done: dict[tuple[int, int], Future[str]] = {}
        self.sizes = [len(head) + starts[f + 1] - starts[f] for f, (_, head) in enumerate(offer.files)]

    def arrived(self, upto: int) -> None:
        while self.pool is not None and self.next < len(self.todo) and self.todo[self.next][0] <= upto:
            _, f, c, pieces = self.todo[self.next]
            self.next += 1
            self.done[(f, c)] = self.pool.submit(hash_pieces, self.algo, pieces)

    def verify(self) -> None:
        m, what = self.offer.manifest, f"v{self.offer.version}"
        for f, (name, _) in enumerate(self.offer.files):
            entry = m.files[name]
            got = [self.done[(f, c)].result() for c in range(len(entry.chunks)) if (f, c) in self.done]
            if self.sizes[f] != entry.bytes or len(got) != len(entry.chunks):
                raise DigestMismatch(f"{what} {name}: {self.sizes[f]} bytes sent, the manifest says {entry.bytes}")
            bad = [c for c, (a, b) in enumerate(zip(got, entry.chunks, strict=True)) if a != b]
            if bad:
                lo = bad[0] * m.digest.chunk_bytes
                raise DigestMismatch(f"{what} {name}: {len(bad)} of {len(got)} chunks differ from the manifest, the "
                                     f"first at bytes {lo}-{min(lo + m.digest.chunk_bytes, entry.bytes)}")  # fmt: skip

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
