"""File digests for the weight store: a tree of fixed-size chunk hashes, computed in parallel while the file is read.

A digest names how it was made, so a worker can check a file from the digest alone (it travels in
``WeightsPublished`` and ``Assign``, in the field still called ``sha256``):

- ``xxh3_128/16MiB:<root>`` (the default) or ``sha256/16MiB:<root>``: the file is cut into chunks of 16 MiB,
  each chunk is hashed on its own (in worker threads: both hashes release the GIL), and ``root`` is the hash of
  a line naming the algorithm, chunk size and file size followed by the chunk digests. The chunk digests go in
  the version's manifest, so a mismatch names the chunk (and bytes) that differ.
- 64 hex digits: the sha256 of the whole file, what format-1 manifests (and the engines' tests) carry; checked
  with one sequential pass.

xxh3_128 is not a cryptographic hash. It detects torn, truncated, stale and bit-flipped files at memory speed
(~15 GB/s a core here against sha256's ~2 GB/s); sha256 is there for a store whose files could be rewritten
by someone the run does not trust. ``bench/weights.py`` measures both (``--algo``).

A file named by its path or an open descriptor is read through ``os.preadv`` into a small buffer per thread, so the
bytes are hashed while they are in cache and nothing the size of the file is allocated. A file already in memory
(the mapping a load checks, then takes its tensors from) is hashed in place: the hash reads each byte once and
nothing is copied. A file being written (``dora.store.writer``) is hashed from the memory it is written from,
chunk by chunk as ``digest_file`` cuts it (``chunk_pieces``, ``hash_pieces``), in threads while the chunks go to
the disk. No torch here: the broker imports the store.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import xxhash

if TYPE_CHECKING:
    from typing_extensions import Buffer

ALGOS: dict[str, Callable[[], Any]] = {"xxh3_128": xxhash.xxh3_128, "sha256": hashlib.sha256}
CHUNK_BYTES = 16 << 20
PIECE_BYTES = 1 << 20
"""One read: small enough that the bytes are still in cache when they are hashed."""
THREADS = min(4, os.cpu_count() or 1)
_TREE = re.compile(r"(?P<algo>[a-z0-9_]+)/(?P<mib>\d+)MiB(?P<folder>/dir)?:(?P<root>[0-9a-f]+)")
_SHA256 = re.compile(r"[0-9a-f]{64}")


class DigestMismatch(ValueError):
    """A file's bytes are not the ones its digest names (flipped, truncated, replaced or half-written)."""


@dataclass(frozen=True, slots=True)
class Digest:
    algo: str
    chunk_bytes: int
    """0: one hash of the whole file (a format-1 manifest's plain sha256)."""
    root: str
    folder: bool = False
    """A folder's digest (``<algo>/<n>MiB/dir:<root>``): ``root`` is ``folder_root`` of its files' manifest entries."""

    @classmethod
    def parse(cls, text: str) -> Digest:
        if _SHA256.fullmatch(text):
            return cls("sha256", 0, text)
        found = _TREE.fullmatch(text)
        if found is None or found["algo"] not in ALGOS or int(found["mib"]) < 1:
            raise ValueError(f"not a weight digest: {text[:80]!r} (expected <algo>/<n>MiB[/dir]:<hex> or a sha256)")
        return cls(found["algo"], int(found["mib"]) << 20, found["root"], found["folder"] is not None)

    def __str__(self) -> str:
        if not self.chunk_bytes:
            return self.root
        return f"{self.algo}/{self.chunk_bytes >> 20}MiB{'/dir' if self.folder else ''}:{self.root}"


@dataclass(frozen=True, slots=True)
class FileDigest:
    """What hashing a file found."""

    digest: Digest
    size: int
    chunks: tuple[str, ...]
    seconds: float


def root_of(algo: str, chunk_bytes: int, size: int, chunks: Sequence[str]) -> str:
    h = ALGOS[algo]()
    h.update(f"dora-weights/{algo}/{chunk_bytes}/{size}\n".encode())
    for c in chunks:
        h.update(bytes.fromhex(c))
    return h.hexdigest()


def folder_root(algo: str, chunk_bytes: int, files: dict[str, tuple[int, Sequence[str]]]) -> str:
    """The digest of a folder: one line per file (name, size, its own chunk root), names in order. ``files``:
    name -> (size, chunk digests), as a version's manifest lists them."""
    h = ALGOS[algo]()
    h.update(f"dora-folder/{algo}/{chunk_bytes}\n".encode())
    for name in sorted(files):
        size, chunks = files[name]
        h.update(f"{name}\t{size}\t{root_of(algo, chunk_bytes, size, chunks)}\n".encode())
    return h.hexdigest()


