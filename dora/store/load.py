"""Loading a published version: the bytes checked are the bytes loaded.

- ``load_verified`` maps each weight file once (private), checks its digest on that mapping (in threads, reading
  each byte in place) and cuts the tensors from the same mapping (``dora.store.tensorfile``): the check adds one
  read, no copy, and holds even if the version is retired or re-published meanwhile.
- ``load_into`` copies into a model's tensors as it checks instead: each piece of a chunk is hashed, then copied
  while still in cache, each chunk compared with the manifest's. No read beyond the copy's own, for an engine
  that can put its previous weights back if a chunk differs.

A version folder (manifest format 3, digest ``.../dir:<root>``) is checked in two steps: the manifest beside the
files must be the one the digest names (its list of files, sizes and chunk digests makes the root), then every
file listed is checked against its own chunks (the config and tokenizer as well as the shards). A single file (a
format-2 version, or a plain file named with its sha256) is checked against the digest directly.
"""

from __future__ import annotations

import bisect
import json
import os
import pathlib
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from dora.store.digest import ALGOS, THREADS, Digest, DigestMismatch, digest_file, folder_root, verify
from dora.store.dirs import FILE, MANIFEST
from dora.store.manifest import Manifest

if TYPE_CHECKING:
    import torch

IN_PLACE_PIECE_BYTES = 4 << 20
"""What ``load_into`` hashes then copies at once: small enough that the copy reads it from cache."""
INDEX = "model.safetensors.index.json"


class InPlaceUnfit(Exception):
    """``load_into`` does not apply to this version and model (the caller loads through ``load_verified``);
    nothing was copied."""


@dataclass(slots=True)
class Mapped:
    """One weight file, mapped, and what its bytes must hash to (``chunks``: the manifest's, when known)."""

    file: pathlib.Path
    data: Any
    digest: Digest | None
    chunks: tuple[str, ...] = ()
    size: int | None = None


def _map(file: pathlib.Path) -> Any:
    from dora.store.tensorfile import map_file

    fd = os.open(file, os.O_RDONLY)
    try:
        return map_file(fd)
    finally:
        os.close(fd)  # the mapping holds the file's bytes from here on, whatever happens to its name


def version_folder(path: pathlib.Path) -> pathlib.Path:
    return path.parent if path.suffix == ".safetensors" else path


def _folder_manifest(folder: pathlib.Path, want: Digest, name: str) -> Manifest:
    """The manifest beside a version folder's files, if it is the one ``want`` names; else DigestMismatch."""
    try:
        found = Manifest.read(folder / MANIFEST)
    except FileNotFoundError:
        raise DigestMismatch(f"{name} at {folder}: no {MANIFEST} beside the files (not a published version)") from None
    if found.digest != want or not found.vouched():
        raise DigestMismatch(f"{name} at {folder}: its {MANIFEST} is not the one the published digest names "
                             "(replaced or edited)")  # fmt: skip
    return found


def _beside(file: pathlib.Path, digest: Digest) -> Manifest | None:
    """The format-1/2 manifest beside ``file`` if it describes ``digest`` (its size and chunks then apply)."""
    try:
        found = Manifest.read(file.parent / MANIFEST)
    except (OSError, ValueError):
        return None
    return found if found.digest == digest and not found.digest.folder else None


def weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a model folder (its index's shards, or every ``*.safetensors``), or the file."""
    if not path.is_dir():
        return [path]
    index = path / INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (KeyError, TypeError, AttributeError, ValueError) as e:
            raise ValueError(f"{index}: not a readable safetensors index ({e})") from None
        return [path / s for s in shards]
    found = sorted(path.glob("*.safetensors"))
    if not found:
        raise FileNotFoundError(f"no .safetensors weights in {path}")
    return found


def model_digest(path: str | pathlib.Path, algo: str = "xxh3_128") -> str:
    """A model folder's digest: its ``config.json`` and weight files (shards or one file), hashed as a version
    folder's files are (``folder_root``). Two folders with the same digest hold the same model, whatever their
    paths; the tokenizer and the generation config do not count (they do not change the weights)."""
    path = pathlib.Path(path)
    files = [*weight_files(path), *([path / "config.json"] if (path / "config.json").is_file() else [])]
    found = {f.name: digest_file(f, algo) for f in files}
    chunk_bytes = next(iter(found.values())).digest.chunk_bytes
    root = folder_root(algo, chunk_bytes, {n: (d.size, d.chunks) for n, d in found.items()})
    return str(Digest(algo, chunk_bytes, root, folder=True))


def open_version(path: str | pathlib.Path, digest: str | None, *, name: str) -> list[Mapped]:
    """Every weight file of ``path`` mapped, with what each must hash to. A version folder's other files (config,
    tokenizer) are checked here and now; the weights are checked by the caller, on the mappings."""
    path = pathlib.Path(path)
    want = Digest.parse(digest) if digest is not None else None
    if want is None:
        return [Mapped(f, _map(f), None) for f in weight_files(path)]
    if not want.folder:
        file = path / FILE if path.is_dir() else path
        beside = _beside(file, want)
        entry = beside.files[FILE] if beside else None
        return [Mapped(file, _map(file), want, entry.chunks if entry else (), entry.bytes if entry else None)]
    folder = version_folder(path)
    manifest = _folder_manifest(folder, want, name)
    out = []
    for key, entry in sorted(manifest.files.items()):
        file = folder / key
        if key.endswith(".safetensors"):
            out.append(Mapped(file, _map(file), manifest.file_digest(key), entry.chunks, entry.bytes))
        else:
            verify(file, manifest.file_digest(key), name=f"{name} at {file}", size=entry.bytes, chunks=entry.chunks)
    return out


def load_verified(path: str | pathlib.Path, digest: str | None, *, name: str, device: str = "cpu") -> dict[str, Any]:
    """The tensors of a version (a version folder, a model folder, or one safetensors file), ``digest`` checked
    first (None: not checked) on the private mappings they are then cut from. A mismatch raises DigestMismatch
    naming ``name`` and the file; a file that cannot be opened, OSError; one that is not safetensors, ValueError."""
    from dora.store.tensorfile import tensors

    out: dict[str, Any] = {}
    for m in open_version(path, digest, name=name):
        if m.digest is not None:
            verify(m.data, m.digest, name=f"{name} at {m.file}", size=m.size, chunks=m.chunks)
        part = tensors(m.data, name=f"{name} at {m.file}", device=device)
        if out.keys() & part.keys():
            raise ValueError(f"{name} at {m.file}: tensors {sorted(out.keys() & part.keys())[:3]} are in two files")
        out.update(part)
    return out


def load_into(path: str | pathlib.Path, digest: str, *, name: str, into: Mapping[str, torch.Tensor],
              undo: Callable[[], None], threads: int = THREADS) -> dict[str, Any]:  # fmt: skip
    """Copy a version's tensors into ``into`` (the same names, dtypes and shapes: contiguous CPU tensors), checking
    ``digest`` as the bytes go: each piece of a chunk is hashed, then copied while it is still in cache, and each
    chunk's hash is compared with the manifest's. Every byte is read from memory once, as by an unchecked copy. A
    chunk that differs (or any failure once copying began): ``undo()`` is called, which must put back what ``into``
    held, and the error raised (DigestMismatch naming the file and chunk). Raises InPlaceUnfit, before copying
    anything, when the digest has no chunks, no manifest vouches for them, or the tensors are not ``into``'s.
    Returns the version's tensors, views of its private mappings (what a later ``undo`` can copy back from)."""
    from dora.store.tensorfile import tensors

    want = Digest.parse(digest)
    if not want.chunk_bytes:
        raise InPlaceUnfit(f"{name}: a whole-file digest has no chunks to check as they are copied")
    files = open_version(path, digest, name=name)
    if any(not m.chunks for m in files):
        raise InPlaceUnfit(f"{name}: no manifest beside {path} whose chunks make the published digest")
    plans = _plans(files, want, name, into)
    jobs = [job for plan in plans for job in _chunk_jobs(plan, into)]
    try:
        with ThreadPoolExecutor(max(1, min(threads, len(jobs))), thread_name_prefix="load") as pool:
            good = list(pool.map(lambda job: _copy_chunk(job, want), jobs))
        _check_chunks(plans, jobs, good, want)
    except BaseException:
        undo()
        raise
    out: dict[str, Any] = {}
    for plan in plans:
        out.update(tensors(plan.file.data, name=plan.what))
    return out


@dataclass(frozen=True, slots=True)
class _Plan:
    """One file of a version copied in place: its mapping, its name in errors, and its tensors' layout."""

    file: Mapped
    what: str
    layout: dict[str, Any]


@dataclass(frozen=True, slots=True)
class _Job:
    """One chunk of a file to hash and copy: the file's bytes, the spans of ``into`` they fill (sorted)."""

    file: Mapped
    src: Any
    spans: list[tuple[int, int, Any]]
    starts: list[int]
    chunk: int


def _plans(files: list[Mapped], want: Digest, name: str, into: Mapping[str, torch.Tensor]) -> list[_Plan]:
    """Each file's layout, its size and chunk count checked; InPlaceUnfit unless the tensors are ``into``'s."""
    from dora.store.tensorfile import header

    plans = []
    for m in files:
        what = f"{name} at {m.file}"
        if len(m.data) != m.size or len(m.chunks) != -(-len(m.data) // want.chunk_bytes):
            raise DigestMismatch(f"{what}: the file has {len(m.data)} bytes, its manifest says {m.size} in "
                                 f"{len(m.chunks)} chunks (truncated or replaced)")  # fmt: skip
        plans.append(_Plan(m, what, header(m.data, name=what)))
    if sorted(k for plan in plans for k in plan.layout) != sorted(into):
        raise InPlaceUnfit(f"{name}: its tensors are not the model's")
    return plans


def _chunk_jobs(plan: _Plan, into: Mapping[str, torch.Tensor]) -> list[_Job]:
    """The file's chunks as jobs, each knowing which bytes of ``into``'s tensors the file fills."""
    import numpy as np
    import torch

    spans = []
    for key, (dtype, shape, offset, count) in plan.layout.items():
        t = into[key]
        if t.dtype != dtype or list(t.shape) != shape or not t.is_contiguous() or t.device.type != "cpu":
            raise InPlaceUnfit(f"{plan.what}: tensor {key!r} differs from the model's in dtype, shape or layout")
        if count:
            spans.append((offset, offset + count * dtype.itemsize, t.view(-1).view(torch.uint8).numpy()))
    spans.sort(key=lambda s: s[0])
    src = np.frombuffer(plan.file.data, dtype=np.uint8)
    starts = [s[0] for s in spans]
    return [_Job(plan.file, src, spans, starts, i) for i in range(len(plan.file.chunks))]


def _copy_chunk(job: _Job, want: Digest) -> bool:
    """Hash one chunk piece by piece, copying each piece into the spans it fills while it is in cache; whether the
    chunk's hash is the manifest's."""
    import numpy as np

    size, step = len(job.file.data), want.chunk_bytes
    lo, hi = job.chunk * step, min((job.chunk + 1) * step, size)
    h = ALGOS[want.algo]()
    j = max(0, bisect.bisect_right(job.starts, lo) - 1)
    for p in range(lo, hi, IN_PLACE_PIECE_BYTES):
        q = min(p + IN_PLACE_PIECE_BYTES, hi)
        h.update(job.src[p:q])
        while j < len(job.spans) and job.spans[j][0] < q:
            s, e, dst = job.spans[j]
            a, b = max(s, p), min(e, q)
            if a < b:
                np.copyto(dst[a - s : b - s], job.src[a:b])
            if e > q:
                break
            j += 1
    return bool(h.hexdigest() == job.file.chunks[job.chunk])


def _check_chunks(plans: list[_Plan], jobs: list[_Job], good: list[bool], want: Digest) -> None:
    """DigestMismatch naming the first file with a chunk that differs, how many differ and where the first lies."""
    for plan in plans:
        bad = [job.chunk for ok, job in zip(good, jobs, strict=True) if job.file is plan.file and not ok]
        if bad:
            lo = bad[0] * want.chunk_bytes
            hi = min(lo + want.chunk_bytes, len(plan.file.data))
            raise DigestMismatch(f"{plan.what}: {want.algo} digest: {len(bad)} of {len(plan.file.chunks)} chunks "
                                 f"differ from the manifest, the first at bytes {lo}-{hi}")  # fmt: skip
