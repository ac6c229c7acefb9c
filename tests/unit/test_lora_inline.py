"""A LoRA version carried inline: the learner packs its adapter folder in memory (the store's digest for the same
files), a worker loads the adapters from the Assign's bytes and reads no file, and a copy that does not check is
refused, the worker then reading the store's copy as it always did."""

from __future__ import annotations

import asyncio
import builtins
import os
import pathlib

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from dora.learner.loss import LossConfig
from dora.learner.trainers.torch_trainer import TorchTrainer, TrainerConfig
from dora.rollout.engines.base import EngineError
from dora.rollout.engines.stepped import StepWorkerEngine
from dora.rollout.engines.torch.engine import TorchEngine
from dora.store import WeightStore, load_verified
from dora.store.inline import verified, write
from dora.wire import messages as m
from tests.unit.test_fsdp import batch
from tests.unit.test_lora_engines import PROMPT, Task
from tests.unit.test_lora_learner import LORA, trainer


@pytest.fixture(scope="module")
def published(tiny_model, tmp_path_factory):
    """A trainer one step on, its version 1 inline, and the store's copy written from those bytes."""
    t = trainer(tiny_model, tmp_path_factory.mktemp("inline"))
    t.train(batch())
    got = t.inline_version(1)
    assert got is not None
    write(t.store.root, 1, got[0])
    return t, *got


def test_the_learners_inline_version_is_its_adapter_folder_and_the_store_copy_has_its_digest(published):
    from safetensors.torch import load

    from dora.hf.lora import adapter_state

    t, inline, digest = published
    assert sorted(inline) == ["adapter_config.json", "adapter_model.safetensors", "dora_base_model.json",
                              "manifest.json"]  # fmt: skip
    assert {k: inline[k] for k in t.beside} == t.beside
    want = adapter_state(t.model.state_dict())
    got = load(inline["adapter_model.safetensors"])
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k].to(t.publish_dtype)) for k in want)
    assert t.store.digest(1) == digest  # the store's digest for the folder written from these bytes
    on_disk = {p.name: p.read_bytes() for p in t.store.path(1).iterdir() if p.name != "manifest.json"}
    assert verified(inline, digest, "v1") == on_disk
    assert load_verified(t.store.path(1), digest, name="v1").keys() == want.keys()


def test_full_weights_are_never_carried_inline(tiny_model, tmp_path):
    full = TorchTrainer(tiny_model, WeightStore(tmp_path / "store"), LossConfig(), TrainerConfig(lr=1e-2))
    with pytest.raises(ValueError, match="v1: full weights are not carried inline"):
        full.inline_version(1)


def sample(w: StepWorkerEngine) -> list[list[int]]:
    w.submit(m.Generate(group_id=1, attempt=1, version=1, prompt_ids=np.array(PROMPT, np.int32), n_samples=2,
                        max_tokens=8, seed=5), 0.0)  # fmt: skip
    done = []
    for _ in range(50):
        if not w.busy():
            break
        w.advance(0.0)
        done += w.take_finished()
    return [s.tokens for s in sorted(done, key=lambda s: s.index)]


