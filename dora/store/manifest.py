"""A version's manifest: every file of the version folder with its size and chunk digests, and the digest they make.

Format 3 (a version is a model folder): ``{"format": 3, "version", "bytes", "digest", "dtype", "files":
{name: {"bytes", "chunks"}}, "timings_s"}``. ``digest`` is ``<algo>/<n>MiB/dir:<root>``, ``root`` being
``folder_root`` of the files listed: the published digest vouches for the list, and each file's bytes are checked
against its own chunks, so nothing of the folder (shards, index, config, tokenizer) can change unseen.

Older versions are still read: format 2 (``model.safetensors`` alone: ``{"format": 2, "version", "bytes",
"digest", "chunks", "timings_s"}``) and format 1 (``{"version", "sha256", "bytes", "write_s"}``, the file's plain
sha256). A newer format is refused with an error saying so.
"""

from __future__ import annotations

import builtins
import json
import pathlib
from dataclasses import dataclass, field

from dora.store.digest import Digest, folder_root, root_of
from dora.store.dirs import FILE

MANIFEST_FORMAT = 3


@dataclass(frozen=True, slots=True)
class FileEntry:
    bytes: int
    chunks: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class Manifest:
    version: int
    digest: Digest
    bytes: int
    """All files together."""
    files: dict[str, FileEntry]
    """Every file of the version but the manifest (formats 1 and 2: ``model.safetensors``)."""
    timings_s: dict[str, float] = field(default_factory=dict)
    dtype: str | None = None
    """The floating-point dtype the weights were written in (format 3)."""
    format: int = MANIFEST_FORMAT

    @classmethod
    def read(cls, path: pathlib.Path) -> Manifest:
        return cls.parse(path.read_text(), where=str(path))

    @classmethod
    def parse(cls, text: str | builtins.bytes, *, where: str) -> Manifest:
        """A manifest from its JSON (``where``: what errors name it by: its path, or the message that carried it)."""
        try:
            raw = json.loads(text)
            fmt = raw.get("format", 1)
            if fmt == 1:
                return cls(version=raw["version"], digest=Digest("sha256", 0, raw["sha256"]), bytes=raw["bytes"],
                           files={FILE: FileEntry(raw["bytes"])}, timings_s={"write": raw.get("write_s", 0.0)},
                           format=1)  # fmt: skip
            if fmt == 2:
                return cls(version=raw["version"], digest=Digest.parse(raw["digest"]), bytes=raw["bytes"],
                           files={FILE: FileEntry(raw["bytes"], tuple(raw["chunks"]))},
                           timings_s=dict(raw.get("timings_s", {})), format=2)  # fmt: skip
            if fmt == MANIFEST_FORMAT:
                files = {str(k): FileEntry(int(v["bytes"]), tuple(v["chunks"])) for k, v in raw["files"].items()}
                return cls(version=raw["version"], digest=Digest.parse(raw["digest"]), bytes=raw["bytes"], files=files,
                           timings_s=dict(raw.get("timings_s", {})), dtype=raw.get("dtype"))  # fmt: skip
        except (AttributeError, KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a readable manifest ({type(e).__name__}: {e})") from None
        newer = isinstance(fmt, int) and fmt > MANIFEST_FORMAT
        raise ValueError(f"{where}: manifest format {fmt!r}" + (" is newer than" if newer else " is not one")
                         + f" this dora reads (1 to {MANIFEST_FORMAT})")  # fmt: skip

    def to_json(self) -> str:
        return json.dumps({"format": self.format, "version": self.version, "bytes": self.bytes,
                           "digest": str(self.digest), "dtype": self.dtype,
                           "files": {k: {"bytes": e.bytes, "chunks": list(e.chunks)} for k, e in self.files.items()},
                           "timings_s": {k: round(v, 4) for k, v in self.timings_s.items()}})  # fmt: skip

    def vouched(self) -> bool:
        """The files listed make the digest (format 3: the folder's root; format 2: the one file's chunks). A
        format-1 manifest lists no chunks: its file is checked whole."""
        d = self.digest
        if d.folder:
            return folder_root(d.algo, d.chunk_bytes, {k: (e.bytes, e.chunks) for k, e in self.files.items()}) == d.root
        entry = self.files.get(FILE)
        return bool(d.chunk_bytes) and entry is not None and (
            root_of(d.algo, d.chunk_bytes, entry.bytes, entry.chunks) == d.root)  # fmt: skip

    def file_digest(self, name: str) -> Digest:
        """What file ``name`` of the version must hash to: its own chunk root (a format-1 or 2 version's one file:
        the published digest itself)."""
        if not self.digest.folder:
            return self.digest
        e = self.files[name]
        return Digest(self.digest.algo, self.digest.chunk_bytes, root_of(self.digest.algo, self.digest.chunk_bytes,
                                                                         e.bytes, e.chunks))  # fmt: skip

    def weight_files(self) -> list[str]:
        """The safetensors files of the version, in name order (shards sort as they are numbered)."""
        return sorted(k for k in self.files if k.endswith(".safetensors"))
