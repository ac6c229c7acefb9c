"""examples/embed: dora inside a custom stack (its own engine, reward and loss) trains, run as a user runs it."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "embed" / "run.py"

pytestmark = [pytest.mark.timeout(240), pytest.mark.slow]
"""Slow: a whole run's processes (about 45 CPU-s); the default run keeps the example's engine serving a run
(tests/live/test_model_run.py) and the custom loss and reward tests."""


def events(path: pathlib.Path, event: str) -> list[dict]:
    rows = [json.loads(x) for x in path.read_text(errors="replace").splitlines() if x.startswith("{")]
    return [r for r in rows if r.get("event") == event]


def test_the_embedding_example_trains_with_its_own_engine_reward_and_loss(tmp_path, tiny_model):
    steps = 3
    r = subprocess.run([sys.executable, str(EXAMPLE), "--set", f"run.dir={tmp_path}", "--set",
                        f"rollout.model={tiny_model}", "--set", f"core.total_steps={steps}"],
                       capture_output=True, text=True, timeout=200, cwd=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    [rundir] = tmp_path.glob("embed-*")
    metrics = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    assert [m["version"] for m in metrics] == list(range(1, steps + 1))
    assert any(m["grad_norm"] > 0 for m in metrics), metrics
    trained = [g for line in (rundir / "audit.jsonl").read_text().splitlines() for g in json.loads(line)["groups"]]
    assert len(trained) == len(set(trained)) == steps * 8
    # the learner trained on my_stack:loss (one call per step: the micro-batch is the whole batch)
    calls = events(rundir / "learner.log", "custom_loss")
    assert len(calls) == steps and any(c["kl"] > 0 for c in calls), calls
    for worker in (rundir / "w0.log", rundir / "w1.log"):
        # each worker scored with my_stack:reward and served versions the learner published to the store
        assert events(worker, "custom_reward_in_use"), worker.read_text()[-2000:]
        loaded = {e["version"] for e in events(worker, "weights_loaded") if e["uri"].startswith("file://")}
        assert loaded & set(range(1, steps)), loaded
    assert f"my_stack:loss called {steps} times" in r.stderr and "my_stack:reward scored on 2 workers" in r.stderr
