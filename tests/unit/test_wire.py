"""Wire protocol: round trips, golden bytes, decoder fuzzing, zero-copy arrays, the Hello handshake."""

from __future__ import annotations

import json
import os
import pathlib
import struct
import sys

import msgpack
import numpy as np
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dora.samples import FinishedSample
from dora.wire import codec
from dora.wire import messages as m
from tests.unit.wire_samples import any_message, canonical, for_message, i32, same

V = struct.pack(">H", m.WIRE_VERSION)
GOLDEN = pathlib.Path(__file__).parent / "golden" / f"wire_v{m.WIRE_VERSION}.json"


def test_every_message_kind_is_unique_and_registered():
    kinds = [cls.KIND for cls in m.MESSAGES]
    assert len(kinds) == len(set(kinds))
    assert set(codec.KINDS) == set(kinds)
    assert set(canonical()) == set(kinds), "every kind needs a canonical (golden) instance"


@pytest.mark.parametrize("cls", m.MESSAGES, ids=lambda c: c.KIND)
def test_messages_are_frozen_slotted_kw_only(cls):
    params = cls.__dataclass_params__
    assert params.frozen and cls.__dataclass_fields__ and hasattr(cls, "__slots__")
    assert all(f.kw_only for f in cls.__dataclass_fields__.values())


@pytest.mark.parametrize("cls", m.MESSAGES, ids=lambda c: c.KIND)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_round_trip(cls, data):
    msg = data.draw(for_message(cls))
    back = codec.decode(codec.encode(msg))
    assert same(msg, back), (msg, back)


@pytest.mark.parametrize("kind", sorted(canonical()))
def test_golden_bytes(kind):
    """The encoding of each kind is pinned per WIRE_VERSION: a change must be deliberate."""
    golden = json.loads(GOLDEN.read_text())
    msg = canonical()[kind]
    frames = [bytes(f).hex() for f in codec.encode(msg)]
    assert frames == golden[kind], f"{kind} encodes differently from {GOLDEN.name}"
    assert same(codec.decode([bytes.fromhex(f) for f in golden[kind]]), msg)


def test_fields_travel_as_a_map_keyed_by_name():
    frames = codec.encode(m.Cancel(group_id=3, attempt=9, seq=4))
    assert msgpack.unpackb(bytes(frames[3])) == {"group_id": 3, "attempt": 9, "seq": 4}


def test_a_field_added_with_a_default_decodes_from_older_peers():
    """An older peer's Hello lacks ``learner_version``: it decodes with the default."""
    frames = codec.encode(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.LEARNER, peer_id="l", pid=1, host="h"))
    body = msgpack.unpackb(bytes(frames[3]))
    del body["learner_version"]
    old = codec.decode([*frames[:3], msgpack.packb(body)])
    assert old.learner_version is None and old.peer_id == "l"


def test_an_older_peers_hello_and_assign_mean_one_version_held():
    """Peers from before multi-version workers send no ``holds`` and no ``keep``: a full-weight worker's."""
    hello = codec.encode(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id="w", pid=1, host="h",
                                 holds=4))  # fmt: skip
    assign = codec.encode(m.Assign(version=3, uri="file:///v3", sha256="0" * 64, keep=(1, 2)))
    old = []
    for frames, field in ((hello, "holds"), (assign, "keep")):
        body = msgpack.unpackb(bytes(frames[3]))
        del body[field]
        old.append(codec.decode([*frames[:3], msgpack.packb(body)]))
    assert old[0].holds == 1 and old[1].keep == ()
    assert codec.decode(assign).keep == (1, 2)


