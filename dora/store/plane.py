"""The weights' data plane, its server side: a version's manifest and chunks served over ZeroMQ, so a rollout worker
needs no filesystem shared with the learner.

One ``ChunkServer`` runs in the learner's process (serving its store) and one in each rollout worker's that has a
node-local store (``rollout.store``), relaying what that node fetched to the nodes below it
(``dora.store.relays``). The server runs on its own thread with its own ``zmq.Context``, made and destroyed there,
behind a ROUTER socket; its endpoint is what ``WeightsPublished.sources`` and ``Assign.sources`` name.

The protocol, one request per chunk, many in flight on one DEALER socket (``dora.store.fetch``):

- ``[tag, b"M", b"<version>", b"<digest>", *upstream]`` -> ``[tag, b"ok", manifest bytes]``; a relay (a worker's
  server) that does not hold the version and is told its digest and the sources above it (``upstream``) fetches it
  into its store, its node's, and says ``b"wait"`` meanwhile: a node's parent relay need not have been assigned
  the version itself;
- ``[tag, b"C", b"<version>", file name, b"<chunk index>"]`` -> ``[tag, b"ok", the chunk's bytes]``, sent zero-copy
  from a read-only mapping of the file (the frame is a view of the page cache);
- ``b"wait"`` instead of ``b"ok"``: the version is being fetched here and that chunk has not come yet (ask again);
  ``b"none"``: this server does not hold the version, the file or the chunk.

A version is held whole (``<root>/v<N>/`` with its manifest) or partially while this node fetches it: a fetcher's
temporary directory (``.v<N>.<pid>@<host>.<rand>.tmp``) holds the manifest, the files at their full size, and
``.progress``, one byte per chunk set once that chunk is written and checked; a chunk is served only then. The
server never checks digests: the fetcher checks every chunk against the manifest the published digest names.
"""

from __future__ import annotations

import mmap
import os
import pathlib
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import structlog
import zmq

from dora.store.dirs import MANIFEST
from dora.store.manifest import Manifest

__all__ = ["CHUNK_REQ", "MANIFEST_REQ", "NONE", "OK", "PROGRESS", "WAIT", "ChunkServer", "chunk_count",
           "host_address"]  # fmt: skip

log = structlog.get_logger()

MANIFEST_REQ, CHUNK_REQ = b"M", b"C"
OK, WAIT, NONE = b"ok", b"wait", b"none"
PROGRESS = ".progress"
"""In a version being fetched: one byte per chunk (the files' chunks in name order), 1 once written and checked."""
POLL_MS = 100
"""How often the server's thread looks at its stop flag while no request comes."""


