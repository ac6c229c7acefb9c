"""Envelope and codec: ``[b"dora", version, kind, msgpack(map of fields), *raw array frames]``.

- Fields are a msgpack **map** keyed by field name, in declaration order; nested message parts
  (``RequestState``, ``TrainGroup``...) are maps too.
- An array field is a msgpack ext value ``(code 1, [frame_index, dtype, shape])`` pointing at one
  of the trailing raw frames. On receive the array is a read-only ``numpy`` view on the frame's
  memory: no copy. Only little-endian numeric and bool dtypes are accepted.
- Decoding is type-directed from the dataclass annotations: every value is checked against its
  declared type, unknown fields are ignored (a newer peer may add defaulted fields), missing
  required fields are an error. Any input either decodes to a valid message or raises
  ``DecodeError``; nothing else escapes. No pickle anywhere.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import struct
import types
import typing
from collections.abc import Sequence
from typing import Any

import msgpack
import numpy as np

from dora.wire import messages
from dora.wire.messages import MESSAGES, WIRE_VERSION

MAGIC = b"dora"
ARRAY_EXT = 1
MAX_ARRAY_DIMS = 8
DTYPES = frozenset({"|b1", "|u1", "|i1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"})
KINDS: dict[str, type] = {cls.KIND: cls for cls in MESSAGES}

Buffer = bytes | bytearray | memoryview | Any
"""Anything with the buffer protocol (bytes, memoryview, zmq.Frame)."""


class DecodeError(ValueError):
    """The frames are not a valid dora message."""


class WireVersionMismatch(DecodeError):
    """The envelope is a dora message of another wire version."""

    def __init__(self, peer_version: int, kind: str) -> None:
        super().__init__(f"wire version {peer_version} (this process speaks {WIRE_VERSION}), kind {kind!r}")
        self.peer_version = peer_version
        self.kind = kind


class EncodeError(TypeError):
    """A message holds a value its declared type does not allow (a bug in the sender)."""


@dataclasses.dataclass(frozen=True, slots=True)
class _ArrayRef:
    index: int
    dtype: str
    shape: tuple[int, ...]


# ---------------------------------------------------------------- type introspection


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(messages))


@functools.cache
def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    return tuple(dataclasses.fields(cls))


def _unwrap(tp: Any) -> Any:
    while hasattr(tp, "__supertype__"):  # NewType
        tp = tp.__supertype__
    return tp


def _resolve(tp: Any, value: Any) -> Any:
    """The type ``value`` must have: NewTypes unwrapped, ``X | None`` reduced to X (NoneType for None)."""
    tp = _unwrap(tp)
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return type(None)
        return _resolve(next(a for a in args if a is not type(None)), value)
    return tp


# ---------------------------------------------------------------- encode


def encode(msg: Any) -> list[Buffer]:
    """Frames for one message. Array frames are the arrays' own memory (no copy when contiguous)."""
    cls = type(msg)
    if KINDS.get(getattr(cls, "KIND", None)) is not cls:
        raise EncodeError(f"{cls.__name__} is not a wire message")
    arrays: list[np.ndarray] = []
    body = msgpack.packb(_enc_struct(msg, arrays), use_bin_type=True)
    return [MAGIC, struct.pack(">H", WIRE_VERSION), cls.KIND.encode("ascii"), body, *(memoryview(a) for a in arrays)]


def _enc_struct(obj: Any, arrays: list[np.ndarray]) -> dict[str, Any]:
    hints = _hints(type(obj))
    return {f.name: _enc(getattr(obj, f.name), hints[f.name], f.name, arrays) for f in _fields(type(obj))}


def _enc(value: Any, tp: Any, where: str, arrays: list[np.ndarray]) -> Any:
    tp = _resolve(tp, value)
    origin = typing.get_origin(tp)
    if tp is type(None):
        return None
    if tp is Any:
        _check_json(value, where, EncodeError)
        return value
    if tp is np.ndarray:
        if not isinstance(value, np.ndarray):
            raise EncodeError(f"{where}: expected a numpy array, got {type(value).__name__}")
        arr = np.require(value, requirements="C")
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        if arr.dtype.str not in DTYPES:
            raise EncodeError(f"{where}: dtype {arr.dtype} cannot travel")
        arrays.append(arr)
        ref = msgpack.packb([len(arrays) - 1, arr.dtype.str, list(arr.shape)])
        return msgpack.ExtType(ARRAY_EXT, ref)
    if origin is tuple:
        args = typing.get_args(tp)
        if not isinstance(value, tuple):
            raise EncodeError(f"{where}: expected a tuple, got {type(value).__name__}")
        elem = args[0] if len(args) == 2 and args[1] is Ellipsis else None
        return [_enc(v, elem or args[i], f"{where}[{i}]", arrays) for i, v in enumerate(value)]
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        return {_enc(k, key_tp, where, arrays): _enc(v, val_tp, f"{where}.{k}", arrays) for k, v in value.items()}
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, tp):
            raise EncodeError(f"{where}: expected {tp.__name__}, got {type(value).__name__}")
        return _enc_struct(value, arrays)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value).value
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bytes, bool) and type(value) is tp:
        return value
    raise EncodeError(f"{where}: {value!r} is not a {getattr(tp, '__name__', tp)}")


