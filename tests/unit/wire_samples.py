"""Canonical wire messages (one per kind) and hypothesis strategies for every message type."""

from __future__ import annotations

import dataclasses
import sys
import typing
from typing import Any

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dora.ids import Finish
from dora.samples import Batch, FinishedSample, TrainGroup, TrainSample
from dora.wire import messages as m
from dora.wire import packed
from dora.wire.codec import DTYPES


def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls, vars(sys.modules[cls.__module__]))


def _unwrap(tp: Any) -> Any:
    while hasattr(tp, "__supertype__"):  # NewType
        tp = tp.__supertype__
    return tp


def i32(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def f32(*values: float) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def canonical() -> dict[str, Any]:
    """One fixed instance of every message kind; their encodings are the golden bytes."""
    req = m.RequestState(
        index=1,
        token_ids=i32(11, 12),
        logprobs=f32(-0.5, -1.25),
        rng_state=b"\x01\x02",
        kv=(np.arange(4, dtype=np.float16).reshape(2, 2),),
    )
    sample = TrainSample(
        index=0, token_ids=i32(5, 6, 7), logprobs=f32(-1.0, -2.0, -0.25), reward=1.0, finish=Finish.STOP
    )
    msgs = [
        m.Hello(
            wire_version=m.WIRE_VERSION,
            role=m.Role.ROLLOUT,
            peer_id="rollout-0",
            pid=4242,
            host="node01",
            slurm_job_id="9001",
            slots=64,
            engine="torch",
            weights_endpoint="tcp://10.0.0.1:41000",
        ),
        m.Reject(reason="wire version mismatch", wire_version=m.WIRE_VERSION),
        m.Welcome(broker_epoch=77, heartbeat_interval_s=0.5, liveness=4, newest_version=3),
        m.Heartbeat(
            tokens_generated=1000,
            running=3,
            kv_use=0.25,
            seen=9,
            holding=np.array([[12, 5], [13, 6]], dtype=np.int64),
            version=3,
            loading=4,
        ),
        m.Goodbye(reason="sigterm"),
        m.Disconnect(reason="expired"),
        m.Generate(
            group_id=12,
            attempt=5,
            version=3,
            prompt_ids=i32(1, 2, 3),
            n_samples=4,
            max_tokens=256,
            temperature=0.7,
            top_p=0.9,
            seed=123,
            broker_epoch=77,
            seq=3,
        ),
        packed.pack_samples(
            [
                FinishedSample(
                    group_id=12,
                    attempt=5,
                    index=0,
                    segments=np.array([[3, 1]], dtype=np.int32),
                    token_ids=i32(4),
                    logprobs=f32(-0.25),
                    reward=1.0,
                    finish=Finish.STOP,
                    broker_epoch=77,
                    reward_components={"correct": 1.0, "format": 0.5},
                ),
                FinishedSample(
                    group_id=13,
                    attempt=6,
                    index=1,
                    segments=np.array([[3, 2]], dtype=np.int32),
                    token_ids=i32(5, 6),
                    logprobs=f32(-0.5, -1.0),
                    reward=0.0,
                    finish=Finish.LENGTH,
                    gen_time_s=1.5,
                    broker_epoch=77,
                    reward_error="reward raised ValueError: no answer",
                    loss_mask=np.array([1, 0], dtype=np.uint8),
                    turns=np.array([[0, 1, 3]], dtype=np.int32),
                ),
            ]
        ),
        m.ResultAcks(
            acks=(
                m.ResultAck(group_id=12, attempt=5, index=0, accepted=True),
                m.ResultAck(group_id=13, attempt=6, index=1, accepted=False, reason="stale_attempt"),
            )
        ),
        m.Assign(version=4, uri="file:///weights/v4", sha256="ab" * 32, interrupt=False, seq=2,
                 sources=("tcp://node1:5601",), inline={"adapter_config.json": b"{}"}),
        m.WeightsLoaded(version=4, load_s=0.125),
        m.Yield(seq=5),
        m.Yielded(),
        m.Resume(version=4, seq=6),
        m.MigrateOut(group_id=12, attempt=5, version=3, target="rollout-1", seq=4),
        m.MigrationExported(group_id=12, attempt=5, requests=(req,)),
        m.MigrateIn(
            group_id=12,
            attempt=5,
            version=3,
            source="rollout-0",
            prompt_ids=i32(1, 2, 3),
            requests=(req,),
            max_tokens=256,
            temperature=0.7,
            top_p=0.9,
            seed=123,
            seq=5,
        ),
        m.Cancel(group_id=12, attempt=5, seq=6),
        m.RetireVersion(version=1),
        m.Evaluate(
            version=3, round=2, row=17, prompt_ids=i32(4, 5, 6), n_samples=2, max_tokens=16, temperature=0.7, seed=9
        ),
        m.EvalFinished(version=3, round=2, row=17, rewards=f32(1.0, 0.0), lengths=i32(5, 16), failed=1),
        m.RequestBatch(step=3),
        packed.pack_batch(
            Batch(step=3, groups=(TrainGroup(group_id=12, version=3, prompt_ids=i32(1, 2), samples=(sample,)),))
        ),
        m.WeightsPublished(
            version=4,
            uri="file:///weights/v4",
            sha256="cd" * 32,
            publish_s=0.25,
            metrics={"reward_mean": 0.5, "loss": -0.125},
            sources=("tcp://node1:5601",),
            inline={"adapter_config.json": b"{}"},
        ),
        m.PublishAck(version=4),
        m.StatusRequest(),
        m.StatusReply(snapshot={"step": 3, "versions": [2, 3], "workers": {"rollout-0": {"version": 3}}}),
    ]
    return {type(x).KIND: x for x in msgs}


def same(a: Any, b: Any) -> bool:
    """Deep equality where arrays compare by dtype, shape and content."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.array_equal(a, b, equal_nan=a.dtype.kind == "f")
        )
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, tuple | list):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and a != a:
        return isinstance(b, float) and b != b
    return type(a) is type(b) and a == b


# ---------------------------------------------------------------- strategies

_json = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**63 - 1) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=8,
)


def _array(dtype: str | None = None, shape: Any = None) -> st.SearchStrategy[np.ndarray]:
    dtypes = st.sampled_from(sorted(DTYPES)) if dtype is None else st.just(dtype)
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4) if shape is None else shape
    return dtypes.flatmap(lambda d: hnp.arrays(np.dtype(d), shapes))


def for_type(tp: Any) -> st.SearchStrategy[Any]:
    tp = _unwrap(tp)
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return _json
    if origin is not None and type(None) in args:
        return st.none() | for_type(next(a for a in args if a is not type(None)))
    if origin is not None and m.UnsetType in args:  # a field left out of the encoding while unset
        return st.just(m.UNSET) | for_type(next(a for a in args if a is not m.UnsetType))
    if tp is np.ndarray:
        return _array()
    if origin is tuple:
        return st.lists(for_type(args[0]), max_size=3).map(tuple)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), for_type(args[1]), max_size=3)
    if dataclasses.is_dataclass(tp):
        return for_message(tp)
    if isinstance(tp, type) and issubclass(tp, (m.Role, Finish)):
        return st.sampled_from(list(tp))
    return {
        int: st.integers(-(2**63), 2**63 - 1),
        float: st.floats(allow_nan=False, allow_infinity=False),
        str: st.text(max_size=12),
        bytes: st.binary(max_size=12),
        bool: st.booleans(),
    }[tp]


_turns = _array("<i4", st.integers(0, 3).map(lambda k: (k, 3)))


def for_message(cls: type) -> st.SearchStrategy[Any]:
    hints = _hints(cls)
    fields = {f.name: for_type(hints[f.name]) for f in dataclasses.fields(cls)}
    if cls is m.SamplesFinished:
        return st.lists(for_message(FinishedSample), min_size=1, max_size=4).map(packed.pack_samples)
    if cls is m.TrainBatch:
        return for_message(Batch).map(packed.pack_batch)
    if cls is FinishedSample:
        n = st.integers(0, 6)
        fields["index"] = st.integers(0, 64)
        fields["segments"] = _array("<i4", st.integers(1, 3).map(lambda k: (k, 2)))
        pair = n.flatmap(
            lambda k: st.tuples(
                _array("<i4", st.just((k,))), _array("<f4", st.just((k,))), st.none() | _array("|u1", st.just((k,)))
            )
        )
        fields["turns"] = st.none() | _turns
        return st.tuples(st.fixed_dictionaries(fields), pair).map(
            lambda t: cls(**{**t[0], "token_ids": t[1][0], "logprobs": t[1][1], "loss_mask": t[1][2]})
        )
    if cls is TrainSample:
        fields["index"] = st.integers(0, 64)
        fields["turns"] = st.none() | _turns
        fields["segments"] = st.none() | _array("<i4", st.integers(0, 3).map(lambda k: (k, 2)))
        arrays = st.integers(0, 6).flatmap(
            lambda k: st.tuples(
                _array("<i4", st.just((k,))), _array("<f4", st.just((k,))), st.none() | _array("|u1", st.just((k,)))
            )
        )
        return st.tuples(st.fixed_dictionaries(fields), arrays).map(
            lambda t: cls(**{**t[0], "token_ids": t[1][0], "logprobs": t[1][1], "loss_mask": t[1][2]})
        )
    if cls is TrainGroup:
        fields["prompt_ids"] = _array("<i4", st.integers(0, 4).map(lambda k: (k,)))
    if cls is m.Heartbeat:
        fields.update(
            tokens_generated=st.integers(0, 2**40),
            running=st.integers(0, 4096),
            kv_use=st.floats(0, 1),
            seen=st.integers(0, 2**40),
            holding=st.none() | _array("<i8", st.integers(0, 4).map(lambda k: (k, 2))),
            counters=st.just(m.UNSET) | st.dictionaries(st.text(max_size=24), st.floats(0, 1e12), max_size=4),
        )
    return st.fixed_dictionaries(fields).map(lambda kw: cls(**kw))


any_message = st.one_of([for_message(cls) for cls in m.MESSAGES])