def chunk_count(size: int, chunk_bytes: int) -> int:
    return -(-size // chunk_bytes)


def host_address(host: str | None = None) -> str:
    """The address other nodes reach this host by: its name resolved (127.0.0.1 when it does not resolve)."""
    try:
        return socket.gethostbyname(host or socket.gethostname())
    except OSError:
        return "127.0.0.1"


@dataclass(slots=True)
class _Held:
    """A version this server holds: its folder, its manifest, and for one being fetched here, its progress."""

    folder: pathlib.Path
    manifest: bytes
    chunk_bytes: int
    first: dict[str, int]
    """File -> the index of its first chunk among the version's (where its bytes of ``.progress`` start)."""
    sizes: dict[str, int]
    progress: int | None
    """A descriptor of ``.progress`` while the version is partial here; None: whole."""
    maps: dict[str, Any] = field(default_factory=dict)

    def close(self) -> None:
        if self.progress is not None:
            os.close(self.progress)
            self.progress = None
        self.maps.clear()  # a mapping lives on while a frame being sent still views it


class ChunkServer:
    """Serves the versions in store ``root`` (whole or being fetched) on ``bind`` (``tcp://<address>:0``: this host,
    a free port). ``start`` returns the endpoint; ``stop`` ends the thread, closes the socket and the context."""

    def __init__(self, root: str | pathlib.Path, bind: str = "", *,
                 relay: Callable[[int, str, list[str]], object] | None = None) -> None:  # fmt: skip
        self.root = pathlib.Path(root)
        self.relay = relay
        """A worker's server: ``relay(version, digest, upstream)`` fetches a version asked for and not held into
        this store (``dora.store.fetch.relay_server``); None (the learner's): what is not held is not served."""
        self._pulls: dict[int, threading.Thread] = {}
        self.bind = bind or f"tcp://{host_address()}:0"
        self.endpoint = ""
        self.sent_bytes = 0
        """Chunk bytes sent (the bytes a learner's server sends per byte of a version: the relays' use)."""
        self.chunks_sent = 0
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._held: dict[int, _Held] = {}
        self._thread = threading.Thread(target=self._run, name="chunk-server", daemon=True)

    def start(self, timeout_s: float = 10.0) -> str:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise RuntimeError(f"the chunk server did not bind {self.bind} within {timeout_s:g} s")
        if self._error is not None:
            raise RuntimeError(f"the chunk server cannot bind {self.bind}: {self._error}") from self._error
        log.info("chunk_server_started", endpoint=self.endpoint, root=str(self.root))
        return self.endpoint

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)

    def __enter__(self) -> ChunkServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _run(self) -> None:
        ctx = zmq.Context()  # this thread's own, destroyed here
        try:
            sock = ctx.socket(zmq.ROUTER)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                sock.bind(self.bind)
                self.endpoint = _advertised(sock.getsockopt_string(zmq.LAST_ENDPOINT))
            except zmq.ZMQError as e:
                self._error = e
                return
            finally:
                self._ready.set()
            while not self._stop.is_set():
                if sock.poll(POLL_MS):
                    self._answer(sock, sock.recv_multipart(copy=True))
        finally:
            for held in self._held.values():
                held.close()
            ctx.destroy(linger=0)

    def _answer(self, sock: zmq.Socket[Any], frames: list[bytes]) -> None:
        """Answer one request; a malformed one is dropped (a fetcher times it out)."""
        if len(frames) < 4 or frames[2] not in (MANIFEST_REQ, CHUNK_REQ):
            log.warning("chunk_request_malformed", frames=len(frames))
            return
        ident, tag, kind, version = frames[0], frames[1], frames[2], frames[3]
        try:
            held = self._version(int(version))
        except (ValueError, OSError) as e:
            log.warning("chunk_version_unreadable", version=version[:20].decode(errors="replace"), error=str(e))
            held = None
        if held is None and kind == MANIFEST_REQ and self._pull(int(version), frames[4:]):
            sock.send_multipart([ident, tag, WAIT, b""])
        elif held is None:
            sock.send_multipart([ident, tag, NONE, b""])
        elif kind == MANIFEST_REQ:
            sock.send_multipart([ident, tag, OK, held.manifest])
        elif len(frames) == 6:
            status, data = self._chunk(held, frames[4].decode(errors="replace"), frames[5])
            sock.send_multipart([ident, tag, status, data], copy=False)
            if status == OK:
                self.sent_bytes += len(data)
                self.chunks_sent += 1

    def _pull(self, version: int, asked: list[bytes]) -> bool:
        """A relay asked for a version it does not hold, with its digest and the sources above it: fetch it (once
        at a time) into this node's store; whether it is being fetched. A failed fetch is logged; the asker's own
        timeout leaves this relay for the next source."""
        relay = self.relay
        if relay is None or len(asked) < 2:
            return False
        running = self._pulls.get(version)
        if running is not None and running.is_alive():
            return True
        digest, upstream = asked[0].decode(errors="replace"), [u.decode(errors="replace") for u in asked[1:]]
        thread = threading.Thread(target=relay, args=(version, digest, upstream), name=f"relay-v{version}",
                                  daemon=True)  # fmt: skip
        self._pulls[version] = thread
        thread.start()
        return True

    def _chunk(self, held: _Held, name: str, index: bytes) -> tuple[bytes, Any]:
        """(status, bytes) for chunk ``index`` of file ``name``: a view of the file's mapping when it is there."""
        size = held.sizes.get(name)
        i = int(index) if index.isdigit() else -1
        if size is None or not 0 <= i < chunk_count(size, held.chunk_bytes):
            return NONE, b""
        if held.progress is not None and os.pread(held.progress, 1, held.first[name] + i) != b"\x01":
            return WAIT, b""
        data = held.maps.get(name)
        if data is None:
            with open(held.folder / name, "rb") as f:
                data = held.maps[name] = memoryview(mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ))
        lo = i * held.chunk_bytes
        return OK, data[lo : min(lo + held.chunk_bytes, size)]

    def _version(self, version: int) -> _Held | None:
        """The version as held now: cached while its folder is there (a partial one found again once renamed whole;
        a retired one let go, with its mappings)."""
        held = self._held.get(version)
        if held is not None and held.folder.is_dir():
            return held
        if held is not None:
            held.close()
            del self._held[version]
        whole = self.root / f"v{version}"
        if (whole / MANIFEST).is_file():
            found = _held(whole, None)
        else:
            partial = [p for p in self.root.glob(f".v{version}.*.tmp") if (p / PROGRESS).is_file()]
            found = _held(partial[0], partial[0] / PROGRESS) if partial else None
        if found is not None:
            self._held[version] = found
        return found


def _held(folder: pathlib.Path, progress: pathlib.Path | None) -> _Held | None:
    """A version folder as served; None when its manifest is not readable (yet) or has no chunks to serve."""
    try:
        raw = (folder / MANIFEST).read_bytes()
        manifest = Manifest.read(folder / MANIFEST)
    except (OSError, ValueError):
        return None
    if not manifest.digest.chunk_bytes:
        return None  # a format-1 version: one plain sha256, no chunks to check one by one
    first, n = {}, 0
    for name in sorted(manifest.files):
        first[name] = n
        n += chunk_count(manifest.files[name].bytes, manifest.digest.chunk_bytes)
    fd = os.open(progress, os.O_RDONLY) if progress is not None else None
    return _Held(folder, raw, manifest.digest.chunk_bytes, first, {k: e.bytes for k, e in manifest.files.items()}, fd)


def _advertised(endpoint: str) -> str:
    """A bound endpoint as other hosts connect to it: a wildcard address replaced by this host's."""
    for wildcard in ("tcp://0.0.0.0:", "tcp://*:"):
        if endpoint.startswith(wildcard):
            return f"tcp://{host_address()}:{endpoint.removeprefix(wildcard)}"
    return endpoint