def digest_file(file: str | pathlib.Path | int | Buffer, algo: str = "xxh3_128", chunk_bytes: int = CHUNK_BYTES,
                threads: int = THREADS) -> FileDigest:  # fmt: skip
    """Hash a file as ``algo`` chunks: a path, an open descriptor (then exactly the bytes behind it), or the file's
    bytes already in memory (a mapping of it: hashed where they lie)."""
    if algo not in ALGOS:
        raise ValueError(f"unknown digest algorithm {algo!r}; known: {sorted(ALGOS)}")
    algo = algo if chunk_bytes else "sha256"  # no chunks: one plain sha256 of the file (a format-1 digest)
    started = time.perf_counter()
    if not isinstance(file, str | os.PathLike | int):
        with memoryview(file) as view, view.cast("B") as data:
            size, chunks, whole = _digest(
                len(data), lambda h, lo, hi: h.update(data[lo:hi]), algo, chunk_bytes, threads
            )
    else:
        fd = file if isinstance(file, int) else os.open(file, os.O_RDONLY)
        try:
            local = threading.local()

            def read(h: Any, lo: int, hi: int) -> None:
                buf = getattr(local, "buf", None)
                if buf is None:
                    buf = local.buf = bytearray(PIECE_BYTES)
                _hash_range(fd, lo, hi, h, buf)

            size, chunks, whole = _digest(os.fstat(fd).st_size, read, algo, chunk_bytes, threads)
        finally:
            if not isinstance(file, int):
                os.close(fd)
    root = whole if whole is not None else root_of(algo, chunk_bytes, size, chunks)
    return FileDigest(Digest(algo, chunk_bytes, root), size, chunks, time.perf_counter() - started)


def _digest(size: int, update: Callable[[Any, int, int], None], algo: str, chunk_bytes: int,
            threads: int) -> tuple[int, tuple[str, ...], str | None]:  # fmt: skip
    """(size, chunk digests, whole-file digest when ``chunk_bytes`` is 0); ``update(h, lo, hi)`` feeds bytes to h."""
    if not chunk_bytes:
        h = ALGOS[algo]()
        update(h, 0, size)
        return size, (), h.hexdigest()

    def chunk(offset: int) -> str:
        h = ALGOS[algo]()
        update(h, offset, min(offset + chunk_bytes, size))
        return h.hexdigest()

    offsets = range(0, size, chunk_bytes)
    if threads > 1 and len(offsets) > 1:  # both hashes release the GIL on large updates
        with ThreadPoolExecutor(min(threads, len(offsets)), thread_name_prefix="digest") as pool:
            return size, tuple(pool.map(chunk, offsets)), None
    return size, tuple(map(chunk, offsets)), None


def chunk_pieces(pieces: Sequence[memoryview], chunk_bytes: int) -> list[list[memoryview]]:
    """A file's bytes given as consecutive ``pieces`` (byte views: a header, then spans of tensor memory), cut
    into the chunks a digest hashes: each chunk's pieces, views of the same memory (nothing copied)."""
    chunks: list[list[memoryview]] = [[]]
    room = chunk_bytes
    for piece in pieces:
        while len(piece):
            if not room:
                chunks.append([])
                room = chunk_bytes
            part, piece = piece[:room], piece[room:]
            chunks[-1].append(part)
            room -= len(part)
    return chunks if chunks[0] else []


def hash_pieces(algo: str, pieces: Sequence[memoryview]) -> str:
    """One chunk's digest from its pieces in memory: what ``digest_file`` finds for those bytes in a file."""
    h = ALGOS[algo]()
    for piece in pieces:
        h.update(piece)
    return str(h.hexdigest())


def _hash_range(fd: int, start: int, end: int, h: Any, buf: bytearray) -> None:
    view = memoryview(buf)
    offset = start
    while offset < end:
        n = os.preadv(fd, [view[: min(len(buf), end - offset)]], offset)
        if n == 0:
            raise DigestMismatch(f"the file ended at byte {offset} while being read (it shrank under the reader)")
        h.update(view[:n])
        offset += n


def verify(file: str | pathlib.Path | int | Buffer, expected: str | Digest, *, name: str,
           size: int | None = None, chunks: Sequence[str] = (), threads: int = THREADS) -> FileDigest:  # fmt: skip
    """Hash ``file`` the way ``expected`` says and raise DigestMismatch naming ``name`` unless it matches.
    ``size`` and ``chunks`` (from the version's manifest, when at hand) make the error say what differs."""
    want = expected if isinstance(expected, Digest) else Digest.parse(expected)
    got = digest_file(file, want.algo, want.chunk_bytes, threads)
    if got.digest == want:
        return got
    what = f"{name}: {want.algo} digest {got.digest.root[:12]}… does not match the published {want.root[:12]}…"
    if size is not None and got.size != size:
        raise DigestMismatch(f"{what}: the file has {got.size} bytes, its manifest says {size} (truncated or replaced)")
    bad = [i for i, (a, b) in enumerate(zip(got.chunks, chunks, strict=False)) if a != b]
    if bad and len(chunks) == len(got.chunks):
        lo = bad[0] * want.chunk_bytes
        raise DigestMismatch(f"{what}: {len(bad)} of {len(chunks)} chunks differ from the manifest, the first at "
                             f"bytes {lo}-{min(lo + want.chunk_bytes, got.size)}")  # fmt: skip
    raise DigestMismatch(f"{what} ({got.size} bytes)")


def sha256_file(path: str | pathlib.Path) -> str:
    """The sha256 of a file's bytes, one sequential pass (a format-1 digest)."""
    return digest_file(path, "sha256", 0).digest.root
