"""Envelope and codec: ``[b"dora", version, kind, msgpack(map of fields), *raw array frames]``.

- Fields are a msgpack **map** keyed by field name, in declaration order; nested message parts
  (``SampleHeader``, ``BatchGroup``...) are maps too.
- An array field is a msgpack ext value ``(code 1, [frame_index, dtype, shape])`` pointing at one
  of the trailing raw frames. On receive the array is a read-only ``numpy`` view on the frame's
  memory: no copy. Only little-endian numeric and bool dtypes are accepted.
- Decoding is type-directed from the dataclass annotations, by ``msgspec`` (compiled once per kind):
  every value is checked against its declared type and each message's ``__post_init__`` runs,
  unknown fields are ignored (a newer peer may add defaulted fields), missing required fields are an
  error. Any input either decodes to a valid message or raises ``DecodeError`` naming the field
  (``cancel.group_id``); nothing else escapes. No pickle anywhere.
- Encoding writes what the message holds; a value that is not plain data or an allowed array raises
  ``EncodeError``. A field of the wrong type is refused by the receiver, which checks every field.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import struct
import threading
import typing
from collections.abc import Sequence
from typing import Any

import msgspec
import numpy as np

from dora.wire import messages
from dora.wire.messages import MESSAGES, WIRE_VERSION, Message

MAGIC = b"dora"
ARRAY_EXT = 1
MAX_ARRAY_DIMS = 8
MAX_ARRAY_FRAMES = 1 << 17
"""Arrays in one message (a train batch carries three per payload source)."""
MAX_BODY_BYTES = 32 << 20
"""The msgpack map of fields; arrays travel beside it. The socket's MAXMSGSIZE caps the whole message."""
DTYPES = frozenset({"|b1", "|u1", "|i1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8"})
KINDS: dict[str, type[Message]] = {cls.KIND: cls for cls in MESSAGES}
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
    """A message holds a value that cannot travel (a bug in the sender)."""


class _ArrayRef(typing.NamedTuple):
    frame: int
    dtype: str
    shape: tuple[int, ...]


class _Frames(threading.local):
    """The arrays of the message being encoded or decoded on this thread (the hooks below read them)."""

    def __init__(self) -> None:
        self.arrays: list[np.ndarray] = []
        self.blobs: list[memoryview] = []
        self.used: set[int] = set()


_frames = _Frames()


# ---------------------------------------------------------------- encode


def _enc_hook(value: Any) -> Any:
    if not isinstance(value, np.ndarray):
        raise EncodeError(f"{type(value).__name__} cannot travel (plain data and numpy arrays only)")
    arr = value if value.flags.c_contiguous else np.ascontiguousarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    dtype = arr.dtype.str
    if dtype not in DTYPES:
        raise EncodeError(f"an array of dtype {arr.dtype} cannot travel")
    arrays = _frames.arrays
    arrays.append(arr)
    return msgspec.msgpack.Ext(ARRAY_EXT, _ref_encoder.encode((len(arrays) - 1, dtype, arr.shape)))


_ref_encoder = msgspec.msgpack.Encoder()
_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)


def encode(msg: Message) -> list[Buffer]:
    """Frames for one message. Array frames are the arrays' own memory (no copy when contiguous)."""
    cls = type(msg)
    if cls not in _KIND_FRAMES:
        raise EncodeError(f"{cls.__name__} is not a wire message")
    arrays: list[np.ndarray] = []
    _frames.arrays = arrays
    try:
        body = _encoder.encode(msg)
    except EncodeError:
        raise
    except (TypeError, ValueError, OverflowError) as e:
        raise EncodeError(f"{cls.KIND}: {e}") from None
    finally:
        _frames.arrays = []
    return [MAGIC, _VERSION_FRAME, _KIND_FRAMES[cls], body, *(_source(a) for a in arrays)]


def encode_plain(cls: type[Message], fields: dict[str, Any]) -> list[Buffer]:
    """Frames for a message of kind ``cls`` given as plain data: ``fields`` holds every field, in declaration
    order, nested message parts as such maps too, and no array. The same bytes as ``encode(cls(**fields))``
    without building the dataclasses, for the broker's commonest answer; nothing is checked, so a caller
    keeps a test that compares the bytes."""
    return [MAGIC, _VERSION_FRAME, _KIND_FRAMES[cls], _plain_encoder.encode(fields)]


_plain_encoder = msgspec.msgpack.Encoder()