def test_a_heartbeats_counters_travel_and_one_without_them_encodes_as_before():
    """A worker's counters travel as a map; a heartbeat without them has no ``counters`` key (its bytes are those
    of the golden file, from before the field) and reads as none; a counter below 0 or not finite is refused."""
    plain = codec.encode(m.Heartbeat(tokens_generated=5, seen=2, holding=np.zeros((0, 2), np.int64)))
    body = msgpack.unpackb(bytes(plain[3]))
    assert "counters" not in body
    assert codec.decode(plain).counted() == {}
    counters = {"reward_service_calls": 3.0, "reward_service_latency_s_sum": 0.25, "agent_failed": 1.0}
    frames = codec.encode(m.Heartbeat(tokens_generated=5, seen=2, holding=np.zeros((0, 2), np.int64),
                                      counters=counters))  # fmt: skip
    sent = msgpack.unpackb(bytes(frames[3]))
    assert sent.pop("counters") == counters and sent == body  # the one key more, last
    back = codec.decode(frames)
    assert back.counted() == counters and back.tokens_generated == 5
    for bad in (-1.0, float("inf")):
        with pytest.raises(codec.DecodeError, match="counters"):
            codec.decode([*frames[:3], msgpack.packb({**body, "counters": {"agent_failed": bad}}), *frames[4:]])


def test_reward_components_and_error_travel_and_default_for_older_peers():
    msg = canonical()["samples_finished"]
    back = codec.decode(codec.encode(msg))
    assert back.samples[0].reward_components == {"correct": 1.0, "format": 0.5}
    assert back.samples[1].reward_error.startswith("reward raised")
    frames = codec.encode(msg)
    body = msgpack.unpackb(bytes(frames[3]))
    first = body["samples"][0]
    assert first["reward_components"] == {"correct": 1.0, "format": 0.5}  # a msgpack map, keyed by name
    del first["reward_components"], first["reward_error"]
    old = codec.decode([*frames[:3], msgpack.packb(body), *frames[4:]])
    assert old.samples[0].reward_components == {} and old.samples[0].reward_error == "" and old.samples[0].reward == 1
    first["reward_components"] = {"format": float("nan")}
    with pytest.raises(codec.DecodeError, match="reward_components"):
        codec.decode([*frames[:3], msgpack.packb(body), *frames[4:]])
    first["reward_components"] = {"format": "high"}
    with pytest.raises(codec.DecodeError, match=r"got `str` - at `samples_finished\.samples\[0\]\.reward_components"):
        codec.decode([*frames[:3], msgpack.packb(body), *frames[4:]])


FUZZ_EXAMPLES = int(os.environ.get("DORA_FUZZ_EXAMPLES", "500"))
"""Examples per fuzzer. 500 by default: the three fuzzers took 78 s of a loaded suite at 2,000 each;
DORA_FUZZ_EXAMPLES=2000 runs the longer soak."""
FUZZ = settings(max_examples=FUZZ_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _decode_or_error(frames):
    try:
        msg = codec.decode(frames)
    except codec.DecodeError:
        return
    # Whatever decodes must be a valid message that survives a second round trip unchanged.
    assert type(msg) in m.MESSAGES
    assert same(codec.decode(codec.encode(msg)), msg)


@FUZZ
@given(frames=st.lists(st.binary(max_size=64), max_size=7))
def test_fuzz_random_frames(frames):
    _decode_or_error(frames)


@FUZZ
@given(frames=st.lists(st.binary(max_size=40), max_size=4), kind=st.sampled_from(sorted(codec.KINDS)))
def test_fuzz_valid_envelope_random_body(frames, kind):
    _decode_or_error([codec.MAGIC, struct.pack(">H", m.WIRE_VERSION), kind.encode(), *frames])


@FUZZ
@given(msg=any_message, data=st.data())
def test_fuzz_mutated_valid_messages(msg, data):
    frames = [bytearray(bytes(f)) for f in codec.encode(msg)]
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(frames) - 1))
        action = data.draw(st.sampled_from(["flip", "truncate", "drop", "duplicate", "insert"]))
        if action == "flip" and frames[i]:
            j = data.draw(st.integers(0, len(frames[i]) - 1))
            frames[i][j] ^= data.draw(st.integers(1, 255))
        elif action == "truncate":
            frames[i] = frames[i][: data.draw(st.integers(0, len(frames[i])))]
        elif action == "drop" and len(frames) > 1:
            del frames[i]
        elif action == "duplicate":
            frames.insert(i, bytearray(frames[i]))
        elif action == "insert":
            frames.insert(i, bytearray(data.draw(st.binary(max_size=16))))
    _decode_or_error([bytes(f) for f in frames])


