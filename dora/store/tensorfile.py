"""A safetensors file mapped once into this process, and its tensors as views of that mapping (nothing copied).

What ``dora.store.load_verified`` checks and loads: the file is mapped private (copy-on-write: a write to a tensor
never reaches the file, and the mapping keeps the file's bytes even once it is deleted or replaced under its name),
the digest is computed over the mapping, and the tensors are cut from that same mapping, so the bytes checked are
the bytes loaded. The check reads each byte in place (no copy into a buffer first) and leaves the pages mapped, so
the caller's copy into its model then takes no page faults: the check costs one read of the file from memory.

The format (https://github.com/huggingface/safetensors): an 8-byte little-endian header length, a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__"?: {...}}``, then the data, offsets
counted from its start. Everything is checked against the file's size before a tensor is cut, so a file that is
not one (or a header that lies) is a ValueError, never a read outside the mapping.

A file that shrinks while mapped would fault (SIGBUS) when its lost pages are read, as with any mapped load; the
store never rewrites a published file in place (a version is renamed into place whole).
"""

from __future__ import annotations

import json
import math
import mmap
import os
from typing import Any

import torch

HEADER_MAX_BYTES = 100_000_000
"""safetensors' own limit on the JSON header."""
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, attr)
    for name, attr in [("F64", "float64"), ("F32", "float32"), ("F16", "float16"), ("BF16", "bfloat16"),
                       ("I64", "int64"), ("I32", "int32"), ("I16", "int16"), ("I8", "int8"), ("U8", "uint8"),
                       ("U16", "uint16"), ("U32", "uint32"), ("U64", "uint64"), ("BOOL", "bool"),
                       ("C64", "complex64"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2")]
    if hasattr(torch, attr)
}  # fmt: skip


def map_file(fd: int) -> mmap.mmap | bytes:
    """A private, copy-on-write mapping of the whole file behind ``fd`` (``b""`` for an empty file)."""
    size = os.fstat(fd).st_size
    if size == 0:
        return b""
    return mmap.mmap(fd, size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)


def tensors(data: mmap.mmap | bytes, *, name: str, device: str = "cpu") -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file held in ``data``, as views of it (on ``device``: copied there).
    A malformed file raises ValueError naming ``name``."""
    out = {}
    for key, (dtype, shape, offset, count) in header(data, name=name).items():
        if count == 0:  # frombuffer refuses an empty tensor
            t = torch.empty(shape, dtype=dtype)
        else:
            t = torch.frombuffer(data, dtype=dtype, count=count, offset=offset).view(shape)
        out[key] = t if device == "cpu" else t.to(device)
    return out


def header(data: mmap.mmap | bytes, *, name: str) -> dict[str, tuple[torch.dtype, list[int], int, int]]:
    """Each tensor's (dtype, shape, offset of its first byte in the file, element count), checked against the size."""
    size = len(data)
    if size < 8:
        raise ValueError(f"{name}: not a safetensors file ({size} bytes)")
    n = int.from_bytes(data[:8], "little")
    if n > min(HEADER_MAX_BYTES, size - 8):
        raise ValueError(f"{name}: not a safetensors file (a header of {n} bytes in a file of {size})")
    try:
        raw: Any = json.loads(data[8 : 8 + n])
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name}: not a safetensors file (its header is not JSON: {e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name}: not a safetensors file (its header is not a JSON object)")
    base = 8 + n
    found = {}
    for key, entry in raw.items():
        if key == "__metadata__":
            continue
        try:
            dtype = DTYPES[entry["dtype"]]
            shape = [int(d) for d in entry["shape"]]
            lo, hi = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{name}: tensor {key!r} has no readable dtype, shape and offsets ({e!r})") from None
        count = math.prod(shape)
        if min(shape, default=0) < 0 or not 0 <= lo <= hi <= size - base or hi - lo != count * dtype.itemsize:
            raise ValueError(f"{name}: tensor {key!r} ({entry['dtype']} {shape}) does not fit bytes {lo}-{hi} of "
                             f"the {size - base} bytes of data")  # fmt: skip
        found[key] = (dtype, shape, base + lo, count)
    return found
