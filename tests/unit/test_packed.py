"""Packed payloads: headers the broker decides on, arrays it forwards unread, checks the learner makes."""

from __future__ import annotations

import os

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import given, settings
from hypothesis import strategies as st

from dora.ids import Finish
from dora.samples import Batch, FinishedSample
from dora.wire import codec, packed
from tests.unit.wire_samples import for_message, same

EXAMPLES = int(os.environ.get("DORA_FUZZ_EXAMPLES", "500")) // 5
"""Examples per round-trip property: 100 by default (34 + 17 s of a loaded suite at 300); the wire fuzzers'
DORA_FUZZ_EXAMPLES scales them too (1500 for 300)."""


def sample(group: int, index: int, n: int, *, masked: bool = False, version: int = 3) -> FinishedSample:
    ids = np.arange(100 * group + index, 100 * group + index + n, dtype=np.int32)
    return FinishedSample(
        group_id=group, attempt=1, index=index, segments=np.array([[version, n]], np.int32), token_ids=ids,
        logprobs=-np.linspace(0.1, 1.0, n, dtype=np.float32), reward=float(index), finish=Finish.STOP,
        loss_mask=(np.arange(n) % 2).astype(np.uint8) if masked else None,
        turns=np.array([[1, n, version]], np.int32) if masked else None,
    )  # fmt: skip


def wire(msg):
    """Through the codec, as bytes: what the far end decodes."""
    return codec.decode([bytes(f) for f in codec.encode(msg)])


@settings(max_examples=EXAMPLES, deadline=None)
@given(samples=st.lists(for_message(FinishedSample), min_size=1, max_size=5))
def test_packed_samples_unpack_to_what_was_packed(samples):
    back = packed.unpack_samples(wire(packed.pack_samples(samples)))
    for a, b in zip(samples, back, strict=True):
        assert np.array_equal(a.token_ids.astype(np.int64), b.token_ids) and b.token_ids.dtype == np.int32
        assert np.array_equal(a.logprobs.astype(np.float32), b.logprobs, equal_nan=True)
        assert (a.loss_mask is None) == (b.loss_mask is None)
        assert a.loss_mask is None or np.array_equal(a.loss_mask, b.loss_mask)
        assert same(a.turns, b.turns) and np.array_equal(a.segments, b.segments)
        assert (a.group_id, a.index, a.reward, a.reward_error) == (b.group_id, b.index, b.reward, b.reward_error)


@settings(max_examples=EXAMPLES, deadline=None)
@given(batch=for_message(Batch))
def test_a_batch_packed_and_unpacked_is_the_same_batch(batch):
    back = packed.unpack_batch(wire(packed.pack_batch(batch)))
    assert back.step == batch.step and len(back.groups) == len(batch.groups)
    for g, h in zip(batch.groups, back.groups, strict=True):
        assert np.array_equal(g.prompt_ids, h.prompt_ids) and (g.group_id, g.version) == (h.group_id, h.version)
        for s, t in zip(g.samples, h.samples, strict=True):
            assert np.array_equal(s.token_ids, t.token_ids) and np.array_equal(s.logprobs, t.logprobs, equal_nan=True)
            assert same(s.loss_mask, t.loss_mask) and same(s.turns, t.turns)


def test_an_array_kind_travels_as_one_frame_per_message_and_per_batch_source():
    msg = packed.pack_samples([sample(1, i, 50, masked=i == 2) for i in range(8)])
    frames = codec.encode(msg)
    assert len(frames) == 4 + 3, "token ids, log-probs and the loss mask: one frame each, whatever the sample count"
    body = msgpack.unpackb(bytes(frames[3]))
    assert [h["masked"] for h in body["samples"]] == [False, False, True] + [False] * 5
    other = packed.pack_samples([sample(2, i, 30) for i in range(8)])
    carried = [(1, 3, np.arange(5), [(h, msg) for h in msg.samples]),
               (2, 3, np.arange(7), [(h, other) for h in other.samples])]  # fmt: skip
    batch = packed.batch_message(9, carried)
    assert len(codec.encode(batch)) == 4 + 1 + 3 + 2, "the prompts, then each source's arrays (no mask: none sent)"


