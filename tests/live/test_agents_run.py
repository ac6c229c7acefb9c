"""A live run of agent episodes: broker, two torch workers serving a tool-calling agent through their OpenAI-compatible
endpoints (the real ``openai`` client), and the torch learner checking every turn's version."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import time

import pytest
import structlog

from dora.envs.calculator import evaluate
from tests.live.cluster import cluster
from tests.live.test_model_run import torch_run

pytestmark = pytest.mark.timeout(300)

CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate a sum or product of integers.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}  # fmt: skip


async def ask(client, chat: list, stream: bool) -> tuple[int, dict, int]:
    """One completion, streamed or not: the version that served it, the answer as a message to send back, and the
    chunks its content came in."""
    if not stream:
        answer = await client.chat.completions.create(model="policy", messages=chat, tools=[CALC])
        return int(answer.system_fingerprint.removeprefix("dora-v")), answer.choices[0].message.model_dump(
            exclude_none=True), 1  # fmt: skip
    content, calls, fingerprint, pieces = "", {}, "", 0
    async for chunk in await client.chat.completions.create(model="policy", messages=chat, tools=[CALC], stream=True):
        fingerprint = chunk.system_fingerprint or fingerprint
        for choice in chunk.choices:
            content += choice.delta.content or ""
            pieces += bool(choice.delta.content)
            for c in choice.delta.tool_calls or []:
                empty = {"id": "", "type": "function", "function": {"name": "", "arguments": ""}}
                call = calls.setdefault(c.index, empty)
                call["id"] = c.id or call["id"]
                call["function"]["name"] += (c.function and c.function.name) or ""
                call["function"]["arguments"] += (c.function and c.function.arguments) or ""
    message = {"role": "assistant", "content": content or None}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return int(fingerprint.removeprefix("dora-v")), message, pieces


async def agent(row, client):
    """The calculator as an OpenAI function tool. Its results take 0.4 to 1.6 s, by row (a slow tool keeps episodes
    open across the learner's steps, some longer than others), and an answer without a call is asked once more to
    use the tool: three completions at most. Each completion is logged with the version that served it (the
    answer's system_fingerprint). A third of the rows stream their completions (the answer assembled from the
    chunks, tool calls included, is what the next request sends back), and every fifth row's agent breaks after its
    first answer."""
    log = structlog.get_logger()
    chat = [{"role": "system", "content": "Use calc."}, {"role": "user", "content": row["prompt"]}]
    stream = row["index"] % 3 == 1
    for turn in range(3):
        version, msg, pieces = await ask(client, chat, stream)
        log.info("test_agent_completion", row=row["index"], turn=turn, version=version, at=time.time(), stream=stream,
                 pieces=pieces)  # fmt: skip
        if row["index"] % 5 == 4:
            raise RuntimeError("the agent broke")
        chat.append(msg)
        if msg.get("tool_calls"):
            for call in msg["tool_calls"]:
                try:
                    said = str(evaluate(json.loads(call["function"]["arguments"])["expression"]))
                except (ValueError, KeyError, TypeError) as e:
                    said = f"error: {e}"
                chat.append({"role": "tool", "tool_call_id": call["id"], "content": said})
        else:
            chat.append({"role": "user", "content": "Use calc."})
        await asyncio.sleep(0.4 * (1 + row["index"] % 4))
    return float(row["answer"] in (chat[-2].get("content") or ""))


def test_agents_of_two_versions_on_two_workers_train_with_one_version_per_turn_and_never_migrate(tmp_path, tiny_model):
    steps = 5
    task = {"name": "arithmetic", "chat_template": True, "agent": f"{__name__}:agent", "max_turns": 3,
            "max_episode_tokens": 512, "reward": None, "env_timeout_s": 10.0}  # fmt: skip
    overrides = torch_run(tmp_path, tiny_model, steps, min_workers=2, max_tokens=8, task=task,
                          rollout={"max_slots": 16, "credit_slots": 16})  # fmt: skip
    # four groups a worker at once: both workers hold groups when a version is published, and the one whose episodes
    # end first moves to it while the other's, of the older version, go on
    with cluster(tmp_path, overrides, fork=True) as c:
        c.start_broker()
        for i in range(2):
            c.start_worker(f"w{i}", "torch", "--model", str(tiny_model))
        c.spawn("learner", "learner", "--trainer", "torch", "--broker", str(tmp_path / "broker.json"))
        assert c.wait("learner", 250) == 0, c.log("learner")[-3000:] + c.log("w0")[-3000:]
        assert c.wait("broker", 15) == 0, c.log("broker")[-3000:]
        audit = c.check_exactly_once()
        # every trained episode's turns were checked against its group's version by the learner (C1 per turn)
        assert all(r["mixed"] == 0 for r in audit) and sum(r["turns"] for r in audit) >= 2 * 4 * 4 * steps
        assert [r["version"] for r in c.events("broker", "train_step")] == list(range(1, steps + 1))
        assert not c.events("broker", "migration"), "an agent's episode moved"
        served = {w: c.events(w, "test_agent_completion") for w in ("w0", "w1")}
        assert all(served.values()), "both workers served agents"
        # episodes of two versions open at once, on the two workers: one worker answered v while the other answered
        # another version within that span
        spans = {(w, r["version"]): [] for w, rows in served.items() for r in rows}
        for w, rows in served.items():
            for r in rows:
                spans[(w, r["version"])].append(r["at"])
        overlapping = [(a, b) for a in spans for b in spans if a[0] < b[0] and a[1] != b[1]
                       and min(spans[a]) < max(spans[b]) and min(spans[b]) < max(spans[a])]  # fmt: skip
        assert overlapping, {k: (min(v), max(v)) for k, v in spans.items()}
        # streamed answers were sent back and extended (a third turn of a streamed row); the only failures are the
        # broken agents', whose groups were trained whole with the rest (check_exactly_once)
        rows = [r for rows in served.values() for r in rows]
        assert any(r["stream"] and r["turn"] == 2 for r in rows), rows
        assert any(r["stream"] and r["pieces"] > 1 for r in rows), "content streamed as it decoded, tools offered"
        failed = [e for w in ("w0", "w1") for e in c.events(w, "agent_failed")]
        assert failed and all(e["reason"].startswith("agent raised: RuntimeError: the agent broke") for e in failed)
        for w in ("w0", "w1"):
            assert not [r for r in c.events(w) if r.get("level") == "error"], c.log(w)[-2000:]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="the vllm extra is not installed")
def test_agents_on_vllm_workers_train_with_one_version_per_turn(tmp_path, tiny_model):
    """The same agent on two vLLM workers (slow: vLLM on the CPU; the default run's live agents run on torch workers,
    and tests/zoo/test_turns.py checks vLLM ends turns where the torch engine does): streamed and broken agents
    included, every turn checked by the learner, every group trained once, nothing migrated."""
    steps = 3
    task = {"name": "arithmetic", "chat_template": True, "agent": f"{__name__}:agent", "max_turns": 3,
            "max_episode_tokens": 512, "reward": None, "env_timeout_s": 30.0}  # fmt: skip
    overrides = torch_run(tmp_path, tiny_model, steps, min_workers=2, max_tokens=8, task=task,
                          rollout={"max_slots": 16, "credit_slots": 16, "kv_cache_mib": 64,
                                   "max_model_len": 1024})  # fmt: skip
    with cluster(tmp_path, overrides, fork=True) as c:
        c.start_broker()
        for i in range(2):
            c.start_worker(f"w{i}", "vllm", "--model", str(tiny_model))
        c.spawn("learner", "learner", "--trainer", "torch", "--broker", str(tmp_path / "broker.json"))
        assert c.wait("learner", 280) == 0, c.log("learner")[-3000:] + c.log("w0")[-3000:]
        assert c.wait("broker", 15) == 0, c.log("broker")[-3000:]
        audit = c.check_exactly_once()
        assert all(r["mixed"] == 0 for r in audit) and sum(r["turns"] for r in audit) >= 2 * 4 * 4 * steps
        assert not c.events("broker", "migration"), "an agent's episode moved"
        rows = [r for w in ("w0", "w1") for r in c.events(w, "test_agent_completion")]
        assert any(r["stream"] and r["turn"] >= 1 for r in rows), rows
        failed = [e for w in ("w0", "w1") for e in c.events(w, "agent_failed")]
        assert all(e["reason"].startswith("agent raised: RuntimeError: the agent broke") for e in failed), failed
        assert not [r for w in ("w0", "w1") for r in c.events(w) if r.get("level") == "error"]
