"""Full weights pushed into a running vLLM engine through vLLM's weight-transfer API from memory
(``dora.rollout.engines.vllm_transfer``), on the CPU: the path is taken and said, the model holds exactly what
``reload_weights`` of the same tensors makes of them, vLLM records the version, and the outputs follow the weights
(back on the original tensors, greedy decoding gives the original tokens and log-probs)."""

from __future__ import annotations

import importlib.util

import pytest
import structlog
import torch

from dora.rollout.engines.base import EngineError

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(300),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed"),
]  # fmt: skip
PROMPT = [17, 300, 45, 9, 88, 12]


def model_state(worker) -> dict[str, torch.Tensor]:
    """What vLLM's model holds (run on its worker through ``collective_rpc``)."""
    return {k: v.detach().clone() for k, v in worker.model_runner.model.state_dict().items()}


def test_a_version_in_memory_is_pushed_through_the_weight_transfer_api(tiny_model):
    from safetensors.torch import load_file

    from dora.rollout.engines.vllm_engine import VllmEngine

    with structlog.testing.capture_logs() as logs:
        e = VllmEngine(tiny_model, max_slots=4, kv_cache_bytes=32 << 20, max_model_len=256, version=0)
    assert e.weight_path == "weight_transfer"
    assert [x["path"] for x in logs if x["event"] == "vllm_weight_path"] == ["weight_transfer"]

    def greedy() -> tuple[list[int], list[float]]:
        e.submit(group_id=1, attempt=1, prompt=PROMPT, n=1, max_tokens=10, temperature=0.0)
        while len(e):
            done = e.step()
        return done[0].tokens, done[0].logprobs

    before = greedy()
    original = load_file(str(tiny_model / "model.safetensors"))
    torch.manual_seed(0)
    changed = {k: v + 0.05 * torch.randn_like(v) for k, v in original.items()}
    e.load_tensors(1, changed)
    assert e.version == 1 and e.llm.get_weight_version() == "v1"
    pushed = e.llm.collective_rpc(model_state)[0]
    assert greedy() != before
    e.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": list(changed.items())})
    reloaded = e.llm.collective_rpc(model_state)[0]
    assert pushed.keys() == reloaded.keys() and all(torch.equal(pushed[k], reloaded[k]) for k in pushed)
    e.load_tensors(2, original)
    assert e.llm.get_weight_version() == "v2" and greedy() == before
    e.submit(group_id=2, attempt=1, prompt=PROMPT, n=1, max_tokens=4)
    with pytest.raises(EngineError, match="1 requests are running"):
        e.load_tensors(3, original)
