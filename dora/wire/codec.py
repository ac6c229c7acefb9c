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
MAX_ARRAY_FRAMES = 1 << 17
"""Arrays in one message (a train batch of 8,192 samples carries about 25,000)."""
MAX_BODY_BYTES = 32 << 20
"""The msgpack map of fields; arrays travel beside it. The socket's MAXMSGSIZE caps the whole message."""
MAX_STR_BYTES = 1 << 20
DTYPES = frozenset({"|b1", "|u1", "|i1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"})
KINDS: dict[str, type] = {cls.KIND: cls for cls in MESSAGES}
_DTYPE_OBJECTS = {d: np.dtype(d) for d in DTYPES}

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


Enc = typing.Callable[[Any, str, list[np.ndarray]], Any]
Dec = typing.Callable[[Any, str, list[memoryview], set[int]], Any]
"""A field's codec, compiled once per declared type (the type walk is not repeated per message)."""


def _optional(tp: Any) -> tuple[Any, bool]:
    """(the type a non-None value must have, whether None is allowed): NewTypes unwrapped, ``X | None`` split."""
    tp = _unwrap(tp)
    if typing.get_origin(tp) in (types.UnionType, typing.Union):
        args = typing.get_args(tp)
        return _unwrap(next(a for a in args if a is not type(None))), type(None) in args
    return tp, False


# ---------------------------------------------------------------- encode


def encode(msg: Any) -> list[Buffer]:
    """Frames for one message. Array frames are the arrays' own memory (no copy when contiguous)."""
    cls = type(msg)
    if KINDS.get(getattr(cls, "KIND", None)) is not cls:
        raise EncodeError(f"{cls.__name__} is not a wire message")
    arrays: list[np.ndarray] = []
    body = msgpack.packb(_struct_encoder(cls)(msg, cls.KIND, arrays), use_bin_type=True)
    return [MAGIC, _VERSION_FRAME, cls.KIND.encode("ascii"), body, *(memoryview(a) for a in arrays)]


_VERSION_FRAME = struct.pack(">H", WIRE_VERSION)


@functools.cache
def _struct_encoder(cls: type) -> Enc:
    hints = _hints(cls)
    plan = [(f.name, _encoder(hints[f.name])) for f in _fields(cls)]

    def enc(obj: Any, where: str, arrays: list[np.ndarray]) -> dict[str, Any]:
        return {name: e(getattr(obj, name), f"{where}.{name}", arrays) for name, e in plan}

    return enc


@functools.cache
def _encoder(declared: Any) -> Enc:
    tp, nullable = _optional(declared)
    inner = _base_encoder(tp)
    if not nullable:
        return inner
    return lambda v, where, arrays: None if v is None else inner(v, where, arrays)


def _base_encoder(tp: Any) -> Enc:
    origin = typing.get_origin(tp)
    name = getattr(tp, "__name__", str(tp))

    def mismatch(v: Any, where: str, arrays: list[np.ndarray]) -> Any:
        raise EncodeError(f"{where}: {v!r} is not a {name}")

    if tp is type(None):
        return lambda v, where, arrays: None if v is None else mismatch(v, where, arrays)
    if tp is Any:

        def plain(v: Any, where: str, arrays: list[np.ndarray]) -> Any:
            _check_json(v, where, EncodeError)
            return v

        return plain
    if tp is np.ndarray:
        return _enc_array
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            elem = _encoder(args[0])

            def homogeneous(v: Any, where: str, arrays: list[np.ndarray]) -> Any:
                if not isinstance(v, tuple):
                    raise EncodeError(f"{where}: expected a tuple, got {type(v).__name__}")
                return [elem(x, f"{where}[{i}]", arrays) for i, x in enumerate(v)]

            return homogeneous
        elems = [_encoder(a) for a in args]

        def fixed(v: Any, where: str, arrays: list[np.ndarray]) -> Any:
            if not isinstance(v, tuple) or len(v) != len(elems):
                raise EncodeError(f"{where}: expected a tuple of {len(elems)}, got {v!r}")
            return [e(x, f"{where}[{i}]", arrays) for i, (e, x) in enumerate(zip(elems, v, strict=True))]

        return fixed
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        ke, ve = _encoder(key_tp), _encoder(val_tp)
        return lambda v, where, arrays: {ke(k, where, arrays): ve(x, f"{where}.{k}", arrays) for k, x in v.items()}
    if dataclasses.is_dataclass(tp):
        fields = _struct_encoder(tp)

        def nested(v: Any, where: str, arrays: list[np.ndarray]) -> Any:
            if not isinstance(v, tp):
                raise EncodeError(f"{where}: expected {name}, got {type(v).__name__}")
            return fields(v, where, arrays)

        return nested
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda v, where, arrays: tp(v).value
    if tp is float:
        return lambda v, where, arrays: (
            float(v) if isinstance(v, int | float) and not isinstance(v, bool) else mismatch(v, where, arrays)
        )
    if tp in (int, str, bytes, bool):
        return lambda v, where, arrays: v if type(v) is tp else mismatch(v, where, arrays)
    return mismatch


