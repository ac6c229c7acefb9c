"""The weight store: atomic versions with a sha256 manifest; the broker's retirement deletes only store versions."""

from __future__ import annotations

import json

import torch

from dora.store import WeightStore, retire_uri, sha256_file, store_path


def test_publish_writes_a_complete_version_with_its_digest(tmp_path):
    store = WeightStore(tmp_path / "store")
    state = {"w": torch.arange(6.0).reshape(2, 3), "b": torch.ones(3)}
    uri, sha, seconds = store.publish(3, state)
    path = store_path(uri)
    assert uri.startswith("file://") and path == tmp_path / "store" / "v3" and seconds >= 0
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["version"] == 3 and manifest["sha256"] == sha == sha256_file(path / "model.safetensors")
    from safetensors.torch import load_file

    back = load_file(str(path / "model.safetensors"))
    assert torch.equal(back["w"], state["w"]) and torch.equal(back["b"], state["b"])
    assert store.versions() == [3] and not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]


def test_republishing_a_version_replaces_it_whole(tmp_path):
    store = WeightStore(tmp_path)
    _, first, _ = store.publish(1, {"w": torch.zeros(2)})
    _, second, _ = store.publish(1, {"w": torch.ones(2)})
    assert first != second and json.loads((tmp_path / "v1" / "manifest.json").read_text())["sha256"] == second


def test_retire_deletes_store_versions_and_nothing_else(tmp_path):
    store = WeightStore(tmp_path / "store")
    uri, _, _ = store.publish(2, {"w": torch.zeros(1)})
    stray = tmp_path / "v9"
    stray.mkdir()
    (stray / "model.safetensors").write_bytes(b"not ours")
    assert retire_uri(f"file://{stray / 'model.safetensors'}") is None and stray.exists()
    assert retire_uri("sim://v2") is None
    assert retire_uri(uri) == tmp_path / "store" / "v2" and store.versions() == []
    assert store.retire(2) is False
