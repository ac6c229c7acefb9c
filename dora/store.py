"""The weight store: one directory per published version, written atomically, retired by the broker.

Below the three processes: the learner publishes into it, the rollout engines check what they load
against its sha256 manifests, and the broker deletes the versions its ledger retired. It imports no
torch at run time (``publish`` and ``load`` import safetensors' torch helpers when called).

``<root>/v<N>/model.safetensors`` plus ``manifest.json`` (version, sha256 of the safetensors file,
size, seconds to write). A version is written into a temporary directory beside it and renamed into
place, so a reader sees all of it or none of it. The URI handed to rollout workers is
``file://<root>/v<N>/model.safetensors``; they check the sha256 before loading. ``retire`` removes a
version once the broker's ledger no longer needs it (no worker serves it and all its groups are trained).
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import time
import uuid
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:  # the broker imports this module to retire versions: no torch at run time
    import torch

log = structlog.get_logger()


def sha256_file(path: str | pathlib.Path) -> str:
    """The sha256 of a file's bytes: what the store writes into a manifest and an engine checks before loading."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class WeightStore:
    def __init__(self, root: str | pathlib.Path) -> None:
        self.root = pathlib.Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, version: int) -> pathlib.Path:
        return self.root / f"v{version}"

    def publish(self, version: int, state: dict[str, torch.Tensor]) -> tuple[str, str, float]:
        """Write ``state`` as version ``version``; returns (uri, sha256, seconds)."""
        from safetensors.torch import save_file

        started = time.perf_counter()
        final = self.path(version)
        tmp = self.root / f".v{version}.{uuid.uuid4().hex[:8]}.tmp"
        tmp.mkdir()
        try:
            file = tmp / "model.safetensors"
            save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(file))
            sha = sha256_file(file)
            manifest = {"version": version, "sha256": sha, "bytes": file.stat().st_size,
                        "write_s": round(time.perf_counter() - started, 4)}  # fmt: skip
            (tmp / "manifest.json").write_text(json.dumps(manifest))
            if final.exists():  # a re-publish of the same version (a restarted learner): replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return f"file://{final / 'model.safetensors'}", sha, time.perf_counter() - started

    def load(self, version: int) -> dict[str, torch.Tensor]:
        """A published version's tensors, after checking the file against its manifest's sha256."""
        from safetensors.torch import load_file

        path = self.path(version)
        manifest = json.loads((path / "manifest.json").read_text())
        file = path / "model.safetensors"
        if sha256_file(file) != manifest["sha256"]:
            raise ValueError(f"{file}: sha256 differs from its manifest")
        return load_file(str(file))

    def retire(self, version: int) -> bool:
        """Delete a version's directory; False if it was not there."""
        path = self.path(version)
        if not path.exists():
            return False
        shutil.rmtree(path)
        return True

    def versions(self) -> list[int]:
        return sorted(int(p.name[1:]) for p in self.root.glob("v*") if p.name[1:].isdigit())


def store_path(uri: str) -> pathlib.Path | None:
    """The version directory a ``file://`` weight URI points into (None for other schemes)."""
    if not uri.startswith("file://"):
        return None
    return pathlib.Path(uri.removeprefix("file://")).parent


def retire_uri(uri: str) -> pathlib.Path | None:
    """Delete the store version a published ``file://`` URI names (``file://<store>/v<N>/model.safetensors``).
    Only a directory the store wrote (``v<N>`` with its manifest) is deleted; returns it, or None."""
    path = store_path(uri)
    if path is None:
        return None
    if not (path.name.startswith("v") and (path / "manifest.json").is_file()):
        log.warning("retire_not_a_store_version", uri=uri)  # never delete what the store did not write
        return None
    shutil.rmtree(path, ignore_errors=True)
    return path