def _source(arr: np.ndarray) -> Buffer:
    """An array's frame: the buffer it was decoded from when it views all of it (a received frame, which a
    transport can forward by reference instead of wrapping its memory anew), else the array's own memory."""
    base: object = arr.base  # numpy declares an array's base an array, but frombuffer's is the buffer it was given
    if isinstance(base, memoryview) and base.nbytes == arr.nbytes and not isinstance(base.obj, np.ndarray | None):
        return base.obj
    return arr.data


_VERSION_FRAME = struct.pack(">H", WIRE_VERSION)
_KIND_FRAMES: dict[type[Message], bytes] = {cls: cls.KIND.encode("ascii") for cls in MESSAGES}


# ---------------------------------------------------------------- decode


def _ext_hook(code: int, data: memoryview) -> _ArrayRef:
    if code != ARRAY_EXT:
        raise DecodeError(f"unknown ext type {code}")
    try:
        frame, dtype, shape = _ref_decoder.decode(data)
    except msgspec.MsgspecError:
        raise DecodeError("malformed array reference") from None
    if len(shape) > MAX_ARRAY_DIMS or min(shape, default=0) < 0:
        raise DecodeError(f"bad array shape {list(shape)!r}")
    return _ArrayRef(frame, dtype, shape)


_ref_decoder = msgspec.msgpack.Decoder(tuple[int, str, tuple[int, ...]])


def _dec_hook(tp: Any, value: Any) -> Any:
    if tp is not np.ndarray:
        raise NotImplementedError
    if not isinstance(value, _ArrayRef):
        raise ValueError("expected an array reference")
    return _array(value, _frames.blobs, _frames.used)


@functools.cache
def _decoder(cls: type) -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(cls, ext_hook=_ext_hook, dec_hook=_dec_hook)


@functools.cache
def _plain_fields(cls: type) -> tuple[str, ...]:
    """Fields declared ``Any`` (plain data): no array reference may hide in them."""
    hints = typing.get_type_hints(cls, vars(messages))
    return tuple(f.name for f in dataclasses.fields(cls) if hints[f.name] is Any)


_PATH = re.compile(r"`\$")


def decode(frames: Sequence[Buffer]) -> Message:
    """Decode one message; raise ``DecodeError`` (or its ``WireVersionMismatch``) for anything invalid."""
    try:
        return _decode(frames)
    except DecodeError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, RecursionError) as e:
        raise DecodeError(f"{type(e).__name__}: {e}") from None
    finally:
        _frames.blobs, _frames.used = [], set()


def _decode(frames: Sequence[Buffer]) -> Message:
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
    body = memoryview(frames[3])
    if body.nbytes > MAX_BODY_BYTES:
        raise DecodeError(f"a body of {body.nbytes} bytes, more than {MAX_BODY_BYTES}")
    blobs = [memoryview(f).toreadonly() for f in frames[4:]]  # so every array on them is read-only
    used: set[int] = set()
    _frames.blobs, _frames.used = blobs, used
    try:
        msg = _decoder(cls).decode(body)
    except msgspec.ValidationError as e:
        text = str(e)
        raise DecodeError(_PATH.sub(f"`{kind}", text) if "`$" in text else f"{kind}: {text}") from None
    except msgspec.DecodeError as e:
        raise DecodeError(f"{kind}: {e}") from None
    for name in _plain_fields(cls):
        _check_json(getattr(msg, name), f"{kind}.{name}", DecodeError)
    if len(used) != len(blobs):
        raise DecodeError(f"{len(blobs) - len(used)} array frames are not referenced")
    return msg


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


def _array(ref: _ArrayRef, blobs: list[memoryview], used: set[int]) -> np.ndarray:
    if ref.dtype not in DTYPES:
        raise ValueError(f"dtype {ref.dtype!r} not accepted")
    if not 0 <= ref.frame < len(blobs) or ref.frame in used:
        raise ValueError(f"array frame {ref.frame} missing or used twice")
    used.add(ref.frame)
    dtype = _DTYPE_OBJECTS[ref.dtype]
    blob = blobs[ref.frame]
    count = 1
    for d in ref.shape:
        count *= d
    if count * dtype.itemsize != blob.nbytes:
        need = count * dtype.itemsize
        raise ValueError(f"shape {list(ref.shape)} of {dtype} needs {need} bytes, got {blob.nbytes}")
    arr = np.frombuffer(blob, dtype=dtype, count=count)
    return arr if len(ref.shape) == 1 else arr.reshape(ref.shape)
