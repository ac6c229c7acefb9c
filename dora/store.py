"""The weight store: one directory per published version, written atomically, retired by the broker.

Below the three processes: the learner publishes into it, the rollout engines check what they load against the
digest published with it, and the broker deletes the versions its ledger retired. Its directories and their
removal are ``dora.storedir``, all the broker imports of it; torch and safetensors are imported here only when a
version is published (safetensors) or loaded (``dora.tensorfile``).

``<root>/v<N>/model.safetensors`` plus ``manifest.json``. The URI handed to rollout workers is
``file://<root>/v<N>/model.safetensors``; its digest (``dora.digest``) travels beside it.

- **Publish** writes the file into a temporary directory ``<root>/.v<N>.<pid>@<host>.<rand>.tmp``, hashes it
  from the page cache while the file's fsync runs, writes the manifest, and renames the directory into place
  (then fsyncs the root): a reader sees all of a version or none of it, and a listed version is whole after a
  crash of the process or of the machine.
- **Leftovers** of a publisher (or a retirement) that died are removed when a store is opened and before each
  publish, each with a ``store_temp_removed`` line: a temporary directory whose owner pid is gone from this host,
  or, written on another host, untouched for ``stale_temp_s``.
- **Load** maps the file once (private), checks the digest on that mapping (in threads, reading each byte in
  place) and cuts the tensors from the same mapping (``dora.tensorfile``): the bytes checked are the bytes loaded,
  even if the version is retired or re-published meanwhile, and the check adds one read of them, no copy.
  ``load_into`` copies into a model's tensors as it checks instead (each piece hashed, then copied from cache, each
  chunk compared with the manifest's): no read beyond the copy's own, for an engine that can put its previous
  weights back if a chunk differs (a torch engine keeps the mapping of the file it loaded them from).
- **Retire** removes a version once the broker's ledger no longer needs it (no worker serves it and all its
  groups are trained). A version is first renamed aside, then deleted, so no half-deleted version is listed.
  The ledger keeps at most K + 1 versions alive, so the store holds at most K + 2 while the next one is written.
  A broker restarted from its journal holds only the newest version alive: it retires the older ones at once
  (``retire_older``), or they would stay on disk for good. Both live in ``dora.storedir`` (re-exported here).

Manifest format 2: ``{"format": 2, "version", "bytes", "digest", "chunks", "timings_s"}``. A format-1 manifest
(``{"version", "sha256", "bytes", "write_s"}``, no ``format``) is still read: its digest is the file's plain
sha256. A newer format is refused with an error saying so.
"""

from __future__ import annotations

import bisect
import json
import os
import pathlib
import shutil
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import structlog

from dora.digest import ALGOS, CHUNK_BYTES, THREADS, Digest, DigestMismatch, digest_file, root_of, sha256_file, verify
from dora.storedir import FILE, MANIFEST, remove_version, retire_older, retire_uri, stale, store_path, temp_name

if TYPE_CHECKING:  # the broker imports this module to retire versions: no torch at run time
    import torch

__all__ = ["DigestMismatch", "InPlaceUnfit", "Manifest", "WeightStore", "load_into", "load_verified", "retire_older",
           "retire_uri", "sha256_file", "store_path"]  # fmt: skip

log = structlog.get_logger()

MANIFEST_FORMAT = 2


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    version: int
    digest: Digest
    bytes: int
    chunks: tuple[str, ...] = ()
    timings_s: dict[str, float] = field(default_factory=dict)
    format: int = MANIFEST_FORMAT

    @classmethod
    def read(cls, path: pathlib.Path) -> Manifest:
        try:
            raw = json.loads(path.read_text())
            fmt = raw.get("format", 1)
            if fmt == 1:
                return cls(version=raw["version"], digest=Digest("sha256", 0, raw["sha256"]), bytes=raw["bytes"],
                           timings_s={"write": raw.get("write_s", 0.0)}, format=1)  # fmt: skip
            if fmt == MANIFEST_FORMAT:
                return cls(version=raw["version"], digest=Digest.parse(raw["digest"]), bytes=raw["bytes"],
                           chunks=tuple(raw["chunks"]), timings_s=dict(raw.get("timings_s", {})))  # fmt: skip
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: not a readable manifest ({type(e).__name__}: {e})") from None
        newer = isinstance(fmt, int) and fmt > MANIFEST_FORMAT
        raise ValueError(f"{path}: manifest format {fmt!r}" + (" is newer than" if newer else " is not one")
                         + f" this dora reads (1 to {MANIFEST_FORMAT})")  # fmt: skip

    def to_json(self) -> str:
        return json.dumps({"format": self.format, "version": self.version, "bytes": self.bytes,
                           "digest": str(self.digest), "chunks": list(self.chunks),
                           "timings_s": {k: round(v, 4) for k, v in self.timings_s.items()}})  # fmt: skip


