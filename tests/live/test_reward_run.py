"""`dora run` with a reward model: it starts `dora reward` first, points the workers at it, weighs its score with a
rule reward, and stops it by PID at the end; each source's mean is in every step's metrics. Tiny random models
(tests/unit/test_reward_server.py builds them): a Qwen2 policy and a one-label Qwen2 reward model sharing a tokenizer.
Slow: four torch processes on CPU."""

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
""")
    r = subprocess.run([sys.executable, "-m", "dora", "run", "--config", str(config)], capture_output=True, text=True,
                       timeout=560)  # fmt: skip
    assert r.returncode == 0, r.stderr[-4000:]
    assert "dora run: reward server at http://127.0.0.1:" in r.stderr
    (rundir,) = (tmp_path / "runs").iterdir()
    rows = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for row in rows:
        parts = row["reward_components"]
        assert set(parts) == {"exact_match", "model", "reward"}, row
        assert parts["reward"] == pytest.approx(parts["exact_match"] + 0.5 * parts["model"], abs=1e-5)
    events = [json.loads(x) for x in (rundir / "reward.log").read_text().splitlines() if x.startswith("{")]
    stopped = [e for e in events if e["event"] == "reward_stopped"]
    assert len(stopped) == 1 and stopped[0]["samples"] >= 2 * 2 * 2, events  # every trained sample scored there