@pytest.mark.parametrize(
    ("frames", "fragment"),
    [
        ([], "frames"),
        ([b"nope", V, b"cancel", b"\x80"], "magic"),
        ([codec.MAGIC, V, b"no_such_kind", b"\x80"], "unknown message kind"),
        ([codec.MAGIC, V, b"cancel", b"\xc1"], "cancel: MessagePack data is malformed"),
        (
            [codec.MAGIC, V, b"cancel", msgpack.packb({"group_id": 1})],
            "cancel: Object missing required field `attempt`",
        ),
        ([codec.MAGIC, V, b"cancel", msgpack.packb({"group_id": "x", "attempt": 1})], "cancel.group_id"),
        ([codec.MAGIC, V, b"heartbeat", msgpack.packb({"kv_use": 2.0})], "kv_use"),
        ([codec.MAGIC, V, b"cancel", msgpack.packb([1, 2])], "cancel: Expected `object`, got `array`"),
    ],
)
def test_decode_errors_name_the_problem(frames, fragment):
    with pytest.raises(codec.DecodeError, match=fragment):
        codec.decode(frames)


def test_array_frame_must_match_its_shape():
    frames = codec.encode(
        m.Generate(group_id=1, attempt=1, version=0, prompt_ids=i32(1, 2, 3), n_samples=1, max_tokens=4)
    )
    with pytest.raises(codec.DecodeError, match="needs 12 bytes"):
        codec.decode([*frames[:4], b"\x00" * 8])
    with pytest.raises(codec.DecodeError, match="not referenced"):
        codec.decode([*frames, b"extra"])


def test_arrays_are_zero_copy_views_of_the_received_frames():
    msg = canonical()["samples_finished"]
    frames = [bytearray(bytes(f)) for f in codec.encode(msg)]
    back = codec.decode([memoryview(f) for f in frames])
    assert not back.token_ids.flags.writeable
    frames[4][:4] = struct.pack("<i", 4242)  # token_ids is the first array frame
    assert back.token_ids[0] == 4242, "decoded array does not share the frame's memory"


def test_zero_copy_through_real_zeromq_frames(tmp_path):
    ctx = zmq.Context()
    try:
        a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
        a.setsockopt(zmq.LINGER, 0)
        b.setsockopt(zmq.LINGER, 0)
        a.bind(f"ipc://{tmp_path}/pair.sock")
        b.connect(f"ipc://{tmp_path}/pair.sock")
        big = np.arange(100_000, dtype=np.int32)
        msg = m.Generate(group_id=1, attempt=2, version=0, prompt_ids=big, n_samples=4, max_tokens=8)
        a.send_multipart(codec.encode(msg), copy=False)
        assert b.poll(5000)
        frames = b.recv_multipart(copy=False)
        back = codec.decode(frames)
        assert np.shares_memory(back.prompt_ids, np.frombuffer(frames[4].buffer, dtype=np.uint8))
        assert np.array_equal(back.prompt_ids, big)
    finally:
        ctx.destroy(linger=0)


def test_version_mismatch_is_its_own_error_and_gets_a_clear_reject():
    frames = codec.encode(canonical()["hello"])
    frames[1] = struct.pack(">H", m.WIRE_VERSION + 1)
    with pytest.raises(codec.WireVersionMismatch) as err:
        codec.decode(frames)
    assert err.value.peer_version == m.WIRE_VERSION + 1 and err.value.kind == "hello"
    old = m.Hello(wire_version=m.WIRE_VERSION + 1, role=m.Role.ROLLOUT, peer_id="w", pid=1, host="h", slots=8)
    reject = m.check_hello(old)
    assert isinstance(reject, m.Reject) and reject.wire_version == m.WIRE_VERSION
    assert f"peer speaks {m.WIRE_VERSION + 1}" in reject.reason
    assert m.check_hello(canonical()["hello"]) is None
    no_slots = m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id="w", pid=1, host="h")
    assert "slots" in m.check_hello(no_slots).reason


