"""The weights' data plane, its fetching side: a version copied chunk by chunk from the servers that hold it
(``dora.store.plane``) into a node-local store, every chunk checked against the manifest the published digest
names, so the local store ends up with the same version folder under the same digest.

``fetch`` asks the sources in order: the first that answers with the manifest the digest names serves the chunks,
a window of requests in flight on one socket. Every request has a timeout; a source that goes silent, does not hold
the version, or sends a chunk whose digest differs from the manifest's is left for the next one (the chunks already
checked are kept). The last source is always the learner's server. The chunks are written into a temporary
directory inside the store (``dora.store.dirs.temp_name``) that the node's own server relays from as they come
(``.progress``); the files are fsynced and the directory renamed to ``v<N>`` whole.

Workers on one node share its store: one fetches, under the store's lock file (``fcntl.flock``); the others wait
for the lock, then find the version there and load it from the page cache the fetch filled, with no second transfer.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import pathlib
import shutil
import struct
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from dora.store.digest import ALGOS, Digest
from dora.store.dirs import MANIFEST, remove_version, stale, sync_path, temp_name
from dora.store.manifest import Manifest
from dora.store.plane import CHUNK_REQ, MANIFEST_REQ, OK, PROGRESS, WAIT, ChunkServer, chunk_count

__all__ = ["FetchFailed", "Fetched", "fetch", "relay_server", "retire_local"]

log = structlog.get_logger()

LOCK = ".fetch.lock"
WINDOW = 8
"""Chunk requests in flight on one source: enough to keep a 16 MiB-chunk stream busy while one is checked."""
WAIT_S = 0.02
"""How soon a chunk a relay does not hold yet is asked for again."""
STALE_S = 600.0


class FetchFailed(Exception):
    """No source served the version whole (each one's reason in the message)."""


@dataclass(frozen=True, slots=True)
class Fetched:
    path: pathlib.Path
    bytes: int
    seconds: float
    served: dict[str, int] = field(default_factory=dict)
    """Source endpoint -> the chunk bytes it served (empty: the version was in the store already)."""


@dataclass(slots=True)
class _Target:
    """The version being written: its files open at full size, its progress, what each source served."""

    tmp: pathlib.Path
    manifest: Manifest
    fds: dict[str, int]
    progress: int
    first: dict[str, int]
    served: dict[str, int] = field(default_factory=dict)

    def close(self) -> None:
        for fd in [*self.fds.values(), self.progress]:
            os.close(fd)
        self.fds.clear()


def fetch(version: int, digest: str, sources: Sequence[str], into_root: str | pathlib.Path, *,
          timeout_s: float = 10.0, window: int = WINDOW) -> Fetched:  # fmt: skip
    """Version ``version`` (published with ``digest``) in store ``into_root`` as ``v<N>``, fetched from ``sources``
    unless it is there already; waits for another process of this node fetching into the same store. Raises
    FetchFailed when no source serves it whole."""
    want = Digest.parse(digest)
    if not want.chunk_bytes:
        raise FetchFailed(f"v{version}: a whole-file digest has no chunks to fetch one by one")
    root = pathlib.Path(into_root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version}"
    started = time.perf_counter()
    with _locked(root / LOCK) as waited_s:
        if _holds(final, want):
            log.info("weights_local", version=version, path=str(final), waited_s=round(waited_s, 3))
            return Fetched(final, 0, time.perf_counter() - started)
        _sweep(root)
        tmp = root / temp_name(final.name)
        tmp.mkdir()
        try:
            with _context() as ctx:
                target, first = _open(ctx, version, want, sources, tmp, timeout_s)
                try:
                    _pull_all(ctx, version, target, sources[first:], timeout_s, window)
                finally:
                    target.close()
            _seal(tmp, final, want)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    took = time.perf_counter() - started
    got = Fetched(final, target.manifest.bytes, took, dict(target.served))
    log.info("weights_fetched", version=version, bytes=got.bytes, seconds=round(took, 4),
             gb_s=round(got.bytes / took / 1e9, 3), source=max(got.served, key=got.served.__getitem__, default=""),
             served=got.served, path=str(final))  # fmt: skip
    return got


def relay_server(root: str | pathlib.Path, bind: str = "", timeout_s: float = 10.0) -> ChunkServer:
    """A worker's chunk server over its node's store: it serves what the node holds or is fetching, and fetches a
    version another node asks it for (with the digest and the sources above it) when it holds none."""

    def relay(version: int, digest: str, upstream: list[str]) -> None:
        try:
            fetch(version, digest, upstream, root, timeout_s=timeout_s)
        except (FetchFailed, OSError, ValueError) as e:
            log.warning("weights_relay_fetch_failed", version=version, error=str(e))

    return ChunkServer(root, bind, relay=relay)


def retire_local(root: str | pathlib.Path, version: int) -> bool:
    """Remove a node-local store's copy of ``version`` (the broker retired it); False if it held none."""
    return remove_version(pathlib.Path(root) / f"v{version}")


@contextlib.contextmanager
def _locked(path: pathlib.Path) -> Iterator[float]:
    """The node store's lock, held for the body; yields how long it was waited for."""
    started = time.perf_counter()
    with open(path, "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield time.perf_counter() - started
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _context() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()  # this fetch's own
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


def _holds(folder: pathlib.Path, want: Digest) -> bool:
    """The store holds the version whole: its manifest is the one the digest names (each file was checked chunk by
    chunk before it was renamed into place; the load checks them again)."""
    try:
        found = Manifest.read(folder / MANIFEST)
    except (OSError, ValueError):
        return False
    return found.digest == want and found.vouched()


def _sweep(root: pathlib.Path) -> None:
    """Remove the temporary directories of fetchers that died (the lock is held: none of this store's is alive)."""
    for p in root.glob(".v*.tmp"):
        why = stale(p, STALE_S)
        if why is not None:
            log.info("weights_leftover_removed", path=str(p), why=why)
            shutil.rmtree(p, ignore_errors=True)


def _request(sock: zmq.Socket[Any], tag: int, *parts: bytes) -> None:
    sock.send_multipart([struct.pack("<Q", tag), *parts], copy=False)


def _socket(ctx: zmq.Context[Any], source: str) -> zmq.Socket[Any]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.connect(source)
    return sock


def _open(ctx: zmq.Context[Any], version: int, want: Digest, sources: Sequence[str], tmp: pathlib.Path,
          timeout_s: float) -> tuple[_Target, int]:  # fmt: skip
    """The manifest the digest names, from the first source that serves it, written into ``tmp`` with every file
    made at its full size and the progress file beside them; and that source's index."""
    why = []
    for i, source in enumerate(sources):
        raw = _manifest(ctx, source, version, want, sources[i + 1 :], timeout_s)
        if isinstance(raw, str):
            why.append(f"{source}: {raw}")
            continue
        (tmp / MANIFEST).write_bytes(raw)
        try:
            manifest = Manifest.read(tmp / MANIFEST)
        except ValueError as e:
            why.append(f"{source}: {e}")
            continue
        if manifest.digest != want or not manifest.vouched():
            why.append(f"{source}: its manifest is not the one the published digest names")
            continue
        return _prepare(tmp, manifest), i
    log.warning("weights_manifest_unavailable", version=version, reasons=why)
    raise FetchFailed(f"v{version}: no source served its manifest: " + "; ".join(why))


def _manifest(ctx: zmq.Context[Any], source: str, version: int, want: Digest, upstream: Sequence[str],
              timeout_s: float) -> bytes | str:  # fmt: skip
    """A source's manifest of ``version``, or why not. A relay that does not hold it yet is told the digest and the
    sources after it (``upstream``): it starts fetching it and says wait, and it is asked again until it serves
    the manifest or ``timeout_s`` passes without it."""
    sock = _socket(ctx, source)
    ask = [MANIFEST_REQ, str(version).encode(), str(want).encode(), *(u.encode() for u in upstream)]
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            _request(sock, 0, *ask)
            if not sock.poll(max(1, int((deadline - time.monotonic()) * 1000))):
                return f"silent for {timeout_s:g} s"
            _, status, raw = sock.recv_multipart()
            if status == OK:
                return raw
            if status != WAIT:
                return f"does not hold v{version}"
            if time.monotonic() + WAIT_S > deadline:
                return f"still fetching v{version} after {timeout_s:g} s"
            time.sleep(WAIT_S)
    finally:
        sock.close(linger=0)


def _prepare(tmp: pathlib.Path, manifest: Manifest) -> _Target:
    fds, first, n = {}, {}, 0
    for name in sorted(manifest.files):
        size = manifest.files[name].bytes
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        fds[name] = os.open(tmp / name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        _allocate(fds[name], size)
        first[name] = n
        n += chunk_count(size, manifest.digest.chunk_bytes)
    progress = os.open(tmp / PROGRESS, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    os.ftruncate(progress, n)  # zeros: no chunk yet; the node's server relays each chunk once its byte is set
    return _Target(tmp, manifest, fds, progress, first)


def _allocate(fd: int, size: int) -> None:
    """The file at its full size, its blocks allocated now: writing the chunks into allocated blocks runs about
    three times as fast as into a sparse file (measured on ext4 and tmpfs)."""
    os.ftruncate(fd, size)
    if size:
        with contextlib.suppress(OSError):  # a filesystem that cannot allocate ahead keeps the sparse file
            os.posix_fallocate(fd, 0, size)


def _pull_all(ctx: zmq.Context[Any], version: int, target: _Target, sources: Sequence[str], timeout_s: float,
              window: int) -> None:  # fmt: skip
    """Every chunk, from the sources in order: each one until it is silent, lacks the version or a chunk it sends
    differs; then the next one, for the chunks not yet written."""
    cb = target.manifest.digest.chunk_bytes
    todo = deque((name, i) for name in sorted(target.fds) for i in range(chunk_count(target.manifest.files[name].bytes,
                                                                                        cb)))  # fmt: skip
    why = []
    for source in sources:
        if not todo:
            return
        sock = _socket(ctx, source)
        try:
            failed = _pull(sock, version, target, source, todo, timeout_s, window)
        finally:
            sock.close(linger=0)
        if failed is None:
            return
        why.append(f"{source}: {failed}")
        log.warning("weights_source_failed", version=version, source=source, reason=failed, chunks_left=len(todo))
    if todo:
        raise FetchFailed(f"v{version}: {len(todo)} chunks left, every source failed: " + "; ".join(why))


def _pull(sock: zmq.Socket[Any], version: int, target: _Target, source: str, todo: deque[tuple[str, int]],
          timeout_s: float, window: int) -> str | None:  # fmt: skip
    """Chunks from one source into ``target`` until ``todo`` is empty (None) or why it was left; what was not
    written is back in ``todo``."""
    inflight: dict[bytes, tuple[str, int]] = {}
    later: deque[tuple[float, tuple[str, int]]] = deque()
    tag, heard, v = 1, time.monotonic(), str(version).encode()
    try:
        while todo or inflight or later:
            now = time.monotonic()
            while later and later[0][0] <= now:
                todo.append(later.popleft()[1])
            while todo and len(inflight) < window:
                name, i = todo.popleft()
                inflight[struct.pack("<Q", tag)] = (name, i)
                _request(sock, tag, CHUNK_REQ, v, name.encode(), str(i).encode())
                tag += 1
            if now - heard > timeout_s:
                return f"silent for {timeout_s:g} s"
            wait_s = min(timeout_s, later[0][0] - now if later else timeout_s)
            if not sock.poll(max(1, int(wait_s * 1000))):
                continue
            frames = sock.recv_multipart(copy=False)
            job = inflight.pop(frames[0].bytes, None)
            if job is None:
                continue
            status = frames[1].bytes
            if status == WAIT:  # a relay still fetching it: ask again soon (silence, not this, ends the wait)
                later.append((time.monotonic() + WAIT_S, job))
                continue
            if status != OK:
                todo.appendleft(job)
                return f"does not hold v{version} ({status.decode(errors='replace')})"
            if not _write(target, job, frames[2].buffer):
                todo.appendleft(job)
                return f"chunk {job[1]} of {job[0]} differs from the manifest"
            target.served[source] = target.served.get(source, 0) + len(frames[2].buffer)
            heard = time.monotonic()
        return None
    finally:
        todo.extend(inflight.values())
        todo.extend(job for _, job in later)


def _write(target: _Target, job: tuple[str, int], data: Any) -> bool:
    """Check one chunk against the manifest and write it; False if it differs."""
    name, i = job
    d = target.manifest.digest
    size = target.manifest.files[name].bytes
    if len(data) != min(d.chunk_bytes, size - i * d.chunk_bytes):
        return False
    h = ALGOS[d.algo]()
    h.update(data)
    if h.hexdigest() != target.manifest.files[name].chunks[i]:
        return False
    view = memoryview(data)
    offset, done = i * d.chunk_bytes, 0
    while done < len(view):
        done += os.pwrite(target.fds[name], view[done:], offset + done)
    os.pwrite(target.progress, b"\x01", target.first[name] + i)
    return True


def _seal(tmp: pathlib.Path, final: pathlib.Path, want: Digest) -> None:
    """Make the fetched version durable and put it in place whole (one already there that holds it is kept)."""
    for p in tmp.rglob("*"):
        if p.is_file() and p.name != PROGRESS:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    (tmp / PROGRESS).unlink()
    sync_path(tmp)
    try:
        os.rename(tmp, final)
    except OSError:
        if not _holds(final, want):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        return
    sync_path(final.parent)