class WeightStore:
    def __init__(self, root: str | pathlib.Path, *, algo: str = "xxh3_128", chunk_bytes: int = CHUNK_BYTES,
                 fsync: bool = True, stale_temp_s: float = 3600.0) -> None:  # fmt: skip
        if algo not in ALGOS or chunk_bytes < 1 << 20 or chunk_bytes % (1 << 20):
            raise ValueError(f"digest {algo!r} in chunks of {chunk_bytes} bytes: need one of {sorted(ALGOS)}, "
                             "chunks a whole number of MiB")  # fmt: skip
        self.root = pathlib.Path(root)
        self.algo = algo
        self.chunk_bytes = chunk_bytes
        self.fsync = fsync
        self.stale_temp_s = stale_temp_s
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean()

    def path(self, version: int) -> pathlib.Path:
        return self.root / f"v{version}"

    def manifest(self, version: int) -> Manifest:
        return Manifest.read(self.path(version) / MANIFEST)

    def digest(self, version: int) -> str:
        """The digest a worker checks this version against (what ``publish`` returned)."""
        return str(self.manifest(version).digest)

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> tuple[str, str, float]:
        """Write ``state`` as version ``version``; returns (uri, digest, seconds)."""
        from safetensors.torch import save_file

        started = time.perf_counter()
        self.clean()
        final = self.path(version)
        tmp = self.root / temp_name(f"v{version}")
        tmp.mkdir()
        try:
            file = tmp / FILE
            save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(file))
            written = time.perf_counter()
            with ThreadPoolExecutor(1, thread_name_prefix="fsync") as pool:  # the disk writes while we hash
                synced = pool.submit(_fsync_timed, file, self.fsync)
                found = digest_file(file, self.algo, self.chunk_bytes)
                fsync_s = synced.result()
            committing = time.perf_counter()
            timings = {"write": written - started, "hash": found.seconds, "fsync": fsync_s}
            manifest = Manifest(version=version, digest=found.digest, bytes=found.size, chunks=found.chunks,
                                timings_s=timings)  # fmt: skip
            (tmp / MANIFEST).write_text(manifest.to_json())
            if self.fsync:
                _fsync_timed(tmp / MANIFEST, True)
                _fsync_timed(tmp, True)
            if final.exists():  # a re-publish of the same version (a restarted learner): replace it whole
                remove_version(final)
            os.replace(tmp, final)
            if self.fsync:
                _fsync_timed(self.root, True)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        seconds = time.perf_counter() - started
        commit_s = time.perf_counter() - committing
        log.info("weights_written", version=version, bytes=found.size, digest=str(found.digest),
                 write_s=round(timings["write"], 3), hash_s=round(found.seconds, 3), fsync_s=round(fsync_s, 3),
                 commit_s=round(commit_s, 3), gb_per_s=round(found.size / seconds / 1e9, 2))  # fmt: skip
        return f"file://{final / FILE}", str(found.digest), seconds

    def load(self, version: int, device: str = "cpu") -> dict[str, torch.Tensor]:
        """A published version's tensors, checked against its manifest's digest on the very bytes loaded."""
        return load_verified(self.path(version) / FILE, self.digest(version), name=f"v{version}", device=device)

    def retire(self, version: int) -> bool:
        """Delete a version's directory; False if it was not there."""
        return remove_version(self.path(version))

    def versions(self) -> list[int]:
        """The published versions: directories ``v<N>`` with their manifest, oldest first."""
        found = (p for p in self.root.glob("v*") if p.name[1:].isdigit() and (p / MANIFEST).is_file())
        return sorted(int(p.name[1:]) for p in found)

    def clean(self) -> list[pathlib.Path]:
        """Remove the temporary directories of publishers (or retirements) that are gone; returns them."""
        removed = []
        for p in self.root.glob(".v*.tmp"):
            reason = stale(p, self.stale_temp_s)
            if reason is not None:
                shutil.rmtree(p, ignore_errors=True)
                log.info("store_temp_removed", path=str(p), reason=reason)
                removed.append(p)
        return removed


def load_verified(file: str | pathlib.Path, digest: str | None, *, name: str, device: str = "cpu") -> dict[str, Any]:
    """The tensors of a safetensors file, its ``digest`` checked first (None: not checked) on the private mapping of
    the file they are then cut from (``dora.tensorfile``). A mismatch raises DigestMismatch naming ``name``; a file
    that cannot be opened, OSError; one that is not a safetensors file, ValueError."""
    from dora.tensorfile import map_file, tensors

    file = pathlib.Path(file)
    fd = os.open(file, os.O_RDONLY)
    try:
        data = map_file(fd)
    finally:
        os.close(fd)  # the mapping holds the file's bytes from here on, whatever happens to its name
    if digest is not None:
        beside = _manifest_for(file, digest)
        verify(data, digest, name=f"{name} at {file}", size=beside.bytes if beside else None,
               chunks=beside.chunks if beside else ())  # fmt: skip
    return tensors(data, name=f"{name} at {file}", device=device)


