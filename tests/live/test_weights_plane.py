"""A live run with no shared weight store: each torch worker has its own rollout.store, fetches every version it
is assigned over the data plane (the learner's chunk server, or the other node's relay) and loads it from there;
no worker ever names a path in the learner's store; the versions the broker retires leave the workers' stores."""

from __future__ import annotations

import pathlib

import pytest

from tests.live.cluster import cluster
from tests.live.test_model_run import torch_run

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]


def test_workers_with_their_own_stores_fetch_every_version_over_the_data_plane(tmp_path, tiny_model):
    steps = 4
    learner_store = tmp_path / "store"
    overrides = torch_run(tmp_path, tiny_model, steps, min_workers=2, max_tokens=12,
                          rollout={"fetch_timeout_s": 5.0})  # fmt: skip
    own = {w: tmp_path / f"node-{w}" for w in ("w0", "w1")}
    with cluster(tmp_path, overrides, fork=True) as c:
        c.start_broker()
        for w, root in own.items():
            c.start_worker(w, "torch", "--model", str(tiny_model), "--set", f"rollout.store={root}")
        c.spawn("learner", "learner", "--trainer", "torch", "--broker", str(tmp_path / "broker.json"))
        assert c.wait("learner", 200) == 0, c.log("learner")[-3000:]
        assert c.wait("broker", 15) == 0, c.log("broker")[-3000:]
        c.check_exactly_once()
        learner_plane = c.events("learner", "chunk_server_started")[0]["endpoint"]
        assert pathlib.Path(c.events("learner", "chunk_server_started")[0]["root"]) == learner_store
        fetched = set()
        for w, root in own.items():
            events = [e for e in c.events(w) if e["event"] != "config_resolved"]
            assert not [e for e in events if str(learner_store) in str(e)], f"{w} named the learner's store"
            got = [e for e in events if e["event"] == "weights_fetched"]
            assert got and all(e["path"].startswith(str(root)) and e["bytes"] > 0 for e in got), got
            assert all(set(e["served"]) <= {learner_plane, *relays(c)} for e in got), got
            fetched |= {e["version"] for e in got}
            loaded = [e for e in events if e["event"] == "weights_loaded" and e["uri"].startswith("file://")]
            assert loaded and all(e["uri"].startswith(f"file://{root}/v") for e in loaded), loaded
            assert not [e for e in events if e.get("level") == "error"], [e for e in events if e.get("level")]
        assert fetched >= {1, 2}, fetched  # every version a worker served came over the data plane
        dropped = [(w, e["version"]) for w in own for e in c.events(w, "weights_retired_local")]
        assert dropped and all(not (own[w] / f"v{v}").exists() for w, v in dropped), dropped  # retired: gone


def relays(c) -> set[str]:
    return {e["endpoint"] for w in ("w0", "w1") for e in c.events(w, "chunk_server_started")}