def _check_json(value: Any, where: str, error: type[Exception]) -> None:
    if value is None or isinstance(value, bool | int | float | str | bytes):
        return
    if isinstance(value, list | tuple):
        for v in value:
            _check_json(v, where, error)
        return
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        for v in value.values():
            _check_json(v, where, error)
        return
    raise error(f"{where}: {type(value).__name__} is not plain data")


# ---------------------------------------------------------------- decode


def decode(frames: Sequence[Buffer]) -> Any:
    """Decode one message; raise ``DecodeError`` (or its ``WireVersionMismatch``) for anything invalid."""
    try:
        return _decode(frames)
    except DecodeError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError, msgpack.UnpackException) as e:
        raise DecodeError(f"{type(e).__name__}: {e}") from None


def _decode(frames: Sequence[Buffer]) -> Any:
    if len(frames) < 4:
        raise DecodeError(f"{len(frames)} frames, a message has at least 4")
    if bytes(frames[0]) != MAGIC:
        raise DecodeError("not a dora message (bad magic frame)")
    version_frame = bytes(frames[1])
    if len(version_frame) != 2:
        raise DecodeError("bad version frame")
    kind = bytes(frames[2]).decode("ascii")
    (version,) = struct.unpack(">H", version_frame)
    if version != WIRE_VERSION:
        raise WireVersionMismatch(version, kind)
    cls = KINDS.get(kind)
    if cls is None:
        raise DecodeError(f"unknown message kind {kind!r}")
    body = msgpack.unpackb(bytes(frames[3]), raw=False, strict_map_key=True, ext_hook=_ext_hook)
    blobs = [memoryview(f) for f in frames[4:]]
    used: set[int] = set()
    msg = _dec_struct(body, cls, cls.KIND, blobs, used)
    if len(used) != len(blobs):
        raise DecodeError(f"{len(blobs) - len(used)} array frames are not referenced")
    return msg


def _ext_hook(code: int, data: bytes) -> _ArrayRef:
    if code != ARRAY_EXT:
        raise DecodeError(f"unknown ext type {code}")
    index, dtype, shape = msgpack.unpackb(data, raw=False)
    if not isinstance(index, int) or not isinstance(dtype, str) or not isinstance(shape, list):
        raise DecodeError("malformed array reference")
    if len(shape) > MAX_ARRAY_DIMS or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise DecodeError(f"bad array shape {shape!r}")
    return _ArrayRef(index, dtype, tuple(shape))


def _dec_struct(data: Any, cls: type, where: str, blobs: list[memoryview], used: set[int]) -> Any:
    if not isinstance(data, dict):
        raise DecodeError(f"{where}: expected a map of fields")
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    for f in _fields(cls):
        if f.name in data:
            kwargs[f.name] = _dec(data[f.name], hints[f.name], f"{where}.{f.name}", blobs, used)
        elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            raise DecodeError(f"{where}: missing field {f.name!r}")
    return cls(**kwargs)


def _dec(value: Any, tp: Any, where: str, blobs: list[memoryview], used: set[int]) -> Any:
    tp = _resolve(tp, value)
    origin = typing.get_origin(tp)
    if tp is type(None):
        return None
    if tp is Any:
        _check_json(value, where, DecodeError)
        return value
    if tp is np.ndarray:
        if not isinstance(value, _ArrayRef):
            raise DecodeError(f"{where}: expected an array reference")
        return _array(value, where, blobs, used)
    if origin is tuple:
        if not isinstance(value, list):
            raise DecodeError(f"{where}: expected a list")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_dec(v, args[0], f"{where}[{i}]", blobs, used) for i, v in enumerate(value))
        if len(args) != len(value):
            raise DecodeError(f"{where}: expected {len(args)} items")
        return tuple(_dec(v, a, f"{where}[{i}]", blobs, used) for i, (v, a) in enumerate(zip(value, args, strict=True)))
    if origin is dict:
        if not isinstance(value, dict):
            raise DecodeError(f"{where}: expected a map")
        key_tp, val_tp = typing.get_args(tp)
        return {
            _dec(k, key_tp, where, blobs, used): _dec(v, val_tp, f"{where}.{k}", blobs, used) for k, v in value.items()
        }
    if dataclasses.is_dataclass(tp):
        return _dec_struct(value, tp, where, blobs, used)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return tp(value)
    if tp is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if tp in (int, str, bytes, bool) and type(value) is tp:
        return value
    raise DecodeError(f"{where}: {type(value).__name__} where {getattr(tp, '__name__', tp)} is expected")


def _array(ref: _ArrayRef, where: str, blobs: list[memoryview], used: set[int]) -> np.ndarray:
    if ref.dtype not in DTYPES:
        raise DecodeError(f"{where}: dtype {ref.dtype!r} not accepted")
    if not 0 <= ref.index < len(blobs) or ref.index in used:
        raise DecodeError(f"{where}: array frame {ref.index} missing or used twice")
    used.add(ref.index)
    dtype = np.dtype(ref.dtype)
    blob = blobs[ref.index]
    count = 1
    for d in ref.shape:
        count *= d
    if count * dtype.itemsize != blob.nbytes:
        need = count * dtype.itemsize
        raise DecodeError(f"{where}: shape {ref.shape} of {dtype} needs {need} bytes, got {blob.nbytes}")
    arr = np.frombuffer(blob, dtype=dtype, count=count).reshape(ref.shape)
    arr.flags.writeable = False
    return arr
