"""A version carried inline (``dora.store.inline``): packed in memory with the store's digest, checked like a store
folder (the manifest the digest names, every file against its chunks), and written into the store byte for byte, so
the store's copy has the inline copy's digest."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save

from dora.store import WeightStore, load_verified
from dora.store.digest import DigestMismatch
from dora.store.inline import pack, verified, write


def files(seed: int = 0) -> dict[str, bytes]:
    g = torch.Generator().manual_seed(seed)
    weights = {"a.lora_A.weight": torch.randn(4, 32, generator=g), "a.lora_B.weight": torch.randn(32, 4, generator=g)}
    return {"adapter_model.safetensors": save(weights, metadata={"format": "pt"}),
            "adapter_config.json": json.dumps({"r": 4, "seed": seed}).encode()}  # fmt: skip


def test_packed_files_are_written_as_a_store_folder_whose_digest_is_the_packed_one(tmp_path):
    inline, digest = pack(3, files(), algo="xxh3_128", chunk_bytes=1 << 20, dtype="float32")
    assert sorted(inline) == ["adapter_config.json", "adapter_model.safetensors", "manifest.json"]
    assert digest.startswith("xxh3_128/1MiB/dir:")
    assert verified(inline, digest, "v3") == files()

    uri = write(tmp_path / "store", 3, inline)
    folder = tmp_path / "store" / "v3"
    assert uri == f"file://{folder}"
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == inline  # those exact bytes
    assert WeightStore(tmp_path / "store").digest(3) == digest
    loaded = load_verified(folder, digest, name="v3")  # what a worker reading the store checks
    assert set(loaded) == {"a.lora_A.weight", "a.lora_B.weight"}
    assert not [p for p in (tmp_path / "store").iterdir() if p.name.startswith(".")]  # no temporary left


def test_the_digest_of_a_pack_is_the_one_a_publish_of_the_same_files_gives(tmp_path):
    store = WeightStore(tmp_path / "store", algo="sha256")
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.ones(5)}
    beside = {"adapter_config.json": b"{}\n"}
    _, published, _ = store.publish(1, weights, beside=beside, file="adapter_model.safetensors")
    written = {p.name: p.read_bytes() for p in store.path(1).iterdir() if p.name != "manifest.json"}
    assert pack(1, written, algo="sha256")[1] == published


@pytest.mark.parametrize("tamper", ["flip", "swap_manifest", "drop_manifest", "extra_file", "missing_file"])
def test_a_tampered_inline_version_is_refused(tamper):
    inline, digest = pack(3, files(), algo="xxh3_128")
    if tamper == "flip":
        data = bytearray(inline["adapter_model.safetensors"])
        data[-5] ^= 1
        inline["adapter_model.safetensors"] = bytes(data)
    elif tamper == "swap_manifest":  # another version's manifest, which vouches for its own files
        inline["manifest.json"] = pack(3, files(seed=1))[0]["manifest.json"]
    elif tamper == "drop_manifest":
        del inline["manifest.json"]
    elif tamper == "extra_file":
        inline["tokenizer.json"] = b"{}"
    else:
        del inline["adapter_config.json"]
    message = {"flip": r"v3: inline adapter_model\.safetensors: xxh3_128 digest .* 1 of 1 chunks differ",
               "swap_manifest": r"v3: the inline manifest\.json is not the one the published digest names",
               "drop_manifest": r"v3: no manifest\.json among the files carried inline",
               "extra_file": r"v3: .*not the manifest's: extra \['tokenizer\.json'\], missing \[\]",
               "missing_file": r"v3: .*extra \[\], missing \['adapter_config\.json'\]"}[tamper]  # fmt: skip
    with pytest.raises(DigestMismatch, match=message):
        verified(inline, digest, "v3")


def test_write_refuses_bytes_its_manifest_does_not_vouch_for_and_pack_refuses_names_that_are_not_a_folders(tmp_path):
    inline, _ = pack(2, files())
    inline["adapter_config.json"] = b"{}"
    with pytest.raises(DigestMismatch, match=r"v2: inline adapter_config\.json"):
        write(tmp_path, 2, inline)
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match=r"v5: its manifest\.json is version 2's"):
        write(tmp_path, 5, pack(2, files())[0])
    for name in ("../x", "manifest.json", ".hidden"):
        with pytest.raises(ValueError, match="cannot be a file of a version folder"):
            pack(2, {name: b"x"})
