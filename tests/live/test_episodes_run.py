"""A live multi-turn run: broker, 2 torch or vLLM workers running guessing-game episodes, the torch learner."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

from tests.live.cluster import cluster
from tests.live.test_model_run import torch_run

pytestmark = pytest.mark.timeout(300)

GUESS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "data" / "guess" / "train.jsonl"


@pytest.mark.parametrize("engine", ["torch", pytest.param("vllm", marks=[pytest.mark.vllm, pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")])])  # fmt: skip
def test_episodes_train_with_one_version_per_turn_and_every_group_once(tmp_path, tiny_model, engine):
    steps = 4
    task = {"name": "dataset", "dataset": str(GUESS), "prompt_field": "question", "chat_template": True,
            "env": "dora.envs.guess:Guess", "max_turns": 4, "max_episode_tokens": 96, "reward": None}  # fmt: skip
    overrides = torch_run(tmp_path, tiny_model, steps, min_workers=2, max_tokens=6, task=task,
                          rollout={"kv_cache_mib": 64, "max_model_len": 1024})  # fmt: skip
    with cluster(tmp_path, overrides) as c:
        c.start_broker()
        for i in range(2):
            c.start_worker(f"w{i}", engine, "--model", str(tiny_model))
        c.spawn("learner", "learner", "--trainer", "torch", "--broker", str(tmp_path / "broker.json"))
        assert c.wait("learner", 250) == 0, c.log("learner")[-3000:] + c.log("w0")[-3000:]
        assert c.wait("broker", 15) == 0, c.log("broker")[-3000:]
        audit = c.check_exactly_once()
        # every trained episode's turns were checked against its group's version by the learner (C1 per turn)
        turns = sum(r["turns"] for r in audit)
        assert turns > 4 * 4 * steps, f"{turns} turns in {4 * 4 * steps} episodes: episodes of several turns"
        assert all(r["mixed"] == 0 for r in audit)
        published = c.events("broker", "train_step")
        assert [r["version"] for r in published] == list(range(1, steps + 1))
        assert not [r for w in ("w0", "w1") for r in c.events(w) if r.get("level") == "error"]
