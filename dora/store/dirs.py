"""The weight store's directories on disk: their names, the leftovers of writers that died, and the removal of a
version, which is all the broker needs of the store (it retires the versions its ledger no longer holds).

``<root>/v<N>/``: a model folder plus ``manifest.json`` (a version of an older dora: ``model.safetensors`` and
its manifest); a version being written or removed is a temporary directory ``<root>/.v<N>.<pid>@<host>.<rand>.tmp``.
Nothing here reads a tensor: no torch, no safetensors, so the broker, which imports this module, never loads them.
"""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import time
import uuid

import structlog

__all__ = ["FILE", "MANIFEST", "published", "remove_version", "retire_older", "retire_uri", "stale", "store_path",
           "superseded", "temp_name"]  # fmt: skip

log = structlog.get_logger()

FILE = "model.safetensors"
MANIFEST = "manifest.json"
TEMP = re.compile(r"\.v\d+\.(?:(?P<pid>\d+)@(?P<host>.+)\.)?[0-9a-f]{8}\.tmp")


def temp_name(name: str) -> str:
    """A temporary directory's name for version directory ``name`` (``v<N>``), owned by this process."""
    return f".{name}.{os.getpid()}@{socket.gethostname()}.{uuid.uuid4().hex[:8]}.tmp"


def stale(path: pathlib.Path, stale_s: float) -> str | None:
    """Why a temporary directory is a dead writer's leftover, or None while its writer may be alive (or it is
    not one of the store's)."""
    found = TEMP.fullmatch(path.name)
    if found is None:
        return None
    if found["pid"] is None:
        return "no owner in its name (written by an older dora)"
    if found["host"] == socket.gethostname():
        try:
            os.kill(int(found["pid"]), 0)
        except ProcessLookupError:
            return f"its writer, pid {found['pid']}, is gone"
        except PermissionError:
            pass  # alive, another user's
        return None
    try:
        age = time.time() - max([path.stat().st_mtime] + [p.stat().st_mtime for p in path.iterdir()])
    except OSError:
        return None
    return f"written on {found['host']}, untouched for {age:.0f} s" if age > stale_s else None


def remove_version(path: pathlib.Path) -> bool:
    """Rename a version directory aside (atomic: it is no longer listed), then delete it. False if absent."""
    aside = path.parent / temp_name(path.name)
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False
    shutil.rmtree(aside, ignore_errors=True)
    return True


def store_path(uri: str) -> pathlib.Path | None:
    """The version directory a ``file://`` weight URI names (``file://<store>/v<N>``, or an older dora's
    ``file://<store>/v<N>/model.safetensors``); None for other schemes."""
    if not uri.startswith("file://"):
        return None
    path = pathlib.Path(uri.removeprefix("file://"))
    return path.parent if path.suffix == ".safetensors" else path


def retire_uri(uri: str) -> pathlib.Path | None:
    """Delete the store version a published ``file://`` URI names (``file://<store>/v<N>``).
    Only a directory the store wrote (``v<N>`` with its manifest) is deleted; returns it, or None."""
    path = store_path(uri)
    if path is None:
        return None
    if not (path.name.startswith("v") and (path / MANIFEST).is_file()):
        log.warning("retire_not_a_store_version", uri=uri)  # never delete what the store did not write
        return None
    return path if remove_version(path) else None


def superseded(uri: str) -> pathlib.Path | None:
    """The newer version that replaced the one a ``file://`` URI names, once that one is gone from the store; None
    while it is there, or when nothing newer was published beside it. The broker retires a version only after a
    newer one is published and nobody holds the old one any more: a worker told to load a version that is gone and
    has a successor beside it was reassigned meanwhile (the newer order is on its way). A version gone with nothing
    newer is something else: a store not shared with this host, or removed by hand."""
    path = store_path(uri)
    if path is None or not path.name[1:].isdigit() or path.exists():
        return None
    newer = [n for n in published(path.parent) if n > int(path.name[1:])]
    return path.parent / f"v{max(newer)}" if newer else None


def retire_older(uri: str) -> list[pathlib.Path]:
    """Delete the versions older than the one a published ``file://`` URI names, in the store it points into; returns
    them. A broker restarted from its journal holds only that newest version alive (the older ones' groups are
    re-run on it), so nothing else would ever retire them."""
    path = store_path(uri)
    if path is None or not path.name[1:].isdigit():
        return []
    return [p for n, p in sorted(published(path.parent).items()) if n < int(path.name[1:]) and remove_version(p)]


def published(root: pathlib.Path) -> dict[int, pathlib.Path]:
    """The versions in the store at ``root``, by number: the ``v<N>`` directories that hold their manifest."""
    return {int(p.name[1:]): p for p in root.glob("v*") if p.name[1:].isdigit() and (p / MANIFEST).is_file()}


def sync_path(path: pathlib.Path) -> None:
    """Make a file's data, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
