"""A published version is a model folder: transformers opens it as it is, tied tensors are stored once, large
versions are sharded with an index, and the digest covers every file of the folder (not only the weights)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from dora.hf.folder import companion_files, with_dtype
from dora.hf.tensors import publishable, tied_copies
from dora.store import DigestMismatch, WeightStore, load_into, load_verified
from dora.store.digest import digest_file

MIB = 1 << 20


@pytest.fixture(scope="module")
def tied_folder(tmp_path_factory):
    """A tiny Qwen2 with tied embeddings (as Qwen2.5-0.5B), saved with its tokenizer and generation config."""
    from transformers import AutoModelForCausalLM, GenerationConfig, Qwen2Config

    from dora.hf.tiny import build_tokenizer

    out = tmp_path_factory.mktemp("tied")
    tok = build_tokenizer(512)
    cfg = Qwen2Config(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                      eos_token_id=tok.eos_token_id, tie_word_embeddings=True)  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    GenerationConfig(eos_token_id=[tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]).save_pretrained(out)
    return out


def publish_model(store: WeightStore, version: int, folder, dtype=torch.bfloat16, scale: float = 1.0):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    beside = companion_files(folder)
    beside["config.json"] = with_dtype(beside["config.json"], str(dtype).removeprefix("torch."))
    uri, digest, _ = store.publish(version, publishable(model.state_dict(), tied_copies(model)), beside=beside,
                                   dtype=dtype)  # fmt: skip
    return model, uri, digest


def test_a_tied_model_publishes_its_shared_tensor_once_and_transformers_opens_the_version(tied_folder, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    store = WeightStore(tmp_path / "store")
    model, _, digest = publish_model(store, 1, tied_folder, scale=0.5)
    assert tied_copies(model) == {"lm_head.weight": "model.embed_tokens.weight"}
    folder = store.path(1)
    names = {p.name for p in folder.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.safetensors", "manifest.json"} <= names
    state = load_verified(folder, digest, name="v1")
    assert "lm_head.weight" not in state and state["model.embed_tokens.weight"].dtype == torch.bfloat16
    assert json.loads((folder / "config.json").read_text())["dtype"] == "bfloat16"
    opened = AutoModelForCausalLM.from_pretrained(folder)  # the folder as it is, no dora code
    assert opened.dtype == torch.bfloat16
    assert opened.lm_head.weight.data_ptr() == opened.model.embed_tokens.weight.data_ptr()
    want = model.model.embed_tokens.weight.detach().bfloat16()
    assert torch.equal(opened.model.embed_tokens.weight, want) and torch.equal(opened.lm_head.weight, want)
    assert len(AutoTokenizer.from_pretrained(folder)) == len(AutoTokenizer.from_pretrained(tied_folder))
    assert GenerationConfig.from_pretrained(folder).eos_token_id == GenerationConfig.from_pretrained(
        tied_folder).eos_token_id  # fmt: skip


def test_a_version_above_the_shard_size_is_sharded_with_an_index_that_transformers_follows(tied_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    store = WeightStore(tmp_path / "store", chunk_bytes=MIB, shard_bytes=40_000)
    model, _, digest = publish_model(store, 2, tied_folder, dtype=torch.float32)
    folder = store.path(2)
    shards = sorted(p.name for p in folder.glob("*.safetensors"))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    expected = publishable(model.state_dict(), tied_copies(model))
    assert sorted(index["weight_map"]) == sorted(expected) and set(index["weight_map"].values()) == set(shards)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert set(manifest["files"]) >= {*shards, "model.safetensors.index.json", "config.json", "tokenizer.json"}
    assert all(e["bytes"] == (folder / k).stat().st_size for k, e in manifest["files"].items())
    got = load_verified(folder, digest, name="v2")
    assert sorted(got) == sorted(expected) and all(torch.equal(got[k], v) for k, v in expected.items())
    opened = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in opened.state_dict().items())


@pytest.mark.parametrize("file", ["config.json", "tokenizer.json", "model.safetensors.index.json", "shard"])
def test_a_changed_byte_in_any_file_of_the_folder_is_refused_naming_that_file(tied_folder, tmp_path, file):
    store = WeightStore(tmp_path / "store", chunk_bytes=MIB, shard_bytes=40_000)
    _, _, digest = publish_model(store, 3, tied_folder)
    folder = store.path(3)
    name = sorted(p.name for p in folder.glob("model-*.safetensors"))[-1] if file == "shard" else file
    data = bytearray((folder / name).read_bytes())
    data[len(data) // 2] ^= 0x04
    (folder / name).write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match=rf"v3 at .*/{name}: .*digest"):
        load_verified(folder, digest, name="v3")


def test_a_manifest_edited_to_match_changed_files_is_not_the_one_the_digest_names(tied_folder, tmp_path):
    """Rewriting a file and its manifest entry together is still caught: the published digest is the root of
    the manifest's whole list."""
    store = WeightStore(tmp_path / "store")
    _, _, digest = publish_model(store, 4, tied_folder)
    folder = store.path(4)
    (folder / "config.json").write_text("{}")
    manifest = json.loads((folder / "manifest.json").read_text())
    found = digest_file(folder / "config.json")
    manifest["files"]["config.json"] = {"bytes": found.size, "chunks": list(found.chunks)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DigestMismatch, match=r"v4 at .*: its manifest.json is not the one the published digest"):
        load_verified(folder, digest, name="v4")


def test_a_version_of_the_previous_format_still_loads_checked(tmp_path):
    """What a store written by the previous dora holds: ``model.safetensors`` and a format-2 manifest."""
    folder = tmp_path / "v6"
    folder.mkdir()
    tensors = {"w": torch.arange(300_000.0)}
    save_file(tensors, str(folder / "model.safetensors"))
    found = digest_file(folder / "model.safetensors", "xxh3_128", MIB)
    old = {"format": 2, "version": 6, "bytes": found.size, "digest": str(found.digest), "chunks": list(found.chunks)}
    (folder / "manifest.json").write_text(json.dumps(old))
    store = WeightStore(tmp_path)
    assert store.versions() == [6] and store.manifest(6).format == 2
    assert torch.equal(store.load(6)["w"], tensors["w"])
    assert torch.equal(load_verified(f"{folder}/model.safetensors", str(found.digest), name="v6")["w"], tensors["w"])


def test_a_sharded_version_copied_in_place_is_checked_across_its_shards_and_undone_on_a_bad_chunk(tmp_path):
    store = WeightStore(tmp_path / "store", chunk_bytes=MIB, shard_bytes=3 * MIB)
    g = torch.Generator().manual_seed(1)
    state = {f"t{i}": torch.randn(MIB // 4 + 1000 * i, generator=g) for i in range(8)}  # ~8 MiB in 3-4 shards
    _, digest, _ = store.publish(1, state)
    assert len(list(store.path(1).glob("model-*.safetensors"))) >= 3
    into = {k: torch.zeros_like(v) for k, v in state.items()}
    undone = []
    got = load_into(store.path(1), digest, name="v1", into=into, undo=lambda: undone.append(True))
    assert not undone and all(torch.equal(into[k], v) and torch.equal(got[k], v) for k, v in state.items())
    last = sorted(store.path(1).glob("model-*.safetensors"))[-1]
    data = bytearray(last.read_bytes())
    data[-5] ^= 0x01
    last.write_bytes(bytes(data))
    with pytest.raises(DigestMismatch, match=rf"v1 at .*{last.name}: xxh3_128 digest: 1 of \d+ chunks differ"):
        load_into(store.path(1), digest, name="v1", into=into, undo=lambda: undone.append(True))
    assert undone == [True]
