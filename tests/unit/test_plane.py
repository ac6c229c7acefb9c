"""The weights' data plane over real ZeroMQ on 127.0.0.1: a version fetched chunk by chunk from a chunk server into
another store under the same digest, every chunk checked; a source serving a corrupted chunk, a silent one, or a
relay stopped mid-transfer is left for the next source (the learner, last) and the version still arrives whole;
workers of one node share one fetch; the relay tree reaches the learner from every node, with no cycle."""

from __future__ import annotations

import pathlib
import shutil
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from structlog.testing import capture_logs

from dora.store import WeightStore, load_verified
from dora.store.dirs import temp_name
from dora.store.fetch import FetchFailed, fetch, relay_server, retire_local
from dora.store.plane import PROGRESS, ChunkServer
from dora.store.relays import RelayTree, node_relays, relay_sources

MIB = 1 << 20
LOCAL = "tcp://127.0.0.1:0"


def published(root: pathlib.Path, version: int = 1, mib: int = 6) -> tuple[WeightStore, str, dict[str, torch.Tensor]]:
    """A version of ``mib`` MiB in chunks of 1 MiB (several chunks, two files with the config) and its digest."""
    g = torch.Generator().manual_seed(version)
    tensors = {"a": torch.randn(mib * MIB // 8, generator=g), "b": torch.randn(mib * MIB // 8, generator=g)}
    store = WeightStore(root, chunk_bytes=MIB, fsync=False)
    _, digest, _ = store.publish(version, tensors, beside={"config.json": b'{"model_type": "test"}'})
    return store, digest, tensors


def test_a_version_is_fetched_whole_under_its_digest_and_loads_as_published(tmp_path):
    store, digest, tensors = published(tmp_path / "learner")
    with ChunkServer(store.root, LOCAL) as server, capture_logs() as logs:
        got = fetch(1, digest, [server.endpoint], tmp_path / "node", timeout_s=5)
    assert got.path == tmp_path / "node" / "v1" and got.bytes == store.manifest(1).bytes
    assert got.served == {server.endpoint: got.bytes} and server.sent_bytes == got.bytes
    assert str(WeightStore(tmp_path / "node").manifest(1).digest) == digest
    back = load_verified(got.path, digest, name="v1")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    assert sorted(p.name for p in (tmp_path / "node").iterdir()) == [".fetch.lock", "v1"]  # no temp dir left
    done = [e for e in logs if e["event"] == "weights_fetched"]
    assert done and done[0]["source"] == server.endpoint and done[0]["gb_s"] > 0
    again = fetch(1, digest, [server.endpoint], tmp_path / "node")  # held already: nothing sent
    assert again.served == {} and server.sent_bytes == got.bytes
    assert retire_local(tmp_path / "node", 1) and not got.path.exists()


def test_a_corrupted_chunk_is_refused_and_fetched_from_the_next_source(tmp_path):
    store, digest, tensors = published(tmp_path / "learner")
    bad = tmp_path / "bad"
    shutil.copytree(store.root, bad)
    with open(bad / "v1" / "model.safetensors", "r+b") as f:  # one bit of chunk 3 flipped
        f.seek(3 * MIB + 17)
        byte = f.read(1)
        f.seek(3 * MIB + 17)
        f.write(bytes([byte[0] ^ 1]))
    with ChunkServer(bad, LOCAL) as corrupt, ChunkServer(store.root, LOCAL) as learner, capture_logs() as logs:
        got = fetch(1, digest, [corrupt.endpoint, learner.endpoint], tmp_path / "node", timeout_s=5)
    assert set(got.served) == {corrupt.endpoint, learner.endpoint}, got.served
    failed = [e for e in logs if e["event"] == "weights_source_failed"]
    assert failed[0]["source"] == corrupt.endpoint and "differs from the manifest" in failed[0]["reason"]
    back = load_verified(got.path, digest, name="v1")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_a_silent_source_is_left_after_its_timeout_and_no_source_at_all_fails_clearly(tmp_path):
    store, digest, _ = published(tmp_path / "learner", mib=2)
    with ChunkServer(store.root, LOCAL) as learner:
        started = time.monotonic()
        got = fetch(1, digest, ["tcp://127.0.0.1:9", learner.endpoint], tmp_path / "node", timeout_s=0.3)
        assert got.served == {learner.endpoint: got.bytes} and time.monotonic() - started < 3
        with pytest.raises(FetchFailed, match="no source served its manifest"):
            fetch(2, digest, [learner.endpoint], tmp_path / "other", timeout_s=0.3)  # it holds no v2
    assert not [p for p in (tmp_path / "other").iterdir() if p.name.endswith(".tmp")]


def test_a_relay_stopped_mid_transfer_leaves_its_child_to_fetch_the_rest_from_the_learner(tmp_path):
    """learner -> A -> B: A holds the first half of v1 (fetching it; a chunk is served once its progress byte is
    set); B takes what A has, A's server is stopped meanwhile, and B fetches the rest from the learner."""
    store, digest, tensors = published(tmp_path / "learner", mib=8)
    a_root = tmp_path / "a"
    part = a_root / temp_name("v1")
    shutil.copytree(store.path(1), part)
    size = (part / "model.safetensors").stat().st_size
    chunks = -(-size // MIB)
    progress = bytearray(chunks + 1)  # config.json (one chunk) first, then the weights
    progress[: 1 + chunks // 2] = b"\x01" * (1 + chunks // 2)
    (part / PROGRESS).write_bytes(bytes(progress))
    a = ChunkServer(a_root, LOCAL)
    a.start()
    b_root = tmp_path / "b"

    def stop_a_once_b_has_some() -> None:
        deadline = time.monotonic() + 10
        while a.chunks_sent < chunks // 4 and time.monotonic() < deadline:
            time.sleep(0.002)
        a.stop()

    killer = threading.Thread(target=stop_a_once_b_has_some)
    killer.start()
    with ChunkServer(store.root, LOCAL) as learner, capture_logs() as logs:
        got = fetch(1, digest, [a.endpoint, learner.endpoint], b_root, timeout_s=0.5, window=2)
    killer.join()
    assert got.served.get(a.endpoint) and got.served.get(learner.endpoint), got.served
    assert sum(got.served.values()) == got.bytes
    assert [e["source"] for e in logs if e["event"] == "weights_source_failed"] == [a.endpoint]
    back = load_verified(got.path, digest, name="v1")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)


def test_a_relay_asked_for_a_version_it_lacks_fetches_it_from_above_and_passes_it_on_as_it_comes(tmp_path):
    """learner -> A -> B, A never assigned the version: B's request makes A fetch it from the learner, and B takes
    every chunk from A; the learner sends each byte once."""
    store, digest, tensors = published(tmp_path / "learner", mib=8)
    with ChunkServer(store.root, LOCAL) as learner, relay_server(tmp_path / "a", LOCAL, timeout_s=5) as a:
        got = fetch(1, digest, [a.endpoint, learner.endpoint], tmp_path / "b", timeout_s=5)
        deadline = time.monotonic() + 5
        while not (tmp_path / "a" / "v1").is_dir() and time.monotonic() < deadline:
            time.sleep(0.01)
    assert got.served == {a.endpoint: got.bytes}, got.served
    assert learner.sent_bytes == got.bytes and (tmp_path / "a" / "v1").is_dir()
    back = load_verified(got.path, digest, name="v1")
    assert all(torch.equal(back[k], tensors[k]) for k in tensors)
    # the learner's server fetches nothing: it holds a version or not
    with ChunkServer(tmp_path / "empty", LOCAL) as plain, pytest.raises(FetchFailed, match="does not hold v1"):
        fetch(1, digest, [plain.endpoint], tmp_path / "c", timeout_s=1)


def test_workers_of_one_node_share_one_fetch_into_its_store(tmp_path):
    store, digest, _ = published(tmp_path / "learner", mib=4)
    with ChunkServer(store.root, LOCAL) as learner:
        got: list = []
        workers = [threading.Thread(target=lambda: got.append(fetch(1, digest, [learner.endpoint], tmp_path / "node")))
                   for _ in range(3)]  # fmt: skip
        for w in workers:
            w.start()
        for w in workers:
            w.join(20)
        assert len(got) == 3 and {g.path for g in got} == {tmp_path / "node" / "v1"}
        assert sorted(bool(g.served) for g in got) == [False, False, True]  # one fetched, two found it there
        assert learner.sent_bytes == store.manifest(1).bytes


def test_a_worker_on_the_learners_node_maps_the_version_the_learner_wrote_and_nothing_is_sent(tmp_path):
    """On the learner's node rollout.store is the learner's store: the version is there once the broker names it
    (it hears of a version only once it is durable), so no source is asked (an unreachable one here) and the engine
    maps the very files the learner wrote, from the page cache the two processes share."""
    store, digest, tensors = published(tmp_path / "learner")
    with capture_logs() as logs:
        got = fetch(1, digest, ["tcp://127.0.0.1:9"], store.root, timeout_s=0.5)
    assert got.bytes == 0 and got.path == store.path(1)
    assert [e["event"] for e in logs] == ["weights_local"]
    loaded = load_verified(got.path, digest, name="v1")
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert store.versions() == [1], "the lock file beside the versions is not a version"


@given(nodes=st.integers(0, 40), fanout=st.integers(0, 5))
def test_the_relay_tree_reaches_the_learner_from_every_node_without_a_cycle(nodes, fanout):
    order = [f"tcp://n{i}:1" for i in range(nodes)]
    learner = ("tcp://learner:1",)
    sources = relay_sources(order, learner, fanout)
    assert set(sources) == set(order)
    direct = [n for n, s in sources.items() if s == learner]
    assert len(direct) <= max(fanout, 0) or fanout < 1
    children: dict[str, int] = {}
    for node, s in sources.items():
        assert s[-1] == learner[0] and len(s) <= 2
        if len(s) == 2:
            children[s[0]] = children.get(s[0], 0) + 1
        seen, at = {node}, node
        while sources[at] != learner:  # up the tree: every node reaches the learner, never itself again
            at = sources[at][0]
            assert at not in seen
            seen.add(at)
    assert all(n <= fanout for n in children.values())


def test_four_nodes_at_fanout_two_make_the_learner_send_each_byte_twice_and_a_chain_at_fanout_one():
    order = ["a", "b", "c", "d"]
    assert relay_sources(order, ["L"], 2) == {"a": ("L",), "b": ("L",), "c": ("a", "L"), "d": ("a", "L")}
    assert relay_sources(order, ["L"], 1) == {"a": ("L",), "b": ("a", "L"), "c": ("b", "L"), "d": ("c", "L")}
    assert relay_sources(order, ["L"], 0) == dict.fromkeys(order, ("L",))
    workers = [("h2", "w3", "tcp://h2:7"), ("h1", "w2", ""), ("h1", "w1", "tcp://h1:5"), ("h1", "w0", "tcp://h1:4")]
    assert node_relays(workers) == {"h1": "tcp://h1:4", "h2": "tcp://h2:7"}


def test_the_brokers_tree_names_a_workers_node_relay_and_is_made_again_when_workers_change():
    workers = [("h1", "w0", "tcp://h1:1"), ("h1", "w1", "tcp://h1:2"), ("h2", "w2", "tcp://h2:1"),
               ("h3", "w3", "tcp://h3:1"), ("h4", "w4", "")]  # fmt: skip
    tree = RelayTree(fanout=1)
    learner = ("tcp://learner:1",)
    assert tree.sources("h1", learner, lambda: workers) == learner
    assert tree.sources("h3", learner, lambda: workers) == ("tcp://h2:1", *learner)  # a chain: h1, h2, h3
    assert tree.sources("h4", learner, lambda: workers) == learner  # no relay on its node
    assert tree.sources("h3", (), lambda: workers) == ()  # the learner serves no data plane: nothing to fetch from
    del workers[2]
    assert tree.sources("h3", learner, lambda: workers) == ("tcp://h2:1", *learner)  # not told: as it was
    tree.changed()
    assert tree.sources("h3", learner, lambda: workers) == ("tcp://h1:1", *learner)
