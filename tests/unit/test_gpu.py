"""The learner on a GPU (skipped without CUDA): `learner.device = auto` picks the rank's GPU, a step there
matches the CPU step, and the weights it publishes are plain CPU safetensors any worker loads. An elastic vLLM
or torch worker's engine gives the GPU's memory back while it sleeps and wakes on the same weights."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dora.actor.cluster import ClusterInfo
from dora.learner.loss import LossConfig
from dora.learner.ranks import learner_device
from dora.learner.trainers.torch_trainer import TorchTrainer
from dora.store import WeightStore
from tests.unit.test_fsdp import CFG, batch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_the_learner_trains_on_its_gpu_like_on_the_cpu_and_publishes_loadable_weights(tiny_model, tmp_path):
    device = learner_device("auto", ClusterInfo(host="n1", local_rank=0))
    assert device == torch.device("cuda", 0)
    cpu = TorchTrainer(tiny_model, WeightStore(tmp_path / "cpu"), LossConfig(), CFG)
    gpu = TorchTrainer(tiny_model, WeightStore(tmp_path / "gpu"), LossConfig(), CFG, device=str(device))
    assert all(p.is_cuda for p in gpu.model.parameters())
    want, got = cpu.train(batch()), gpu.train(batch())
    for k in ("loss", "reward_mean", "grad_norm", "tokens"):
        assert got[k] == pytest.approx(want[k], rel=1e-3, abs=1e-5), k
    uri, _, _ = gpu.publish(1)
    from safetensors.torch import load_file

    published = load_file(uri.removeprefix("file://") + "/model.safetensors")
    for k, v in cpu.model.state_dict().items():
        assert published[k].device.type == "cpu"
        assert (published[k] - v).abs().max().item() <= 2 * CFG.lr, k  # the same AdamW step, within rounding


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
def test_a_sleeping_vllm_engine_gives_the_gpu_memory_back_and_wakes_on_the_same_weights(tiny_model):
    from transformers import AutoModelForCausalLM

    from dora.rollout.engines.vllm_engine import VllmEngine

    kv = 1 << 30
    e = VllmEngine(tiny_model, max_slots=8, kv_cache_bytes=kv, max_model_len=1024, version=0, sleep_level=1)
    prompt = [17, 300, 45, 9, 88, 12]
    e.submit(group_id=1, attempt=1, prompt=prompt, n=2, max_tokens=40, temperature=1.0, seed=3)
    for _ in range(8):
        e.step()
    prefixes = {r.index: list(r.tokens) for r in e.requests.values()}
    free_awake = torch.cuda.mem_get_info()[0]
    e.sleep()
    freed = torch.cuda.mem_get_info()[0] - free_awake
    assert e.llm.llm_engine.is_sleeping() and len(e) == 2
    assert freed >= 0.9 * kv, f"sleeping freed {freed / 2**20:.0f} MiB of a {kv / 2**20:.0f} MiB KV cache"
    e.wake()
    done = {}
    while len(e):
        done.update({s.index: s for s in e.step()})
    assert all(len(s.tokens) > len(prefixes[i]) for i, s in done.items()) and len(done) == 2
    e.sleep()  # a load that ends after the yield: made awake, and the engine sleeps on with its memory given back
    e.load_weights(0, tiny_model / "model.safetensors", None)
    assert e.llm.llm_engine.is_sleeping() and torch.cuda.mem_get_info()[0] - free_awake >= 0.9 * kv
    e.wake()
    e.submit(group_id=2, attempt=1, prompt=prompt, n=1, max_tokens=20, temperature=1.0, seed=4)
    while len(e):
        done.update({10 + s.index: s for s in e.step()})
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    for index, s in done.items():
        assert s.tokens[: len(prefixes.get(index, []))] == prefixes.get(index, [])
        with torch.no_grad():  # the woken weights are the version's: its log-probs, as before the sleep
            logits = reference(input_ids=torch.tensor([prompt + s.tokens])).logits[0].float()
        want = torch.log_softmax(logits[len(prompt) - 1 : -1], -1)[torch.arange(len(s.tokens)), torch.tensor(s.tokens)]
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-2)


def test_a_sleeping_torch_engine_gives_the_gpu_memory_back_and_each_sample_goes_on_exactly(tiny_model):
    from dora.rollout.engines.torch.engine import TorchEngine
    from tests.engines.test_engines import PROMPT, run

    ref = TorchEngine(tiny_model, device="cuda", version=0)
    ref.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=40, temperature=1.0, seed=5)
    expected = run(ref)
    del ref
    e = TorchEngine(tiny_model, device="cuda", version=0, sleep_on_yield=True)
    e.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=40, temperature=1.0, seed=5)
    for _ in range(10):
        e.step()
    weights = sum(p.numel() * p.element_size() for p in e.model.parameters())
    held = torch.cuda.memory_allocated()
    e.sleep()
    assert held - torch.cuda.memory_allocated() >= weights
    assert all(p.device.type == "cpu" for p in e.model.parameters())
    e.wake()
    got = run(e)
    for key, s in expected.items():
        assert got[key].tokens == s.tokens
        assert torch.allclose(torch.tensor(got[key].logprobs), torch.tensor(s.logprobs), atol=1e-3)


def test_a_learner_that_offloads_between_steps_frees_the_gpu_and_trains_as_one_that_does_not(tiny_model, tmp_path):
    import dataclasses

    from safetensors.torch import load_file

    kept = TorchTrainer(tiny_model, WeightStore(tmp_path / "kept"), LossConfig(), CFG, device="cuda")
    moved = TorchTrainer(tiny_model, WeightStore(tmp_path / "moved"), LossConfig(),
                         dataclasses.replace(CFG, offload_between_steps=True), device="cuda")  # fmt: skip
    weights = sum(p.numel() * p.element_size() for p in moved.model.parameters())
    for step in range(3):
        want, got = kept.train(batch()), moved.train(batch())
        assert not moved.offloaded and all(p.is_cuda for p in moved.model.parameters())
        for k in ("loss", "grad_norm"):
            assert got[k] == pytest.approx(want[k], rel=1e-4, abs=1e-6), (step, k)
        kept_uri, _, _ = kept.publish(step + 1)
        on_gpu = torch.cuda.memory_allocated()
        uri, _, _ = moved.publish(step + 1)
        assert moved.offloaded and all(p.device.type == "cpu" for p in moved.model.parameters())
        assert on_gpu - torch.cuda.memory_allocated() >= 3 * weights  # weights and both AdamW moments
    a = load_file(kept_uri.removeprefix("file://") + "/model.safetensors")
    b = load_file(uri.removeprefix("file://") + "/model.safetensors")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
