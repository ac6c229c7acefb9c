"""Content digests shared by the weight store (which writes them) and the engines (which check them)."""

from __future__ import annotations

import hashlib
import pathlib


def sha256_file(path: str | pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
