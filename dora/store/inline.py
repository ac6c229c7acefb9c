"""A small version carried in its messages: its files and manifest as bytes, checked and loaded with no file read.

A LoRA version (an adapter folder: ``adapter_model.safetensors``, ``adapter_config.json``, the base model's record)
is well under a megabyte. The learner sends its files inside ``WeightsPublished.inline`` and the broker passes them
on in every ``Assign`` of that version, so a worker loads the adapters from the message: no shared file system, no
read, nothing on disk between the learner's step and the workers' next requests.

- ``pack``: the files plus the ``manifest.json`` a store folder of exactly those files holds, and the folder digest
  (``<algo>/<n>MiB/dir:<root>``), made in memory with the store's own chunk digests, ``folder_root`` and
  ``Manifest``: the digest is the one ``WeightStore.publish`` gives the same files, and the one a worker checks a
  folder against (``dora.store.load``).
- ``verified``: a worker's check, as for a folder: the manifest carried must be the one the digest names, the
  files carried exactly the ones it lists, each matching its own chunks. Anything else is a ``DigestMismatch``.
- ``write``: the durable copy in the store (``<root>/v<N>/``), those exact bytes, written as a publish writes a
  version (a temporary directory, synced, renamed into place, the root synced): the store's copy has the inline
  copy's digest, so a worker that reads it (one that joins later, or one whose inline copy did not check) reads
  the same version.

Full weights are never carried inline: their files are gigabytes, and go through the store.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time
from collections.abc import Mapping

import structlog

from dora.store.digest import CHUNK_BYTES, Digest, DigestMismatch, digest_file, folder_root, verify
from dora.store.dirs import MANIFEST, remove_version, sync_path, temp_name
from dora.store.manifest import FileEntry, Manifest

__all__ = ["pack", "verified", "write"]

log = structlog.get_logger()


def _plain(name: str) -> bool:
    """A name a version folder may hold: one file, right in the folder (no path, nothing hidden)."""
    return bool(name) and "/" not in name and "\\" not in name and "\0" not in name and not name.startswith(".")


def pack(version: int, files: Mapping[str, bytes], *, algo: str = "xxh3_128", chunk_bytes: int = CHUNK_BYTES,
         dtype: str | None = None) -> tuple[dict[str, bytes], str]:  # fmt: skip
    """``files`` and the ``manifest.json`` bytes of a store folder holding exactly them, and that folder's digest
    (what ``WeightStore.publish`` returns for the same files). ``dtype``: the floating-point dtype the weights were
    written in, recorded in the manifest as a publish records it."""
    bad = [name for name in files if not _plain(name) or name == MANIFEST]
    if bad:
        raise ValueError(f"v{version}: {bad[0]!r} cannot be a file of a version folder (a plain name, not "
                         f"{MANIFEST})")  # fmt: skip
    if not files:
        raise ValueError(f"v{version}: a version holds at least one file")
    started = time.perf_counter()
    entries = {}
    for name, data in files.items():
        found = digest_file(data, algo, chunk_bytes)
        entries[name] = FileEntry(found.size, found.chunks)
    root = folder_root(algo, chunk_bytes, {k: (e.bytes, e.chunks) for k, e in entries.items()})
    manifest = Manifest(version=version, digest=Digest(algo, chunk_bytes, root, folder=True),
                        bytes=sum(e.bytes for e in entries.values()), files=dict(sorted(entries.items())),
                        timings_s={"hash": time.perf_counter() - started}, dtype=dtype)  # fmt: skip
    return {**files, MANIFEST: manifest.to_json().encode()}, str(manifest.digest)


def verified(inline: Mapping[str, bytes], digest: str, name: str) -> dict[str, bytes]:
    """The version's files (the manifest left out) once they are the ones ``digest`` names: the manifest carried is
    the one the digest names, the files carried are the ones it lists, and each matches its chunks. Raises
    DigestMismatch naming ``name`` otherwise (ValueError for a digest this dora cannot read)."""
    want = Digest.parse(digest)
    if not want.folder:
        raise DigestMismatch(f"{name}: digest {digest[:40]}… names one file, not a version folder's files")
    if MANIFEST not in inline:
        raise DigestMismatch(f"{name}: no {MANIFEST} among the files carried inline")
    try:
        manifest = Manifest.parse(inline[MANIFEST], where=f"{name}: the inline {MANIFEST}")
    except ValueError as e:
        raise DigestMismatch(str(e)) from None
    if manifest.digest != want or not manifest.vouched():
        raise DigestMismatch(f"{name}: the inline {MANIFEST} is not the one the published digest names "
                             "(replaced or edited)")  # fmt: skip
    files = {k: v for k, v in inline.items() if k != MANIFEST}
    if files.keys() != manifest.files.keys():
        extra, missing = sorted(files.keys() - manifest.files.keys()), sorted(manifest.files.keys() - files.keys())
        raise DigestMismatch(f"{name}: the files carried inline are not the manifest's: extra {extra[:3]}, "
                             f"missing {missing[:3]}")  # fmt: skip
    if not all(_plain(k) for k in files):
        raise DigestMismatch(f"{name}: a file named {next(k for k in files if not _plain(k))!r} is not a folder's")
    for key, data in sorted(files.items()):
        entry = manifest.files[key]
        verify(data, manifest.file_digest(key), name=f"{name}: inline {key}", size=entry.bytes, chunks=entry.chunks)
    return files


def write(root: str | pathlib.Path, version: int, inline: Mapping[str, bytes], fsync: bool = True) -> str:
    """Write ``inline`` (``pack``'s files and manifest) as version ``version`` of the store at ``root``, atomically,
    byte for byte; returns its ``file://`` URI. The bytes are checked against their own manifest first, so the store
    never holds a version whose manifest does not vouch for its files. A version already there is replaced whole
    (a restarted learner's re-publish)."""
    started = time.perf_counter()
    root = pathlib.Path(root)
    if MANIFEST not in inline:
        raise ValueError(f"v{version}: no {MANIFEST} among the files to write (made by dora.store.inline.pack)")
    manifest = Manifest.parse(inline[MANIFEST], where=f"v{version}: the {MANIFEST} to write")
    if manifest.version != version:
        raise ValueError(f"v{version}: its {MANIFEST} is version {manifest.version}'s")
    verified(inline, str(manifest.digest), f"v{version}")
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version}"
    tmp = root / temp_name(final.name)
    tmp.mkdir()
    try:
        for key in sorted(inline, key=lambda k: k == MANIFEST):  # the manifest last, as a publish writes it
            (tmp / key).write_bytes(inline[key])
            if fsync:
                sync_path(tmp / key)
        if fsync:
            sync_path(tmp)
        if final.exists():
            remove_version(final)
        os.replace(tmp, final)
        if fsync:
            sync_path(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("inline_version_written", version=version, bytes=manifest.bytes, files=len(manifest.files),
             digest=str(manifest.digest), write_s=round(time.perf_counter() - started, 4))  # fmt: skip
    return f"file://{final}"
