"""`dora run` on one GPU (skipped without CUDA): two torch workers and the torch learner share the device
(run.share_gpus: the standalone worker has no GPU of its own beside the learner's); the
elastic worker sleeps (model to host memory, caches dropped) for each train step and the learner puts its weights
and optimizer state in host memory between steps. Every group is trained once and the run's invariants hold."""

from __future__ import annotations

import json

import pytest
import torch

from tests.live.test_dora_run import dora_run, the_run

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(300)]  # fmt: skip


def events(path, name):
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")]
    return [r for r in rows if r["event"] == name]


def test_an_elastic_torch_worker_sleeps_for_each_step_beside_a_learner_that_offloads(tmp_path, tiny_model):
    steps, groups = 4, 4
    proc = dora_run(tmp_path, "examples/quickstart.toml", f"rollout.model={tiny_model}",
                    f"core.total_steps={steps}", f"core.train_groups={groups}", "core.group_size=4",
                    "run.elastic_workers=1", "rollout.device=cuda", "rollout.sleep_on_yield=true",
                    "learner.device=auto", "learner.offload_between_steps=true", "run.share_gpus=true")  # fmt: skip
    out, _ = proc.communicate(timeout=280)
    assert proc.returncode == 0, out
    assert "2 torch workers (1 elastic)" in out and "invariants hold" in out, out
    rundir = the_run(tmp_path)
    (ready,) = events(rundir / "learner.log", "trainer_ready")
    assert ready["device"] == "cuda:0" and ready["offload_between_steps"] is True, ready
    slept = events(rundir / "w0.log", "yielded")
    assert len(slept) == steps and all(r["asleep"] for r in slept), slept  # the model left the GPU each time
    assert len(events(rundir / "w0.log", "resumed")) >= steps - 1
    assert events(rundir / "w1.log", "yielded") == []  # standalone: always rolls out
    rows = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == steps and all(r["tokens"] > 0 for r in rows)
    audit = [json.loads(x) for x in (rundir / "audit.jsonl").read_text().splitlines()]
    trained = [g for r in audit for g in r["groups"]]
    assert len(trained) == len(set(trained)) == steps * groups