def test_the_broker_forwards_the_received_frames_without_copying_them(tmp_path):
    """What the broker does with a worker's message: decode it (headers and one view per array kind), then put
    its arrays into a train batch: the batch's frames are the received frames' memory."""
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        for s in (a, b):
            s.setsockopt(zmq.LINGER, 0)
        a.bind(f"ipc://{tmp_path}/pair.sock")
        b.connect(f"ipc://{tmp_path}/pair.sock")
        a.send_multipart(codec.encode(packed.pack_samples([sample(1, i, 4096) for i in range(8)])), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        got = codec.decode(frames)
        batch = packed.batch_message(0, [(1, 3, np.arange(3), [(h, got) for h in got.samples])])
        out = codec.encode(batch)
        received = np.frombuffer(frames[4].buffer, dtype=np.uint8)
        assert np.shares_memory(np.asarray(out[5]), received), "the token ids frame is forwarded as received"
        assert out[5] is frames[4] and out[6] is frames[5], "the received frames themselves: sent by reference"
        assert isinstance(out[4], memoryview), "an array made here (the prompts) travels as its own memory"
        learned = packed.unpack_batch(codec.decode(out))
        assert [int(s.token_ids[0]) for s in learned.groups[0].samples] == [100 + i for i in range(8)]
    finally:
        ctx.destroy(linger=0)


def test_a_header_whose_tokens_lie_outside_the_payload_does_not_decode():
    frames = codec.encode(packed.pack_samples([sample(1, 0, 10), sample(1, 1, 10)]))
    body = msgpack.unpackb(bytes(frames[3]))
    body["samples"][1]["tokens"] = 11
    with pytest.raises(codec.DecodeError, match=r"sample 1/1 spans \[10, 21\) outside its payload"):
        codec.decode([*frames[:3], msgpack.packb(body), *frames[4:]])
    body["samples"][1]["tokens"] = 10
    body["samples"][1]["masked"] = True
    with pytest.raises(codec.DecodeError, match="masked but its payload has no loss mask"):
        codec.decode([*frames[:3], msgpack.packb(body), *frames[4:]])


def test_packed_arrays_must_have_the_packed_dtypes():
    frames = codec.encode(packed.pack_samples([sample(1, 0, 4)]))
    body = msgpack.unpackb(bytes(frames[3]), ext_hook=lambda code, data: msgpack.ExtType(code, data))
    ref = msgpack.unpackb(body["token_ids"].data)
    body["token_ids"] = msgpack.ExtType(1, msgpack.packb([ref[0], "<f4", ref[2]]))  # the same bytes, as floats
    with pytest.raises(codec.DecodeError, match="packed token_ids must be 1-D int32"):
        codec.decode([*frames[:3], msgpack.packb(body), *frames[4:]])


@pytest.mark.parametrize("where", ["token_ids", "logprobs", "loss_mask"])
def test_the_learner_refuses_a_batch_whose_payload_was_corrupted_naming_the_group(where):
    msg = packed.pack_samples([sample(7, i, 20, masked=True) for i in range(4)])
    batch = packed.batch_message(5, [(7, 4, np.arange(3), [(h, msg) for h in msg.samples])])
    frames = [bytearray(bytes(f)) for f in codec.encode(batch)]
    frame, at = {"token_ids": (5, 4 * 40 + 1), "logprobs": (6, 4 * 40 + 1), "loss_mask": (7, 40)}[where]
    frames[frame][at] ^= 1  # a byte of sample 2 (tokens [40, 60) of the source)
    with pytest.raises(
        packed.CorruptBatch, match=r"batch 5: group 7 sample 2: its payload does not match its checksum"
    ):
        packed.unpack_batch(codec.decode([bytes(f) for f in frames]))
    assert packed.unpack_batch(codec.decode(codec.encode(batch))).groups[0].samples[2].token_ids[0] == 702


def test_token_ids_that_do_not_fit_int32_are_refused_when_packed():
    s = sample(1, 0, 3)
    big = FinishedSample(**{**{f: getattr(s, f) for f in s.__dataclass_fields__},
                              "token_ids": np.array([1, 2, 2**40], np.int64)})  # fmt: skip
    with pytest.raises(ValueError, match="token ids do not fit"):
        packed.pack_samples([big])
    ok = FinishedSample(**{**{f: getattr(s, f) for f in s.__dataclass_fields__},
                             "token_ids": np.array([1, 2, 3], np.int64)})  # fmt: skip
    assert packed.pack_samples([ok]).token_ids.dtype == np.int32