def test_encode_refuses_what_cannot_travel_and_the_receiver_refuses_a_field_of_the_wrong_type():
    with pytest.raises(codec.EncodeError):
        codec.encode(object())
    with pytest.raises(codec.EncodeError, match="object cannot travel"):
        codec.encode(m.StatusReply(snapshot={"x": object()}))
    with pytest.raises(codec.EncodeError, match="dtype complex64 cannot travel"):
        codec.encode(m.Generate(group_id=1, attempt=1, version=0, prompt_ids=np.zeros(2, np.complex64), n_samples=1,
                                max_tokens=1))  # fmt: skip
    with pytest.raises(codec.DecodeError, match=r"Expected `int`, got `str` - at `cancel\.group_id`"):
        codec.decode(codec.encode(m.Cancel(group_id="x", attempt=1)))
    lists = m.Generate(group_id=1, attempt=1, version=0, prompt_ids=[1, 2], n_samples=1, max_tokens=1)
    with pytest.raises(codec.DecodeError, match=r"expected an array reference - at `generate\.prompt_ids`"):
        codec.decode(codec.encode(lists))


def test_message_validation_rejects_nan_rewards_and_mismatched_logprobs():
    with pytest.raises(ValueError, match="reward"):
        m.SampleHeader(group_id=1, attempt=1, index=0, segments=(), reward=float("inf"), finish=m.Finish.STOP,
                       offset=0, tokens=0, checksum=0)  # fmt: skip
    with pytest.raises(ValueError, match="reward"):
        FinishedSample(
            group_id=1,
            attempt=1,
            index=0,
            segments=np.zeros((1, 2), np.int32),
            token_ids=i32(1),
            logprobs=np.zeros(1, np.float32),
            reward=float("nan"),
            finish=m.Finish.STOP,
        )
    with pytest.raises(ValueError, match="differ"):
        FinishedSample(
            group_id=1,
            attempt=1,
            index=0,
            segments=np.zeros((1, 2), np.int32),
            token_ids=i32(1, 2),
            logprobs=np.zeros(1, np.float32),
            reward=0.0,
            finish=m.Finish.STOP,
        )


def write_golden() -> None:
    GOLDEN.parent.mkdir(exist_ok=True)
    data = {kind: [bytes(f).hex() for f in codec.encode(msg)] for kind, msg in sorted(canonical().items())}
    GOLDEN.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {GOLDEN}")


if __name__ == "__main__":  # python -m tests.unit.test_wire --write-golden (only when the format changes on purpose)
    if sys.argv[1:] == ["--write-golden"]:
        write_golden()


@pytest.mark.parametrize(
    ("frames", "fragment"),
    [
        ([codec.MAGIC, struct.pack(">H", m.WIRE_VERSION), b"goodbye", msgpack.packb({"reason": "x"}),
          *[b""] * (codec.MAX_ARRAY_FRAMES + 1)], "frames"),
        ([codec.MAGIC, struct.pack(">H", m.WIRE_VERSION), b"goodbye", b"\x90" * (codec.MAX_BODY_BYTES + 1)], "body"),
        ([codec.MAGIC, struct.pack(">H", m.WIRE_VERSION), b"goodbye", b"\x81\xa6reason\xdd\xff\xff\xff\xff"],
         "got `array` - at `goodbye.reason`"),
        ([codec.MAGIC, struct.pack(">H", m.WIRE_VERSION), b"goodbye", b"\x81\xa6reason\xdb\xff\xff\xff\xffab"],
         "truncated"),
    ],
    ids=["too-many-frames", "huge-body", "array-length-bomb", "string-length-bomb"],
)  # fmt: skip
def test_size_caps_refuse_oversized_input_before_any_big_allocation(frames, fragment):
    with pytest.raises(codec.DecodeError, match=fragment):
        codec.decode(frames)
