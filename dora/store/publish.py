"""``WeightStore``: publish a version as a model folder, atomically; list, load and retire versions.

A version is ``<root>/v<N>/``, a folder any Hugging Face reader opens (``from_pretrained``, vLLM, `dora eval`):
- the weights as safetensors in the dtype asked for (the engines' dtype: bf16 on GPUs), one
  ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``
  once they pass ``shard_bytes``. Tied tensors are written once, as ``save_pretrained`` does: the caller passes
  the model's state without the tied copies (``dora.hf.tensors.publishable``);
- the files given ``beside`` them: the start folder's ``config.json`` (saying the dtype written),
  ``generation_config.json`` and tokenizer files;
- ``manifest.json`` (``dora.store.manifest``): every file with its chunk digests, and the digest they make.

**Publish** writes the folder as a temporary directory ``<root>/.v<N>.<pid>@<host>.<rand>.tmp``, hashes each file
from the page cache while the disk syncs it, writes the manifest, and renames the directory into place (then
syncs the root): a reader sees all of a version or none of it, and a listed version is whole after a crash of the
process or of the machine. **Leftovers** of a publisher that died are removed when a store is opened and before
each publish (``dora.store.dirs``). **Retire** renames a version aside, then deletes it.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import structlog

from dora.store.digest import ALGOS, CHUNK_BYTES, Digest, digest_file, folder_root
from dora.store.dirs import FILE, MANIFEST, remove_version, stale, temp_name
from dora.store.load import INDEX, load_verified
from dora.store.manifest import FileEntry, Manifest

if TYPE_CHECKING:  # the broker imports this package to retire versions: no torch at run time
    import torch

log = structlog.get_logger()

SHARD_BYTES = 5 << 30
"""Weights per safetensors file before a version is sharded (the size hub checkpoints use)."""


class WeightStore:
    def __init__(self, root: str | pathlib.Path, *, algo: str = "xxh3_128", chunk_bytes: int = CHUNK_BYTES,
                 fsync: bool = True, stale_temp_s: float = 3600.0, shard_bytes: int = SHARD_BYTES) -> None:  # fmt: skip
        if algo not in ALGOS or chunk_bytes < 1 << 20 or chunk_bytes % (1 << 20):
            raise ValueError(f"digest {algo!r} in chunks of {chunk_bytes} bytes: need one of {sorted(ALGOS)}, "
                             "chunks a whole number of MiB")  # fmt: skip
        if shard_bytes < 1:
            raise ValueError(f"shard_bytes must be >= 1; got {shard_bytes}")
        self.root = pathlib.Path(root)
        self.algo = algo
        self.chunk_bytes = chunk_bytes
        self.fsync = fsync
        self.stale_temp_s = stale_temp_s
        self.shard_bytes = shard_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self.clean()

    def path(self, version: int) -> pathlib.Path:
        return self.root / f"v{version}"

    def manifest(self, version: int) -> Manifest:
        return Manifest.read(self.path(version) / MANIFEST)

    def digest(self, version: int) -> str:
        """The digest a worker checks this version against (what ``publish`` returned)."""
        return str(self.manifest(version).digest)

    def publish(self, version: int, state: Mapping[str, torch.Tensor], *, beside: Mapping[str, bytes] | None = None,
                dtype: torch.dtype | None = None, file: str = FILE) -> tuple[str, str, float]:  # fmt: skip
        """Write ``state`` as version ``version`` (floating-point tensors cast to ``dtype`` first, on their device;
        None: as they are), with the files ``beside`` it; returns (uri, digest, seconds). ``file``: the weights'
        file name (a LoRA version's is ``adapter_model.safetensors``, never sharded)."""
        started = time.perf_counter()
        self.clean()
        final = self.path(version)
        tmp = self.root / temp_name(f"v{version}")
        tmp.mkdir()
        try:
            names, shown = self._write_weights(tmp, state, dtype, file)
            for name, data in (beside or {}).items():
                (tmp / name).write_bytes(data)
            written = time.perf_counter()
            files, hash_s, fsync_s = self._hash_and_sync(tmp, [*names, *(beside or {})])
            root = folder_root(self.algo, self.chunk_bytes, {k: (e.bytes, e.chunks) for k, e in files.items()})
            committing = time.perf_counter()
            timings = {"write": written - started, "hash": hash_s, "fsync": fsync_s}
            manifest = Manifest(version=version, digest=Digest(self.algo, self.chunk_bytes, root, folder=True),
                                bytes=sum(e.bytes for e in files.values()), files=files, timings_s=timings,
                                dtype=shown)  # fmt: skip
            (tmp / MANIFEST).write_text(manifest.to_json())
            if self.fsync:
                _fsync(tmp / MANIFEST)
                _fsync(tmp)
            if final.exists():  # a re-publish of the same version (a restarted learner): replace it whole
                remove_version(final)
            os.replace(tmp, final)
            if self.fsync:
                _fsync(self.root)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        seconds = time.perf_counter() - started
        log.info("weights_written", version=version, bytes=manifest.bytes, files=len(files), dtype=shown,
                 digest=str(manifest.digest), write_s=round(timings["write"], 3), hash_s=round(hash_s, 3),
                 fsync_s=round(fsync_s, 3), commit_s=round(time.perf_counter() - committing, 3),
                 gb_per_s=round(manifest.bytes / seconds / 1e9, 2))  # fmt: skip
        return f"file://{final}", str(manifest.digest), seconds

    def _write_weights(self, tmp: pathlib.Path, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                       file: str = FILE) -> tuple[list[str], str | None]:  # fmt: skip
        """The safetensors file(s) (and index) of ``state``; their names and the floating dtype written."""
        from safetensors.torch import save_file

        shards: list[dict[str, Any]] = [{}]
        sizes = [0]
        floats: set[str] = set()
        for key, t in state.items():
            t = t.detach()
            if dtype is not None and t.is_floating_point():
                t = t.to(dtype)
            if t.is_floating_point():
                floats.add(str(t.dtype).removeprefix("torch."))
            size = t.numel() * t.element_size()
            if shards[-1] and sizes[-1] + size > self.shard_bytes and file == FILE:
                shards.append({})
                sizes.append(0)
            shards[-1][key] = t.contiguous().cpu()
            sizes[-1] += size
        n = len(shards)
        names = [file] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        for name, shard in zip(names, shards, strict=True):
            save_file(shard, str(tmp / name), metadata={"format": "pt"})
        if n > 1:
            where = {k: name for name, shard in zip(names, shards, strict=True) for k in shard}
            index = {"metadata": {"total_size": sum(sizes)}, "weight_map": where}
            (tmp / INDEX).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
            names.append(INDEX)
        return names, ",".join(sorted(floats)) or None

    def _hash_and_sync(self, tmp: pathlib.Path, names: list[str]) -> tuple[dict[str, FileEntry], float, float]:
        """Each file's chunk digests, hashed from the page cache while the disk writes it; (entries, hash s,
        fsync s: the longest wait on the disk after hashing)."""
        started = time.perf_counter()
        files = {}
        with ThreadPoolExecutor(2, thread_name_prefix="fsync") as pool:  # the disk writes while we hash
            synced = [pool.submit(_fsync, tmp / name) for name in names] if self.fsync else []
            for name in names:
                found = digest_file(tmp / name, self.algo, self.chunk_bytes)
                files[name] = FileEntry(found.size, found.chunks)
            hashed = time.perf_counter()
            for f in synced:
                f.result()
        return files, hashed - started, time.perf_counter() - hashed

    def load(self, version: int, device: str = "cpu") -> dict[str, torch.Tensor]:
        """A published version's tensors, checked against its manifest's digest on the very bytes loaded."""
        return load_verified(self.path(version), self.digest(version), name=f"v{version}", device=device)

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


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