def _enc_array(value: Any, where: str, arrays: list[np.ndarray]) -> Any:
    if not isinstance(value, np.ndarray):
        raise EncodeError(f"{where}: expected a numpy array, got {type(value).__name__}")
    arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    dtype = arr.dtype.str
    if dtype not in DTYPES:
        raise EncodeError(f"{where}: dtype {arr.dtype} cannot travel")
    arrays.append(arr)
    return msgpack.ExtType(ARRAY_EXT, _pack([len(arrays) - 1, dtype, list(arr.shape)]))


_pack = msgpack.Packer().pack


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
    if not 4 <= len(frames) <= 4 + MAX_ARRAY_FRAMES:
        raise DecodeError(f"{len(frames)} frames, a message has 4 to {4 + MAX_ARRAY_FRAMES}")
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
    if memoryview(frames[3]).nbytes > MAX_BODY_BYTES:
        raise DecodeError(f"a body of {memoryview(frames[3]).nbytes} bytes, more than {MAX_BODY_BYTES}")
    body = msgpack.unpackb(bytes(frames[3]), raw=False, strict_map_key=True, ext_hook=_ext_hook,
                           max_str_len=MAX_STR_BYTES, max_bin_len=MAX_STR_BYTES)  # fmt: skip
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
    return _struct_decoder(cls)(data, where, blobs, used)


@functools.cache
def _struct_decoder(cls: type) -> Dec:
    hints = _hints(cls)
    plan = [
        (f.name, _decoder(hints[f.name]), f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
        for f in _fields(cls)
    ]

    def dec(data: Any, where: str, blobs: list[memoryview], used: set[int]) -> Any:
        if not isinstance(data, dict):
            raise DecodeError(f"{where}: expected a map of fields")
        kwargs: dict[str, Any] = {}
        for name, d, required in plan:
            if name in data:
                kwargs[name] = d(data[name], f"{where}.{name}", blobs, used)
            elif required:
                raise DecodeError(f"{where}: missing field {name!r}")
        return cls(**kwargs)

    return dec


@functools.cache
def _decoder(declared: Any) -> Dec:
    tp, nullable = _optional(declared)
    inner = _base_decoder(tp)
    if not nullable:
        return inner
    return lambda v, where, blobs, used: None if v is None else inner(v, where, blobs, used)


def _base_decoder(tp: Any) -> Dec:
    origin = typing.get_origin(tp)
    name = getattr(tp, "__name__", str(tp))

    def mismatch(v: Any, where: str, blobs: list[memoryview], used: set[int]) -> Any:
        raise DecodeError(f"{where}: {type(v).__name__} where {name} is expected")

    if tp is type(None):
        return lambda v, where, blobs, used: None if v is None else mismatch(v, where, blobs, used)
    if tp is Any:

        def plain(v: Any, where: str, blobs: list[memoryview], used: set[int]) -> Any:
            _check_json(v, where, DecodeError)
            return v

        return plain
    if tp is np.ndarray:

        def array(v: Any, where: str, blobs: list[memoryview], used: set[int]) -> Any:
            if not isinstance(v, _ArrayRef):
                raise DecodeError(f"{where}: expected an array reference")
            return _array(v, where, blobs, used)

        return array
    if origin is tuple:
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            elem = _decoder(args[0])

            def homogeneous(v: Any, where: str, blobs: list[memoryview], used: set[int]) -> Any:
                if not isinstance(v, list):
                    raise DecodeError(f"{where}: expected a list")
                return tuple(elem(x, f"{where}[{i}]", blobs, used) for i, x in enumerate(v))

            return homogeneous
        elems = [_decoder(a) for a in args]

        def fixed(v: Any, where: str, blobs: list[memoryview], used: set[int]) -> Any:
            if not isinstance(v, list):
                raise DecodeError(f"{where}: expected a list")
            if len(v) != len(elems):
                raise DecodeError(f"{where}: expected {len(elems)} items")
            return tuple(d(x, f"{where}[{i}]", blobs, used) for i, (d, x) in enumerate(zip(elems, v, strict=True)))

        return fixed
    if origin is dict:
        key_tp, val_tp = typing.get_args(tp)
        kd, vd = _decoder(key_tp), _decoder(val_tp)

        def mapping(v: Any, where: str, blobs: list[memoryview], used: set[int]) -> Any:
            if not isinstance(v, dict):
                raise DecodeError(f"{where}: expected a map")
            return {kd(k, where, blobs, used): vd(x, f"{where}.{k}", blobs, used) for k, x in v.items()}

        return mapping
    if dataclasses.is_dataclass(tp):
        return _struct_decoder(tp)
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return lambda v, where, blobs, used: tp(v)
    if tp is float:
        return lambda v, where, blobs, used: (
            float(v) if isinstance(v, int | float) and not isinstance(v, bool) else mismatch(v, where, blobs, used)
        )
    if tp in (int, str, bytes, bool):
        return lambda v, where, blobs, used: v if type(v) is tp else mismatch(v, where, blobs, used)
    return mismatch


def _array(ref: _ArrayRef, where: str, blobs: list[memoryview], used: set[int]) -> np.ndarray:
    if ref.dtype not in DTYPES:
        raise DecodeError(f"{where}: dtype {ref.dtype!r} not accepted")
    if not 0 <= ref.index < len(blobs) or ref.index in used:
        raise DecodeError(f"{where}: array frame {ref.index} missing or used twice")
    used.add(ref.index)
    dtype = _DTYPE_OBJECTS[ref.dtype]
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
