"""``WeightStore``: publish a version as a model folder, atomically; list, load and retire versions.

A version is ``<root>/v<N>/``, a folder any Hugging Face reader opens (``from_pretrained``, vLLM, `dora eval`):
- the weights as safetensors in the dtype asked for (the engines' dtype: bf16 on GPUs), one
  ``model.safetensors``, or shards ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``
  once they pass ``shard_bytes``. Tied tensors are written once, as ``save_pretrained`` does: the caller passes
  the model's state without the tied copies (``dora.hf.tensors.publishable``);
- the files given ``beside`` them: the start folder's ``config.json`` (saying the dtype written),
  ``generation_config.json`` and tokenizer files;
- ``manifest.json`` (``dora.store.manifest``): every file with its chunk digests, and the digest they make.

**Publish** writes the folder as a temporary directory ``<root>/.v<N>.<pid>@<host>.<rand>.tmp`` from the tensors'
own memory (``dora.store.writer``: one copy into the page cache, each chunk hashed from memory in threads as it is
written, the disk writing back while later chunks are written), writes the manifest with each stage's seconds
(``timings_s``: prepare, write, hash, fsync), and renames the directory into place (then syncs the root): a reader
sees all of a version or none of it, and a listed version is whole after a crash of the process or of the machine.
A learner that must not wait for the disk copies its state into a ``dora.store.snapshot.HostSnapshot`` (one memory
copy, laid out as the files will be) and publishes its views off its critical path: each file is then written as one
span of that buffer. **Leftovers** of a publisher that died are removed when a store is opened and before
each publish (``dora.store.dirs``). **Retire** renames a version aside, then deletes it.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

import structlog

from dora.store.digest import ALGOS, CHUNK_BYTES, Digest, folder_root
from dora.store.dirs import FILE, MANIFEST, remove_version, stale, sync_path, temp_name
from dora.store.load import INDEX, load_verified
from dora.store.manifest import Manifest
from dora.store.writer import index, plan, spans, writable, write_files

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
        file name (a LoRA version's is ``adapter_model.safetensors``, never sharded). Tensors already contiguous on
        the CPU in the dtype written (a ``HostSnapshot``'s views) are written from their own memory, and must not
        change until this returns."""
        started = time.perf_counter()
        self.clean()
        final = self.path(version)
        tmp = self.root / temp_name(f"v{version}")
        tmp.mkdir()
        try:
            files, shown = self._weight_files(state, dtype, file)
            files += [(name, [memoryview(data)]) for name, data in (beside or {}).items()]
            prepared = time.perf_counter()
            entries, timings = write_files(tmp, files, algo=self.algo, chunk_bytes=self.chunk_bytes, fsync=self.fsync)
            root = folder_root(self.algo, self.chunk_bytes, {k: (e.bytes, e.chunks) for k, e in entries.items()})
            committing = time.perf_counter()
            timings = {"prepare": prepared - started, **timings}
            manifest = Manifest(version=version, digest=Digest(self.algo, self.chunk_bytes, root, folder=True),
                                bytes=sum(e.bytes for e in entries.values()), files=entries, timings_s=timings,
                                dtype=shown)  # fmt: skip
            self._commit(tmp, final, manifest)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        seconds = time.perf_counter() - started
        log.info("weights_written", version=version, bytes=manifest.bytes, files=len(entries), dtype=shown,
                 digest=str(manifest.digest), **{f"{k}_s": round(v, 3) for k, v in timings.items()},
                 commit_s=round(time.perf_counter() - committing, 3),
                 gb_per_s=round(manifest.bytes / seconds / 1e9, 2))  # fmt: skip
        return f"file://{final}", str(manifest.digest), seconds

    def _weight_files(self, state: Mapping[str, torch.Tensor], dtype: torch.dtype | None,
                      file: str) -> tuple[list[tuple[str, list[memoryview]]], str | None]:  # fmt: skip
        """The safetensors file(s) of ``state`` (and their index) as views of memory to write; the floating dtype
        written."""
        tensors = writable(state, dtype)
        plans = plan(tensors, None, shard_bytes=self.shard_bytes, file=file)
        files = [(p.name, spans(p, tensors)) for p in plans]
        if len(plans) > 1:
            files.append((INDEX, [memoryview(index(plans))]))
        floats = {str(t.dtype).removeprefix("torch.") for t in tensors.values() if t.is_floating_point()}
        return files, ",".join(sorted(floats)) or None

    def _commit(self, tmp: pathlib.Path, final: pathlib.Path, manifest: Manifest) -> None:
        """Write the manifest, then rename the folder into place (replacing a version published before)."""
        (tmp / MANIFEST).write_text(manifest.to_json())
        if self.fsync:
            sync_path(tmp / MANIFEST)
            sync_path(tmp)
        if final.exists():  # a re-publish of the same version (a restarted learner): replace it whole
            remove_version(final)
        os.replace(tmp, final)
        if self.fsync:
            sync_path(self.root)

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
