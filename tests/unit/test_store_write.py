"""A version's files are written from the tensors' memory (dora.store.writer) and a learner's state is copied into
one reused host buffer laid out as those files (dora.store.snapshot): the files are safetensors files that
safetensors itself reads back equal, their chunk digests are what hashing the files finds, a writer that fails
leaves nothing behind, and the snapshot's buffer is made once and reused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors import safe_open

from dora.store import WeightStore, load_into, load_verified
from dora.store.digest import digest_file
from dora.store.snapshot import HostSnapshot
from dora.store.writer import plan, spans

MIB = 1 << 20


def every_dtype() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "big.bf16": torch.randn(700, 1000, generator=g).bfloat16(),  # ~1.4 MB: the file spans chunks of 1 MiB
        "f32": torch.randn(3, 5, generator=g),
        "f16": torch.randn(7, generator=g).half(),
        "f64": torch.randn(2, 2, generator=g).double(),
        "i64": torch.arange(-5, 6),
        "i32": torch.arange(9, dtype=torch.int32),
        "u8": torch.arange(255, dtype=torch.uint8),
        "i8": torch.arange(-3, 4, dtype=torch.int8),
        "mask": torch.tensor([True, False, True]),
        "odd.bf16": torch.randn(3, generator=g).bfloat16(),  # an odd byte count before smaller item sizes
        "empty": torch.zeros(0, 4),
        "empty.i64": torch.zeros(2, 0, dtype=torch.int64),
        "scalar": torch.tensor(3.5),
    }


def safetensors_read(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is not a mapping)


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k


def assert_chunks_are_the_files(store: WeightStore, version: int) -> None:
    manifest = store.manifest(version)
    for name, entry in manifest.files.items():
        found = digest_file(store.path(version) / name, store.algo, store.chunk_bytes)
        assert (found.size, found.chunks) == (entry.bytes, entry.chunks), name


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_every_dtype_is_written_as_safetensors_reads_it_and_its_chunks_are_the_files(tmp_path, algo):
    state = every_dtype()
    store = WeightStore(tmp_path, algo=algo, chunk_bytes=MIB)
    _, digest, _ = store.publish(1, state, beside={"config.json": b"{}", "empty.txt": b""})
    file = store.path(1) / "model.safetensors"
    assert_same(safetensors_read(file), state)
    assert_same(load_verified(store.path(1), digest, name="v1"), state)
    assert len(store.manifest(1).files["model.safetensors"].chunks) == 2
    assert_chunks_are_the_files(store, 1)
    assert (store.path(1) / "empty.txt").read_bytes() == b"" and store.manifest(1).files["empty.txt"].bytes == 0
    n = int.from_bytes(file.read_bytes()[:8], "little")
    assert n % 8 == 0 and json.loads(file.read_bytes()[8 : 8 + n])["__metadata__"] == {"format": "pt"}


def test_a_sharded_version_is_safetensors_shards_with_an_index_each_tensor_aligned(tmp_path):
    state = {**every_dtype(), "more.f32": torch.randn(300, 300), "more.i64": torch.arange(100_000)}
    store = WeightStore(tmp_path, chunk_bytes=MIB, shard_bytes=600_000)
    _, digest, _ = store.publish(1, state, dtype=torch.float32)
    want = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    shards = sorted(store.path(1).glob("model-*.safetensors"))
    index = json.loads((store.path(1) / "model.safetensors.index.json").read_text())
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {p.name for p in shards}
    got: dict[str, torch.Tensor] = {}
    for shard in shards:
        part = safetensors_read(shard)
        assert all(index["weight_map"][k] == shard.name for k in part)
        got.update(part)
        raw = shard.read_bytes()
        header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
        for k, e in header.items():
            if k != "__metadata__":
                assert e["data_offsets"][0] % want[k].element_size() == 0, k
    assert_same(got, want)
    assert_same(load_verified(store.path(1), digest, name="v1"), want)
    assert_chunks_are_the_files(store, 1)


def test_short_writes_are_resumed(tmp_path, monkeypatch):
    real = os.pwritev
    monkeypatch.setattr(os, "pwritev", lambda fd, bufs, offset: real(fd, [memoryview(bufs[0])[:1000]], offset))
    state = every_dtype()
    store = WeightStore(tmp_path, chunk_bytes=MIB)
    store.publish(1, state)
    assert_same(safetensors_read(store.path(1) / "model.safetensors"), state)
    assert_chunks_are_the_files(store, 1)


def test_a_writer_that_fails_mid_file_leaves_no_version_no_temp_dir_and_no_open_file(tmp_path, monkeypatch):
    import dora.store.writer

    store = WeightStore(tmp_path, chunk_bytes=MIB)
    store.publish(1, {"w": torch.ones(3)})
    real, calls = dora.store.writer.write_at, []

    def failing(fd, pieces, offset):
        calls.append(offset)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        real(fd, pieces, offset)

    monkeypatch.setattr(dora.store.writer, "write_at", failing)
    fds = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else None
    with pytest.raises(OSError, match="No space left"):
        store.publish(2, {"w": torch.randn(3 * MIB)})  # 12 MiB: the second chunk fails
    assert calls == [0, MIB] and store.versions() == [1]
    store.clean()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]
    assert fds is None or len(os.listdir("/proc/self/fd")) == fds


def test_a_snapshot_reuses_its_buffer_grows_for_a_larger_version_and_holds_the_state_cast():
    state = every_dtype()
    snap = HostSnapshot(pin=False, piece_bytes=64 << 10)  # small pieces: the big tensor is copied by several jobs
    first = snap.take(state, torch.bfloat16)
    want = {k: v.bfloat16() if v.is_floating_point() else v for k, v in state.items()}
    assert_same(first, want)
    ptr = snap.buffer.data_ptr()
    assert snap.bytes == sum(v.numel() * v.element_size() for v in want.values()) and snap.seconds > 0
    second = snap.take({k: v * 2 if v.is_floating_point() else v for k, v in state.items()}, torch.bfloat16)
    assert snap.buffer.data_ptr() == ptr and snap.alloc_s == 0.0
    assert torch.equal(first["f32"], second["f32"])  # documented: a take overwrites the views of the last one
    assert torch.equal(second["f32"], (state["f32"] * 2).bfloat16())
    small = snap.buffer.numel()
    larger = snap.take({**state, "extra": torch.randn(MIB)}, None)
    assert snap.buffer.numel() >= snap.bytes > small and snap.alloc_s > 0
    assert_same(larger, {**state, "extra": larger["extra"]})


def test_a_snapshot_is_laid_out_as_its_files_each_written_as_one_span(tmp_path):
    state = every_dtype()
    snap = HostSnapshot(pin=False, shard_bytes=400_000)
    views = snap.take(state, torch.float32)
    plans = plan(views, None, shard_bytes=400_000)
    assert len(plans) > 1 and [s.key for p in plans for s in p.slots] == list(views)
    assert all(len(spans(p, views)) == 2 for p in plans)  # the header, then one span of the buffer
    store = WeightStore(tmp_path, chunk_bytes=MIB, shard_bytes=400_000)
    _, digest, _ = store.publish(1, views)
    want = {k: v.float() if v.is_floating_point() else v for k, v in state.items()}
    into = {k: torch.empty_like(v) for k, v in want.items()}
    load_into(store.path(1), digest, name="v1", into=into, undo=lambda: None)
    assert_same(into, want)
