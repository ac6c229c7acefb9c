"""`dora run` with a reward model: it starts `dora reward` first, points the workers at it, weighs its score with a
rule reward, and stops it by PID at the end; each source's mean is in every step's metrics, and its own held-out
evaluations of the starting weights and of the final version are both scored by the server (none of their samples
fails for want of it). Tiny random models (tests/unit/test_reward_server.py builds them): a Qwen2 policy and a
one-label Qwen2 reward model sharing a tokenizer. Slow: four torch processes on CPU."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tests.unit.test_reward_server import build

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_dora_run_serves_the_reward_model_and_reports_each_component(tmp_path: pathlib.Path) -> None:
    rm, policy = build(tmp_path)
    rows = [{"prompt": f"What is {a} + {b}?", "answer": str(a + b)} for a, b in ((1, 2), (3, 4), (5, 6))]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = tmp_path / "run.toml"
    config.write_text(f"""
[core]
total_steps = 2
train_groups = 2
group_size = 2
[run]
engine = "torch"
trainer = "torch"
workers = 1
max_tokens = 8
dir = "{tmp_path / "runs"}"
[task]
name = "arithmetic"
reward_model = "{rm}"
reward_weights = {{ exact_match = 1.0, model = 0.5 }}
[learner]
lr = 1e-3
[rollout]
model = "{policy}"
[eval]
dataset = "{tmp_path / "eval.jsonl"}"
""")
    r = subprocess.run([sys.executable, "-m", "dora", "run", "--config", str(config)], capture_output=True, text=True,
                       timeout=560)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "dora run: reward server at http://127.0.0.1:" in r.stderr
    assert r.stderr.index("dora run: reward server at") < r.stderr.index("dora run: held-out, version 0:")
    (rundir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        parts = row["reward_components"]
        assert set(parts) == {"exact_match", "model", "reward"}, row
        assert parts["reward"] == pytest.approx(parts["exact_match"] + 0.5 * parts["model"], abs=1e-5)
    evals = [json.loads(x) for x in (rundir / "eval.jsonl").read_text().splitlines()]
    assert [(e["step"], e["by"], e["rows"]) for e in evals] == [(0, "dora run", 3), (2, "dora run", 3)], evals
    assert [e["reward_failures"] for e in evals] == [0.0, 0.0], evals  # both scored by the server
    events = [json.loads(x) for x in (rundir / "reward.log").read_text().splitlines() if x.startswith("{")]
    stopped = [e for e in events if e["event"] == "reward_stopped"]
    assert len(stopped) == 1 and stopped[0]["samples"] >= 2 * 2 * 2 + 2 * 3, events  # trained and held-out samples