def test_a_worker_loads_an_inline_version_without_touching_the_file_system(tiny_model, published, monkeypatch):
    t, inline, digest = published
    from_folder = StepWorkerEngine(TorchEngine(tiny_model, version=0, lora=LORA.lora), Task())
    from_folder.loaded(1, f"file://{t.store.path(1)}", digest)
    w = StepWorkerEngine(TorchEngine(tiny_model, version=0, lora=LORA.lora), Task())

    def no_files(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a file was opened: {args}")

    with monkeypatch.context() as patched:
        for module, name in ((os, "open"), (builtins, "open"), (pathlib.Path, "open")):
            patched.setattr(module, name, no_files)
        w.loaded(1, "file:///nonexistent/v1", digest, inline=inline)
    assert w.version == 1
    assert sample(w) == sample(from_folder)
    assert sample(w) != sample(StepWorkerEngine(TorchEngine(tiny_model, version=1, lora=LORA.lora), Task()))


def test_a_tampered_inline_version_is_refused_and_the_store_copy_is_read(tiny_model, published):
    t, inline, digest = published
    data = bytearray(inline["adapter_model.safetensors"])
    data[-3] ^= 1
    tampered = {**inline, "adapter_model.safetensors": bytes(data)}
    w = StepWorkerEngine(TorchEngine(tiny_model, version=0, lora=LORA.lora), Task())
    with capture_logs() as logs:
        w.loaded(1, f"file://{t.store.path(1)}", digest, inline=tampered)
    (refused,) = [r for r in logs if r["event"] == "inline_weights_refused"]
    assert "inline adapter_model.safetensors" in refused["error"] and refused["fallback"] == "uri"
    assert w.version == 1
    direct = StepWorkerEngine(TorchEngine(tiny_model, version=0, lora=LORA.lora), Task())
    direct.loaded(1, f"file://{t.store.path(1)}", digest)
    assert sample(w) == sample(direct)
    # no store copy to fall back on: refused as a bad file is (the worker reports weights_refused and re-plans)
    alone = StepWorkerEngine(TorchEngine(tiny_model, version=0, lora=LORA.lora), Task())
    with pytest.raises(EngineError, match=r"v1 at /nonexistent/v1: no manifest\.json"):
        alone.loaded(1, "file:///nonexistent/v1", digest, inline=tampered)
    assert alone.version == 0


async def test_the_worker_hands_the_assigns_inline_files_to_its_engine():
    from tests.unit.test_rollout_actor import welcomed_worker

    async with welcomed_worker("run.time_scale=0.0001", "engine.load_s=0") as (broker, worker, _):
        loaded, seen = worker.engine.loaded, []

        def load(version: int, uri: str, sha256: str, keep: frozenset[int], inline: dict[str, bytes]) -> None:
            seen.append(inline)
            loaded(version, uri, sha256)

        worker.engine.loaded = load
        await broker.send(m.Assign(version=3, uri="sim://v3", sha256="0" * 64, seq=1, inline={"a": b"\x01"}))
        assert (await asyncio.wait_for(broker.expect(m.WeightsLoaded), 10)).version == 3
        assert seen == [{"a": b"\x01"}]


@pytest.mark.vllm
@pytest.mark.slow
def test_a_vllm_worker_loads_an_inline_version_from_memory_and_removes_it_once_gone(tiny_model, published):
    """vLLM takes adapters from a folder: an inline version's files are written under tmpfs, not read from the
    store (the uri names nothing), give the folder's log-probs, and leave with the version."""
    pytest.importorskip("vllm")
    from dora.rollout.engines.vllm_engine import VllmEngine

    t, inline, digest = published
    engine = VllmEngine(tiny_model, max_slots=4, kv_cache_bytes=64 << 20, lora=LORA.lora, max_loras=1)
    w = StepWorkerEngine(engine, Task())
    w.loaded(1, "file:///nonexistent/v1", digest, inline=inline)
    assert engine.inline_root is not None and engine.inline_root.parent == pathlib.Path("/dev/shm")
    assert sorted(p.name for p in (engine.inline_root / "v1").iterdir()) == sorted(set(inline) - {"manifest.json"})
    (r,) = engine.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=6, seed=1)
    while r.finish is None:
        engine.step()
    policy = TorchEngine(tiny_model, version=0, lora=LORA.lora)
    policy.load_weights(1, t.store.path(1), digest)
    with torch.no_grad():
        logits = policy.model(input_ids=torch.tensor([PROMPT + r.tokens])).logits[0, len(PROMPT) - 1 : -1]
    want = torch.log_softmax(logits.float(), -1)[torch.arange(len(r.tokens)), torch.tensor(r.tokens)]
    assert torch.allclose(torch.tensor(r.logprobs), want, atol=1e-4)
    again = t.inline_version(2)  # the same adapters as version 2
    assert again is not None
    w.loaded(2, "file:///nonexistent/v2", again[1], inline=again[0])
    assert engine.held_versions() == {2}  # max_loras 1: v1 left, and its folder with it
    assert sorted(p.name for p in engine.inline_root.iterdir()) == ["v2"]