IN_PLACE_PIECE_BYTES = 4 << 20
"""What ``load_into`` hashes then copies at once: small enough that the copy reads it from cache."""


class InPlaceUnfit(Exception):
    """``load_into`` does not apply to this file and model (the caller loads through ``load_verified``); nothing
    was copied."""


def load_into(file: str | pathlib.Path, digest: str, *, name: str, into: Mapping[str, torch.Tensor],
              undo: Callable[[], None], threads: int = THREADS) -> dict[str, Any]:  # fmt: skip
    """Copy a safetensors file's tensors into ``into`` (the same names, dtypes and shapes: contiguous CPU tensors),
    checking ``digest`` as the bytes go: each piece of a chunk is hashed, then copied while it is still in cache,
    and each chunk's hash is compared with the manifest's (whose chunks make the published digest). Every byte is
    read from memory once, as by an unchecked copy. A chunk that differs (or any failure once copying began):
    ``undo()`` is called, which must put back what ``into`` held, and the error raised (DigestMismatch naming the
    chunk). Raises InPlaceUnfit, before copying anything, when the digest has no chunks, no manifest beside the
    file makes it, or a tensor does not match ``into``. Returns the file's tensors, views of its private mapping
    (what a later ``undo`` can copy back from)."""
    import numpy as np
    import torch

    from dora.tensorfile import header, map_file, tensors

    file = pathlib.Path(file)
    want = Digest.parse(digest)
    beside = _manifest_for(file, digest) if want.chunk_bytes else None
    if beside is None or root_of(want.algo, want.chunk_bytes, beside.bytes, beside.chunks) != want.root:
        raise InPlaceUnfit(f"{name}: no manifest beside {file} whose chunks make the published digest")
    fd = os.open(file, os.O_RDONLY)
    try:
        data = map_file(fd)
    finally:
        os.close(fd)
    what = f"{name} at {file}"
    if len(data) != beside.bytes or len(beside.chunks) != -(-len(data) // want.chunk_bytes):
        raise DigestMismatch(f"{what}: the file has {len(data)} bytes, its manifest says {beside.bytes} in "
                             f"{len(beside.chunks)} chunks (truncated or replaced)")  # fmt: skip
    layout = header(data, name=what)
    if layout.keys() != into.keys():
        raise InPlaceUnfit(f"{what}: its tensors are not the model's")
    spans = []
    for key, (dtype, shape, offset, count) in layout.items():
        t = into[key]
        if t.dtype != dtype or list(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
            raise InPlaceUnfit(f"{what}: tensor {key!r} differs from the model's in dtype, shape or layout")
        if count:
            spans.append((offset, offset + count * dtype.itemsize, t.view(-1).view(torch.uint8).numpy()))
    spans.sort(key=lambda s: s[0])
    starts = [s[0] for s in spans]
    src = np.frombuffer(data, dtype=np.uint8)
    size, step = len(data), want.chunk_bytes

    def chunk(i: int) -> bool:
        lo, hi = i * step, min((i + 1) * step, size)
        h = ALGOS[want.algo]()
        j = max(0, bisect.bisect_right(starts, lo) - 1)
        for p in range(lo, hi, IN_PLACE_PIECE_BYTES):
            q = min(p + IN_PLACE_PIECE_BYTES, hi)
            h.update(src[p:q])
            while j < len(spans) and spans[j][0] < q:
                s, e, dst = spans[j]
                a, b = max(s, p), min(e, q)
                if a < b:
                    np.copyto(dst[a - s : b - s], src[a:b])
                if e > q:
                    break
                j += 1
        return h.hexdigest() == beside.chunks[i]

    try:
        n = len(beside.chunks)
        with ThreadPoolExecutor(max(1, min(threads, n)), thread_name_prefix="load") as pool:
            good = list(pool.map(chunk, range(n)))
        bad = [i for i, ok in enumerate(good) if not ok]
        if bad:
            lo = bad[0] * step
            raise DigestMismatch(f"{what}: {want.algo} digest: {len(bad)} of {n} chunks differ from the manifest, "
                                 f"the first at bytes {lo}-{min(lo + step, size)}")  # fmt: skip
    except BaseException:
        undo()
        raise
    return tensors(data, name=what)


def _manifest_for(file: pathlib.Path, digest: str) -> Manifest | None:
    """The manifest beside ``file`` if it describes the published digest (its size and chunks then apply)."""
    try:
        found = Manifest.read(file.parent / MANIFEST)
        return found if found.digest == Digest.parse(digest) else None
    except (OSError, ValueError):
        return None


def _fsync_timed(path: pathlib.Path, enabled: bool) -> float:
    started = time.perf_counter()
    if enabled:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - started
