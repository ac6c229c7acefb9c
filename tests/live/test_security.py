"""CURVE on every connection: a run with keys, a key that is not allowed, a key used for the wrong role,
plaintext and unknown-key clients whose frames never get through."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import sys
import time

import pytest
import zmq

from dora.actor.security import Keys
from dora.ops.status import fetch
from dora.wire import codec
from dora.wire import messages as m
from tests.live.cluster import cluster

pytestmark = pytest.mark.timeout(120)


def keys(path) -> str:
    r = subprocess.run([sys.executable, "-m", "dora", "keys", "generate", str(path)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return str(path)


def test_keys_are_generated_once_and_never_overwritten(tmp_path):
    keys(tmp_path / "k")
    names = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert names == sorted(f"{n}.key{s}" for n in ("broker", "rollout", "learner", "client") for s in ("", "_secret"))
    assert ((tmp_path / "k" / "broker.key_secret").stat().st_mode & 0o777) == 0o600
    again = subprocess.run([sys.executable, "-m", "dora", "keys", "generate", str(tmp_path / "k")],
                           capture_output=True, text=True)  # fmt: skip
    assert again.returncode == 2 and "not overwriting" in again.stderr and "Traceback" not in again.stderr


def test_a_run_with_curve_keys_keeps_every_invariant_and_status_needs_a_key(tmp_path):
    k = keys(tmp_path / "k")
    with cluster(tmp_path, {"core": {"total_steps": 6, "min_workers": 2}, "security": {"keys": k}}) as c:
        c.start(workers=2)
        assert fetch(c.endpoint, keys_dir=k)["mode"] == "dora"
        with pytest.raises(TimeoutError):  # without a key the broker never answers
            fetch(c.endpoint, timeout_s=1.0)
        assert c.wait("learner", 90) == 0, c.log("learner")[-3000:]
        assert c.wait("broker", 15) == 0
        c.check_exactly_once()
        [on] = c.events("broker", "curve_on")
        assert on["allowed"] == 3


def test_a_learner_whose_key_is_not_allowed_stops_with_a_clear_error(tmp_path):
    k = keys(tmp_path / "k")
    stranger = keys(tmp_path / "stranger")
    shutil.copy(tmp_path / "k" / "broker.key", tmp_path / "stranger" / "broker.key")  # right broker, unknown key
    with cluster(tmp_path, {"security": {"keys": k, "auth_timeout_s": 2.0}}) as c:
        c.start_broker()
        c.cfg["security"]["keys"] = stranger
        c.config.write_text(c.config.read_text().replace(k, stranger))
        c.start_learner()
        assert c.wait("learner", 30) == 1
        [err] = c.events("learner", "broker_never_answered")
        assert "allow-list" in err["hint"]
        assert not c.events("broker", "peer_joined")  # it never got past the handshake


def test_a_key_may_only_act_as_its_role(tmp_path):
    k = keys(tmp_path / "k")
    shutil.copytree(tmp_path / "k", tmp_path / "mine")  # the learner's copy, where its keypair is a worker's
    for suffix in ("", "_secret"):
        (tmp_path / "mine" / f"rollout.key{suffix}").rename(tmp_path / "mine" / f"learner.key{suffix}")
    with cluster(tmp_path, {"security": {"keys": k}}) as c:
        c.start_broker()
        c.config.write_text(c.config.read_text().replace(k, str(tmp_path / "mine")))
        c.start_learner()
        assert c.wait("learner", 30) == 1
        [turned] = c.events("learner", "learner_turned_away")
        assert "may connect as rollout, not as learner" in turned["reason"]


def test_plaintext_and_unknown_key_clients_get_nothing_through_and_their_handshakes_are_counted(tmp_path):
    """T14: 500 frames from a plaintext client and 500 from a client whose key is not on the allow-list:
    none reaches the broker (no peer, no bad frame counted), and the refused handshakes are counted."""
    k = keys(tmp_path / "k")
    stranger = keys(tmp_path / "stranger")
    shutil.copy(tmp_path / "k" / "broker.key", tmp_path / "stranger" / "broker.key")
    with cluster(tmp_path, {"security": {"keys": k}}) as c:
        c.start_broker()
        ctx = zmq.Context()
        try:
            plain = ctx.socket(zmq.DEALER)
            unknown = ctx.socket(zmq.DEALER)
            Keys.load(stranger).connect_as(unknown, "learner")
            hello = codec.encode(m.Hello(wire_version=m.WIRE_VERSION, role=m.Role.LEARNER, peer_id="intruder",
                                         pid=1, host="elsewhere"))  # fmt: skip
            for sock in (plain, unknown):
                sock.setsockopt(zmq.LINGER, 0)
                sock.setsockopt(zmq.SNDHWM, 1000)
                sock.connect(c.endpoint)
                for i in range(500):
                    with contextlib.suppress(zmq.Again):  # never connected: frames wait for a handshake
                        sock.send_multipart(hello if i % 2 == 0 else [b"\xc1"], flags=zmq.NOBLOCK)
            snap = wait_for_failures(c.endpoint, k)
        finally:
            ctx.destroy(linger=0)
        failed = {key: n for key, n in snap["counters"].items() if key.startswith("handshake failed")}
        assert sum(failed.values()) >= 2, snap["counters"]  # both clients, at least once each
        assert not snap["malformed"] and not snap["workers"] and not c.events("broker", "peer_joined")
        print(f"T14: 0 of 1,000 frames delivered; refused handshakes counted {failed}")


def wait_for_failures(endpoint: str, k: str) -> dict:
    deadline = time.monotonic() + 10
    while True:
        snap = fetch(endpoint, keys_dir=k)
        if sum(n for key, n in snap["counters"].items() if key.startswith("handshake failed")) >= 2:
            return snap
        if time.monotonic() > deadline:
            return snap
        time.sleep(0.2)
