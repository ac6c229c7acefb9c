"""Agent episodes on a torch worker, driven through the worker's OpenAI-compatible endpoint by the real ``openai``
client: turns recorded token-exactly on one version, streaming, the request checks, limits and failures that end an
episode and nothing else."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import openai
import pytest

from dora.config import ConfigError
from dora.config.run import TaskSection
from dora.ids import Finish
from dora.rollout.engines.base import EngineError
from dora.rollout.engines.stepped import StepWorkerEngine
from dora.rollout.engines.torch.engine import TorchEngine
from dora.samples import FinishedSample
from dora.tasks.prompts import TaskRun
from tests.engines.test_episodes import lease, run

pytestmark = pytest.mark.timeout(120)

HERE = "tests.engines.test_agents"
SEEN: dict[str, list] = {}
"""What the agents saw, per test agent (the tests read it)."""


def opening(row):
    return [{"role": "system", "content": "add the numbers"}, {"role": "user", "content": row["prompt"]}]


async def two_turns(row, client):
    """A turn, then a follow-up question streamed; rewards 0.5."""
    chat = opening(row)
    first = await client.chat.completions.create(model="policy", messages=chat, max_tokens=4)
    chat += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "sure?"}]
    text, finish, used = "", None, None
    stream = await client.chat.completions.create(model="policy", messages=chat, stream=True,
                                                  stream_options={"include_usage": True})  # fmt: skip
    async for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
        used = chunk.usage or used
    SEEN.setdefault("two_turns", []).append((first, text, finish, used))
    return 0.5


async def leaves_it_to_the_reward(row, client):
    await client.chat.completions.create(model="policy", messages=opening(row))
    return None


async def raises(row, client):
    await client.chat.completions.create(model="policy", messages=opening(row), max_tokens=3)
    raise RuntimeError("the agent broke")


async def hangs(row, client):
    await client.chat.completions.create(model="policy", messages=opening(row), max_tokens=3)
    await asyncio.sleep(30)


async def junk(row, client):
    await client.chat.completions.create(model="policy", messages=opening(row), max_tokens=3)
    return "a lot"


async def never_asks(row, client):
    return 1.0


async def talks_forever(row, client):
    """Asks again and again; the episode's limit refuses it, and the agent's error is not a failure."""
    chat = opening(row)
    while True:
        answer = await client.chat.completions.create(model="policy", messages=chat, max_tokens=3)
        chat += [answer.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "more"}]


async def breaks_the_rules(row, client):
    """Every request the endpoint must refuse, each with its reason; then one good turn. Rewards 1 per refusal
    whose message names the rule."""
    chat = opening(row)
    refused = []

    async def refused_with(text, **kwargs):
        try:
            await client.chat.completions.create(model="policy", **kwargs)
        except openai.BadRequestError as e:
            refused.append(text in str(e))
        else:
            refused.append(False)

    await refused_with("temperature", messages=chat, temperature=0.2)
    await refused_with("tool_choice", messages=chat, tool_choice="required",
                       tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}])
    await refused_with("stop strings", messages=chat, stop=["\n"])
    first = await client.chat.completions.create(model="policy", messages=chat, max_tokens=3)
    answer = first.choices[0].message.model_dump(exclude_none=True)
    edited = [chat[0], {"role": "user", "content": "something else"}, answer, {"role": "user", "content": "?"}]
    await refused_with("messages[1] is not what this episode recorded", messages=edited)
    await refused_with("a request must add messages", messages=[*chat, answer])
    SEEN.setdefault("breaks_the_rules", []).append(refused)
    return float(sum(refused))


async def calls_twice_at_once(row, client):
    chat = opening(row)
    results = await asyncio.gather(*(client.chat.completions.create(model="policy", messages=chat, max_tokens=3)
                                     for _ in range(2)), return_exceptions=True)  # fmt: skip
    SEEN.setdefault("calls_twice_at_once", []).append(results)
    return 1.0


async def calls_late(row, client):
    await client.chat.completions.create(model="policy", messages=opening(row), max_tokens=3)
    models = await client.models.list()
    SEEN.setdefault("calls_late", []).append(([x.id for x in models.data], str(client.base_url)))
    return 1.0


def worker(model, agent: str, **task) -> StepWorkerEngine:
    task.setdefault("env_timeout_s", 5.0)
    section = TaskSection(name="arithmetic", tokenizer=str(model), chat_template=True, agent=f"{HERE}:{agent}", **task)
    return StepWorkerEngine(TorchEngine(model, version=7), TaskRun(section, str(model)))


def check_recorded(w: StepWorkerEngine, r: FinishedSample) -> None:
    """Every turn is the model's, on version 7, and nothing else is trained; the opening is the group's prompt."""
    model = np.zeros(len(r.token_ids), bool)
    for start, end, version in r.turns:
        model[start:end] = True
        assert version == 7
    assert (r.loss_mask.astype(bool) == model).all() and np.all(r.logprobs[~model] == 0)
    assert r.segments.tolist() == [[7, len(r.token_ids)]]


async def test_an_agents_turns_are_recorded_token_exactly_on_one_version_and_streamed(tiny_model):
    w = worker(tiny_model, "two_turns")
    w.submit(lease(w, 3), 0.0)
    results = await run(w, until=2)
    assert [r.index for r in results] == [0, 1] and not w.busy()
    decode = w.task.tokenizer.decode
    for r, (first, text, finish, used) in zip(results, SEEN["two_turns"], strict=True):
        assert r.finish is Finish.STOP and r.reward == 0.5 and r.reward_error == "" and r.turns.shape == (2, 3)
        check_recorded(w, r)
        (a, b, _), (c, d, _) = r.turns.tolist()
        assert first.choices[0].message.content == decode(r.token_ids[a:b].tolist()[:4], skip_special_tokens=True)
        assert first.system_fingerprint == "dora-v7" and first.usage.completion_tokens == b - a == 4
        # the follow-up: the template's end of the sampled turn, the user's turn and the next start, rendered after
        # the tokens the model sampled, not re-tokenized with them
        between = decode(r.token_ids[b:c].tolist(), skip_special_tokens=False)
        assert between == "<|im_end|>\n<|im_start|>user\nsure?<|im_end|>\n<|im_start|>assistant\n", between
        full = [*w.task.prompt_ids(3).tolist(), *r.token_ids[:a].tolist()]
        assert decode(full, skip_special_tokens=False).endswith("add the numbers<|im_end|>\n<|im_start|>user\n"
                                                               f"{w.task.item(3).meta['source'].prompt}<|im_end|>\n"
                                                               "<|im_start|>assistant\n")  # fmt: skip
        # streamed as it decoded: the text is the turn's (its end token aside), with its finish and usage
        ended = r.token_ids[d - 1] in w.episodes.stops
        assert text == decode(r.token_ids[c : d - ended].tolist(), skip_special_tokens=True)
        assert finish == ("stop" if ended else "length") and used.completion_tokens == d - c


async def test_the_last_answer_is_left_to_task_reward_when_the_agent_returns_none(tiny_model):
    w = worker(tiny_model, "leaves_it_to_the_reward", reward="tests.engines.test_agents:answer_length")
    w.submit(lease(w, 4, n=1), 0.0)
    (r,) = await run(w, until=1)
    (start, end, _), = r.turns.tolist()
    text = w.task.tokenizer.decode(r.token_ids[start:end].tolist(), skip_special_tokens=True)
    assert r.reward == len(text) and r.finish is Finish.STOP


def answer_length(completion: str, item) -> float:
    assert item.prompt.endswith("="), "scored against the row, not the template's opening"
    return float(len(completion))


@pytest.mark.parametrize(
    ("agent", "reason", "policy"),
    [
        ("raises", "agent raised: RuntimeError: the agent broke", "zero"),
        ("raises", "agent raised: RuntimeError: the agent broke", "mask"),
        ("hangs", "agent timeout: no call or return within 1 s", "zero"),
        ("junk", "agent raised: TypeError: the agent returned 'a lot'", "zero"),
    ],
)
async def test_a_failing_agent_ends_its_episode_scored_zero_and_its_group_stays_whole(tiny_model, agent, reason,
                                                                                      policy):  # fmt: skip
    w = worker(tiny_model, agent, env_failure=policy, env_timeout_s=1.0)
    w.submit(lease(w, 6), 0.0)
    results = await run(w, until=2)
    assert [r.index for r in results] == [0, 1], "the group is still whole"
    for r in results:
        assert r.finish is Finish.STOP and r.reward == 0.0 and r.reward_error.startswith(reason), r.reward_error
        assert r.reward_components["agent_failed"] == 1.0
        assert r.loss_mask.any() == (policy == "zero") and len(r.turns) == (policy == "zero")
    assert sum(w.episodes.failures.values()) == 2
    w2 = worker(tiny_model, "two_turns")  # the worker's loop and endpoint live on
    w2.submit(lease(w2, 8, n=1), 0.0)
    assert len(await run(w2, until=1)) == 1


async def test_an_agent_that_never_asks_is_an_episode_of_no_tokens(tiny_model):
    w = worker(tiny_model, "never_asks")
    w.submit(lease(w, 5, n=1), 0.0)
    (r,) = await run(w, until=1)
    assert r.reward == 1.0 and len(r.token_ids) == 0 and r.turns.shape == (0, 3) and r.reward_error == ""


async def test_the_episode_limits_refuse_the_request_past_them_and_end_the_episode_there(tiny_model):
    w = worker(tiny_model, "talks_forever", max_turns=3)
    w.submit(lease(w, 7, n=1), 0.0)
    (r,) = await run(w, until=1)
    assert r.finish is Finish.LENGTH and len(r.turns) == 3 and r.reward_error == ""
    check_recorded(w, r)
    w = worker(tiny_model, "talks_forever", max_episode_tokens=60)
    w.submit(lease(w, 7, n=1), 0.0)
    (r,) = await run(w, until=1)
    assert r.finish is Finish.LENGTH and len(r.token_ids) <= 60 and len(r.turns) >= 1 and r.reward_error == ""


async def test_requests_outside_the_runs_distribution_or_its_record_are_refused_with_the_reason(tiny_model):
    w = worker(tiny_model, "breaks_the_rules")
    w.submit(lease(w, 9, n=1), 0.0)
    (r,) = await run(w, until=1)
    assert SEEN["breaks_the_rules"][-1] == [True] * 5 and r.reward == 5.0 and len(r.turns) == 1
    assert w.episodes.stats["refused"] == 5


async def test_an_episodes_calls_come_one_at_a_time_and_calls_after_its_end_find_nothing(tiny_model):
    w = worker(tiny_model, "calls_twice_at_once")
    w.submit(lease(w, 10, n=1), 0.0)
    w.paused = True  # the first call waits for the engine, so the second surely finds it in progress
    deadline = time.monotonic() + 30
    while w.episodes.stats["refused"] < 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    w.paused = False
    (r,) = await run(w, until=1)
    results = SEEN["calls_twice_at_once"][-1]
    assert sum(isinstance(x, openai.ConflictError) for x in results) == 1 and len(r.turns) == 1
    w = worker(tiny_model, "calls_late")
    w.submit(lease(w, 10, n=1), 0.0)
    await run(w, until=1)
    names, address = SEEN["calls_late"][-1]
    assert names == ["dora"]
    client = openai.AsyncOpenAI(base_url=address, api_key="dora", max_retries=0)
    with pytest.raises(openai.NotFoundError, match="no episode is open at this address"):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert w.episodes.stats["late_calls"] == 1


async def test_agent_episodes_never_migrate(tiny_model):
    w = worker(tiny_model, "hangs", env_timeout_s=5.0)
    w.submit(lease(w, 11, n=1), 0.0)
    with pytest.raises(EngineError, match="never migrate"):
        w.export(11, 1, 0.0)
    w.cancel(11, 1, 0.0)
    assert not w.busy()


def test_an_agent_must_be_an_async_function(tiny_model):
    with pytest.raises(ConfigError, match="must be an async function"):
        worker(tiny_model, "answer_length")
    with pytest.raises(ConfigError, match=r"needs task\.chat_template"):
        TaskSection(name="arithmetic", tokenizer=str(tiny_model), agent=f"{HERE}:two_turns")


CALC = {"type": "function", "function": {"name": "calc", "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}  # fmt: skip


async def test_a_tool_call_the_model_writes_is_answered_in_openai_form_and_its_result_rendered_after_it(tiny_model):
    """The model's turn holds a call in its family's format (dora's tiny model: Hermes ``<tool_call>``): it is
    answered as an OpenAI tool call and recorded; the tool's result, sent back as a ``tool`` message, is rendered by
    the chat template right after the tokens the model wrote (not a re-rendering of the call)."""
    from dora.rollout.agents import openai_api as api
    from dora.rollout.agents.episodes import AgentEpisode
    from dora.rollout.engines.base import Sample

    w = worker(tiny_model, "two_turns")
    agents, run = w.episodes, w.task
    chat = [{"role": "system", "content": "use calc"}, {"role": "user", "content": "48213+9071="}]
    first = api.read_request({"messages": chat, "tools": [CALC]}, temperature=1.0, top_p=1.0)
    ep = AgentEpisode(group_id=1, attempt=1, index=0, version=7, item=run.item(1), token="t", seed=1,
                      temperature=1.0, top_p=1.0, turn_tokens=64, budget=1024)  # fmt: skip
    ask = agents._first(ep, first)
    assert ask.tokens == run.encode(run.renderer.render(chat, tools=[CALC])) and ask.tokens[:1] == run.opening
    wrote = '<tool_call>\n{"name": "calc", "arguments": {"expression": "48213+9071"}}\n</tool_call>'
    end = run.tokenizer.token_to_id("<|im_end|>")
    ep.seq = Sample(group_id=1, attempt=1, index=0, prompt=ask.tokens, max_tokens=64, temperature=1.0, top_p=1.0,
                    tokens=[*run.encode(wrote), end], finish=Finish.STOP, version=7)  # fmt: skip
    content, calls = agents.read_turn(ep.seq, 0, len(ep.seq.tokens), first)
    assert content is None and [c["function"]["name"] for c in calls] == ["calc"]
    assert calls[0]["function"]["arguments"] == '{"expression": "48213+9071"}' and calls[0]["id"]
    ep.chat = [*first.messages, api.message(api.answer(content, calls), 2)]
    ep.turns = [(0, len(ep.seq.tokens), 7)]
    # the agent appends the answer as the client returns it, then the tool's result
    echoed = {"role": "assistant", "content": None, "refusal": None, "tool_calls": calls}
    result = {"role": "tool", "tool_call_id": calls[0]["id"], "content": "57284"}
    follow = api.read_request({"messages": [*chat, echoed, result], "tools": [CALC]}, temperature=1.0, top_p=1.0)
    ask = agents._next(ep, follow)
    after = run.tokenizer.decode(ask.tokens, skip_special_tokens=False)
    assert after == "\n<|im_start|>tool\n57284<|im_end|>\n<|im_start|>assistant\n", after
    changed = api.read_request({"messages": [*chat, echoed, result], "tools": []}, temperature=1.0, top_p=1.0)
    with pytest.raises(api.Refused, match="tools differ"):
        agents._next(ep, changed)
