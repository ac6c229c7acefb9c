"""10,000 bad frames at a live broker while a real run goes on: it stays up, counts each, the run completes."""

from __future__ import annotations

import os
import random
import signal
import struct
import time

import numpy as np
import pytest
import zmq

from dora.ids import Finish
from dora.ops.status import fetch
from dora.samples import FinishedSample
from dora.wire import codec, packed
from dora.wire import messages as m
from tests.live.cluster import cluster
from tests.live.test_faults import wait_until

pytestmark = pytest.mark.timeout(180)

RANDOM, TRUNCATED, WRONG_VERSION, WRONG_KIND, UNLEASED = 2500, 2500, 1000, 1500, 2500


def hello(name: str, slots: int) -> m.Hello:
    return m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.ROLLOUT, peer_id=name, pid=os.getpid(), host="fuzz",
                   slots=slots, engine="fuzz")  # fmt: skip


def sample(group: int, attempt: int, epoch: int) -> m.SamplesFinished:
    ids = np.arange(8, dtype=np.int32)
    return packed.pack_samples([
        FinishedSample(group_id=group, attempt=attempt, index=0, segments=np.array([[0, 8]], dtype=np.int32),
                       token_ids=ids, logprobs=np.zeros(8, np.float32), reward=1.0, finish=Finish.STOP,
                       broker_epoch=epoch)
    ])  # fmt: skip


def drain(sock: zmq.Socket) -> list:
    out = []
    while True:
        try:
            out.append(codec.decode(sock.recv_multipart(zmq.NOBLOCK)))
        except zmq.Again:
            return out


def test_ten_thousand_bad_frames_during_a_run(tmp_path):
    rng = random.Random(7)
    with cluster(tmp_path, {"core": {"total_steps": 25}}) as c:
        c.start(workers=3)
        wait_until(lambda: fetch(c.endpoint)["step"] >= 1, 30, "step 1")
        # The learner is stopped through the flood: the run cannot end (and its broker exit) before every result
        # sent has had its answer, however fast the machine runs the steps.
        c.signal("learner", signal.SIGSTOP)
        before = fetch(c.endpoint)
        ctx = zmq.Context()
        try:
            stranger = ctx.socket(zmq.DEALER)  # never says hello
            peer = ctx.socket(zmq.DEALER)  # says hello as a rollout worker, then misbehaves
            peer.setsockopt(zmq.IDENTITY, b"rollout/fuzz/0")
            for s in (stranger, peer):
                s.setsockopt(zmq.LINGER, 0)
                s.connect(c.endpoint)
            stranger.send_multipart(codec.encode(hello("anonymous", slots=4)))  # no text identity: turned away
            peer.send_multipart(codec.encode(hello("fuzz", slots=4)))
            welcome = wait_until(lambda: next((x for x in drain(peer) if isinstance(x, m.Welcome)), None), 10, "hi")
            epoch = welcome.broker_epoch
            valid = [codec.encode(x) for x in (m.Heartbeat(tokens_generated=1, running=0, kv_use=0.0),
                                               sample(3, 1, epoch), m.RequestBatch(step=0))]  # fmt: skip
            replies = []
            last_beat = [time.monotonic()]

            def keep_alive() -> None:
                """Like a real worker, the peer says a heartbeat every 0.25 s (half the interval) whatever else it
                sends: however long the broker takes over the flood, it never hears silence from the peer."""
                if time.monotonic() - last_beat[0] >= 0.25:
                    peer.send_multipart(valid[0])
                    replies.extend(drain(peer))
                    last_beat[0] = time.monotonic()

            def to_peer(frames: list[bytes]) -> None:
                keep_alive()
                peer.send_multipart(frames)

            for i in range(RANDOM):  # random bytes, 1-4 frames, sometimes starting like a real envelope
                frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(1, 4))]
                if i % 3 == 0:
                    frames[0] = codec.MAGIC
                stranger.send_multipart(frames) if i % 2 else to_peer(frames)
            for i in range(TRUNCATED):  # a valid message cut short: frames dropped or the body halved
                frames = [bytes(f) for f in valid[i % len(valid)]]
                if i % 2:
                    frames = frames[: rng.randint(1, 3)]
                else:
                    frames[3] = frames[3][: len(frames[3]) // 2]
                to_peer(frames)
            for i in range(WRONG_VERSION):
                frames = [bytes(f) for f in valid[i % len(valid)]]
                frames[1] = struct.pack(">H", m.WIRE_VERSION + 1 + i % 50)
                stranger.send_multipart(frames)
                keep_alive()
            wrong_kind = [m.RequestBatch(step=0), m.TrainBatch(step=0, groups=(), prompt_ids=np.zeros(0, np.int32)),
                          m.WeightsPublished(version=99, uri="x", sha256="0" * 64)]  # fmt: skip
            for i in range(WRONG_KIND):  # well-formed, but not something a rollout worker may say
                to_peer(codec.encode(wrong_kind[i % len(wrong_kind)]))
            for _ in range(UNLEASED):  # results for groups it never held (some in flight elsewhere)
                to_peer(codec.encode(sample(rng.randrange(0, 400), rng.randint(0, 6), epoch)))

            def all_acks():  # cheap, so the peer's heartbeats keep their pace (reading the broker's log is not)
                keep_alive()
                replies.extend(drain(peer))
                return sum(len(x.acks) for x in replies if isinstance(x, m.ResultAcks)) >= UNLEASED

            wait_until(all_acks, 30, "an answer to every result")
            lost = [r for r in c.events("broker", "peer_lost") if r.get("peer") == "fuzz"]
            assert not lost, f"the broker took the fuzzing peer for lost: {lost}"
            peer.send_multipart(codec.encode(m.Goodbye(reason="fuzz done")))
            after = fetch(c.endpoint)
        finally:
            ctx.destroy(linger=0)
            c.signal("learner", signal.SIGCONT)

        acks = [a for x in replies if isinstance(x, m.ResultAcks) for a in x.acks]
        assert len(acks) == UNLEASED and not any(a.accepted for a in acks)
        delta = {k: after["malformed"].get(k, 0) - before["malformed"].get(k, 0) for k in after["malformed"]}
        assert delta.get("decode", 0) == RANDOM + TRUNCATED, delta
        assert delta.get("wire_version", 0) == WRONG_VERSION, delta
        assert delta.get("bad identity", 0) == 1, delta
        assert sum(n for k, n in delta.items() if k.startswith("unexpected")) == WRONG_KIND, delta
        refused = sum(n - before["counters"].get(k, 0) for k, n in after["counters"].items() if k.startswith("refused"))
        assert refused >= UNLEASED, after["counters"]

        assert c.wait("learner", 120) == 0, c.log("learner")[-3000:]  # the run completes
        assert c.wait("broker", 15) == 0
        c.check_exactly_once()
