"""The weight store: atomic versions with a chunked digest manifest, checked on the bytes loaded; format-1
manifests still read; a publisher killed mid-write leaves nothing a worker could load, and its leftovers go at the
next open; the broker's retirement deletes only store versions."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import save_file
from structlog.testing import capture_logs

import dora.store
import dora.store.load
from dora.store import WeightStore, load_verified, retire_uri, sha256_file, store_path
from dora.store.digest import Digest, DigestMismatch, digest_file, folder_root

MIB = 1 << 20


def state(seed: int = 0, mib: int = 6) -> dict[str, torch.Tensor]:
    """Two tensors of ``mib`` MiB in all: several 1 MiB chunks."""
    g = torch.Generator().manual_seed(seed)
    return {"a": torch.randn(mib * MIB // 8, generator=g), "b": torch.randn(mib * MIB // 8, generator=g)}


def test_publish_writes_a_complete_version_with_its_digest(tmp_path):
    store = WeightStore(tmp_path / "store")
    tensors = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    uri, digest, seconds = store.publish(3, tensors)
    path = store_path(uri)
    assert uri.startswith("file://") and path == tmp_path / "store" / "v3" and seconds >= 0
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == 3 and manifest["version"] == 3 and manifest["digest"] == digest == store.digest(3)
    found = digest_file(path / "model.safetensors")
    assert manifest["files"] == {"model.safetensors": {"bytes": found.size, "chunks": list(found.chunks)}}
    want = folder_root("xxh3_128", 16 * MIB, {"model.safetensors": (found.size, found.chunks)})
    assert digest == f"xxh3_128/16MiB/dir:{want}" and manifest["dtype"] == "float32"
    assert manifest["bytes"] == (path / "model.safetensors").stat().st_size
    assert set(manifest["timings_s"]) == {"prepare", "write", "hash", "fsync"}
    back = store.load(3)
    assert torch.equal(back["w"], tensors["w"]) and torch.equal(back["b"], tensors["b"])
    assert store.versions() == [3] and not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]


def test_a_digest_names_its_algorithm_and_chunk_size_and_a_plain_sha256_still_parses():
    tree = Digest("xxh3_128", 16 * MIB, "ab" * 16)
    assert str(tree) == "xxh3_128/16MiB:" + "ab" * 16 and Digest.parse(str(tree)) == tree
    folder = Digest("sha256", 4 * MIB, "cd" * 32, folder=True)
    assert str(folder) == "sha256/4MiB/dir:" + "cd" * 32 and Digest.parse(str(folder)) == folder != tree
    assert Digest.parse("0" * 64) == Digest("sha256", 0, "0" * 64)
    for bad in ("", "md5/16MiB:00", "xxh3_128/0MiB:00", "sha256:" + "0" * 64, "0" * 63):
        with pytest.raises(ValueError, match="not a weight digest"):
            Digest.parse(bad)


@pytest.mark.parametrize("algo", ["xxh3_128", "sha256"])
def test_a_flipped_byte_is_refused_naming_the_version_and_the_chunk(tmp_path, algo):
    store = WeightStore(tmp_path, algo=algo, chunk_bytes=MIB)
    _, digest, _ = store.publish(4, state())
    assert digest.startswith(f"{algo}/1MiB/dir:")
    file = store.path(4) / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[2 * MIB + 17] ^= 0x01  # one bit, in the third chunk
    file.write_bytes(bytes(data))
    with pytest.raises(
        DigestMismatch, match=r"v4 at .*model\.safetensors: .*1 of 7 chunks differ.* bytes 2097152-3145728"
    ):
        store.load(4)
    with pytest.raises(DigestMismatch, match="v4"):  # the engines' path: the published digest, the manifest beside
        load_verified(file, digest, name="v4")


def test_a_truncated_file_is_refused_with_its_size_and_the_manifests(tmp_path):
    store = WeightStore(tmp_path, chunk_bytes=MIB)
    _, digest, _ = store.publish(2, state())
    file = store.path(2) / "model.safetensors"
    size = file.stat().st_size
    with open(file, "r+b") as f:
        f.truncate(size - 100)
    with pytest.raises(DigestMismatch, match=rf"v2 at .*: the file has {size - 100} bytes, its manifest says {size}"):
        store.load(2)
    (store.path(2) / "manifest.json").unlink()  # no manifest beside it: nothing vouches for the files
    with pytest.raises(DigestMismatch, match=r"v2 at .*: no manifest.json beside the files"):
        load_verified(file, digest, name="v2")


def test_a_format_1_manifest_is_still_read_and_checked_as_a_plain_sha256(tmp_path):
    """What a store written before format 2 holds: ``{version, sha256, bytes, write_s}``, no ``format``."""
    (tmp_path / "v5").mkdir()
    file = tmp_path / "v5" / "model.safetensors"
    tensors = state(1, mib=2)
    save_file(tensors, str(file))
    old = {"version": 5, "sha256": sha256_file(file), "bytes": file.stat().st_size, "write_s": 0.1}
    (tmp_path / "v5" / "manifest.json").write_text(json.dumps(old))
    store = WeightStore(tmp_path)
    assert store.versions() == [5] and store.digest(5) == old["sha256"] and store.manifest(5).format == 1
    assert torch.equal(store.load(5)["a"], tensors["a"])
    file.write_bytes(file.read_bytes()[:-1] + b"\x00")
    with pytest.raises(DigestMismatch, match=r"v5 at .*: sha256 digest"):
        store.load(5)


@pytest.mark.parametrize(
    ("manifest", "error"),
    [
        ({"format": 4, "version": 1, "digest": "x"}, "manifest format 4 is newer than this dora reads"),
        ({"format": 3, "version": 1, "bytes": 1, "digest": "sha256/1MiB/dir:00"}, "not a readable manifest .KeyError"),
        ({"format": "2"}, "manifest format '2' is not one this dora reads"),
        ({"format": 2, "version": 1}, "not a readable manifest .KeyError"),
        ({"format": 2, "version": 1, "bytes": 1, "chunks": [], "digest": "md5:00"}, "not a weight digest"),
    ],
)
def test_a_manifest_this_dora_cannot_read_is_a_clear_error(tmp_path, manifest, error):
    (tmp_path / "v1").mkdir()
    (tmp_path / "v1" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=error):
        WeightStore(tmp_path).load(1)


def test_the_bytes_checked_are_the_bytes_loaded_even_if_the_version_is_replaced_meanwhile(tmp_path, monkeypatch):
    store = WeightStore(tmp_path)
    _, digest, _ = store.publish(1, state(1, mib=2))
    file = store.path(1) / "model.safetensors"
    checked = dora.store.load.verify

    def check_then_replace(*args, **kwargs):  # a re-publish lands between the check and the mapping
        found = checked(*args, **kwargs)
        save_file(state(2, mib=2), str(tmp_path / "other.safetensors"))
        os.replace(tmp_path / "other.safetensors", file)
        return found

    monkeypatch.setattr(dora.store.load, "verify", check_then_replace)
    loaded = load_verified(file, digest, name="v1")
    assert torch.equal(loaded["a"], state(1, mib=2)["a"])  # the checked file, not the one now under its name


def test_republishing_a_version_replaces_it_whole(tmp_path):
    store = WeightStore(tmp_path)
    _, first, _ = store.publish(1, {"w": torch.zeros(2)})
    _, second, _ = store.publish(1, {"w": torch.ones(2)})
    assert first != second and store.digest(1) == second and torch.equal(store.load(1)["w"], torch.ones(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v1"]


def test_retire_deletes_store_versions_and_nothing_else(tmp_path):
    store = WeightStore(tmp_path / "store")
    uri, _, _ = store.publish(2, {"w": torch.zeros(1)})
    stray = tmp_path / "v9"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"not ours")
    assert retire_uri(f"file://{stray / 'model.safetensors'}") is None and stray.exists()
    assert retire_uri("sim://v2") is None
    assert retire_uri(uri) == tmp_path / "store" / "v2" and store.versions() == []
    assert store.retire(2) is False and not list((tmp_path / "store").iterdir())


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_leftovers_of_dead_writers_are_removed_at_open_and_a_live_writers_are_kept(tmp_path):
    host = socket.gethostname()
    old = time.time() - 7200
    dirs = {
        "dead": tmp_path / f".v3.{dead_pid()}@{host}.0123abcd.tmp",
        "unowned": tmp_path / ".v4.89abcdef.tmp",  # the name an older dora gave its temporary directory
        "far_stale": tmp_path / ".v5.77@other.host.0123abcd.tmp",
        "live": tmp_path / f".v6.{os.getpid()}@{host}.0123abcd.tmp",
        "far_fresh": tmp_path / ".v7.77@other.host.0123abcd.tmp",
    }
    for name, d in dirs.items():
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
        if name == "far_stale":
            for p in (d / "model.safetensors", d):
                os.utime(p, (old, old))
    with capture_logs() as logs:
        WeightStore(tmp_path)
    removed = {r["path"]: r["reason"] for r in logs if r["event"] == "store_temp_removed"}
    assert set(removed) == {str(dirs[k]) for k in ("dead", "unowned", "far_stale")}
    assert "is gone" in removed[str(dirs["dead"])] and "other.host" in removed[str(dirs["far_stale"])]
    assert dirs["live"].exists() and dirs["far_fresh"].exists()


CHILD = """
import sys, torch
from dora.store import WeightStore
store = WeightStore(sys.argv[1], fsync=True)
store.publish(1, {"w": torch.arange(8.0)})
big = {f"t{i}": torch.full((16 << 20,), float(i)) for i in range(6)}  # 384 MiB
print("publishing", flush=True)
store.publish(2, big)
print("published", flush=True)
"""


def test_a_publisher_killed_mid_write_leaves_no_version_a_worker_could_load(tmp_path):
    root = tmp_path / "store"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(root)], stdout=subprocess.PIPE, text=True)
    try:
        while (line := child.stdout.readline()) and line.strip() != "publishing":  # past the log lines
            pass
        assert line, "the child ended before its second publish"
        deadline = time.monotonic() + 30
        while not [f for f in root.glob(".v2.*.tmp/model.safetensors") if f.stat().st_size > 0]:
            assert time.monotonic() < deadline and child.poll() is None, "the publish never started writing"
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(10) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    (partial,) = root.glob(".v2.*.tmp")
    assert sorted(p.name for p in root.iterdir() if not p.name.startswith(".")) == ["v1"]  # v2 is not listed
    with capture_logs() as logs:
        store = WeightStore(root)
    assert [r["path"] for r in logs if r["event"] == "store_temp_removed"] == [str(partial)]
    assert not partial.exists() and store.versions() == [1]
    for v in store.versions():  # every listed version loads, checked
        assert torch.equal(store.load(v)["w"], torch.arange(8.0))


def test_retire_older_deletes_only_the_store_versions_before_the_one_named(tmp_path):
    store = WeightStore(tmp_path / "store")
    uris = [store.publish(v, {"w": torch.zeros(1)})[0] for v in (2, 3, 5, 6)]
    (tmp_path / "store" / "v1").mkdir()  # not a store version (no manifest): never deleted
    assert dora.store.retire_older(uris[2]) == [tmp_path / "store" / "v2", tmp_path / "store" / "v3"]
    assert store.versions() == [5, 6] and (tmp_path / "store" / "v1").exists()
    assert dora.store.retire_older("sim://v5") == [] and dora.store.retire_older(uris[2]) == []


DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool]  # fmt: skip


def every_dtype() -> dict[str, torch.Tensor]:
    """A tensor of each dtype (odd sizes, so offsets are not all multiples of 8), a scalar and an empty one."""
    g = torch.Generator().manual_seed(3)
    out = {f"t_{str(d).removeprefix('torch.')}": (torch.randn(37, 5, generator=g) * 100).to(d) for d in DTYPES}
    return out | {"scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4, dtype=torch.bfloat16)}


@pytest.mark.parametrize("checked", [True, False])
def test_every_dtype_loads_equal_to_safetensors_own_load(tmp_path, checked):
    from safetensors.torch import load_file

    store = WeightStore(tmp_path, chunk_bytes=MIB)
    tensors = every_dtype() | state(4, mib=3)  # several chunks
    _, digest, _ = store.publish(1, tensors)
    file = store.path(1) / "model.safetensors"
    got = load_verified(file, digest if checked else None, name="v1")
    want = load_file(file)
    assert sorted(got) == sorted(want) == sorted(tensors)
    for k, t in want.items():
        assert got[k].dtype == t.dtype and got[k].shape == t.shape and torch.equal(got[k], t), k
        assert torch.equal(got[k], tensors[k])


def test_a_loaded_tensor_is_private_writing_to_it_leaves_the_file_as_published(tmp_path):
    store = WeightStore(tmp_path)
    store.publish(1, {"w": torch.zeros(1024)})
    store.load(1)["w"].add_(1.0)  # copy-on-write: never reaches the file
    assert torch.equal(store.load(1)["w"], torch.zeros(1024))


@pytest.mark.parametrize("where", ["header", "first", "middle", "last"])
def test_a_flipped_byte_in_any_chunk_is_refused_naming_that_chunk(tmp_path, where):
    store = WeightStore(tmp_path, chunk_bytes=MIB)
    _, digest, _ = store.publish(7, state(5, mib=5))
    file = store.path(7) / "model.safetensors"
    size = file.stat().st_size
    at = {"header": 20, "first": MIB - 1, "middle": 3 * MIB + 4321, "last": size - 1}[where]
    data = bytearray(file.read_bytes())
    data[at] ^= 0x80
    file.write_bytes(bytes(data))
    lo = at // MIB * MIB
    chunk = rf"1 of 6 chunks differ from the manifest, the first at bytes {lo}-{min(lo + MIB, size)}"
    with pytest.raises(DigestMismatch, match=rf"v7 at .*model\.safetensors: .*{chunk}"):
        load_verified(file, digest, name="v7")


@pytest.mark.parametrize(
    ("mangle", "error"),
    [
        (lambda b: b[:5], "not a safetensors file .5 bytes"),
        (lambda b: (10**9).to_bytes(8, "little") + b[8:], "a header of 1000000000 bytes"),
        (lambda b: b[:8] + b"\xff" + b[9:], "its header is not JSON"),
        (lambda b: b[:-100], "tensor 'b' .* does not fit bytes"),
    ],
    ids=["short", "header_too_long", "header_not_utf8", "truncated"],
)
def test_an_unchecked_file_that_is_not_safetensors_is_a_value_error_not_a_read_past_it(tmp_path, mangle, error):
    file = tmp_path / "model.safetensors"
    save_file(state(6, mib=1), str(file))
    file.write_bytes(mangle(file.read_bytes()))
    with pytest.raises(ValueError, match=rf"v1 at .*model\.safetensors: .*{error}"):
        load_verified(file, None, name="v1")


def test_a_header_that_lies_about_a_tensors_size_is_refused(tmp_path):
    file = tmp_path / "model.safetensors"
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    file.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    with pytest.raises(ValueError, match=r"tensor 'w' \(F32 \[4, 4\]\) does not fit bytes 0-60"):
        load_verified(file, None, name="v1")
