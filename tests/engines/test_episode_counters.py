"""A torch step worker's counters of its episodes (``StepWorkerEngine.counters``, sent in its heartbeats): an agent
worker's completions served, requests refused, calls after their episode ended and failed episodes; an environment
worker's failed episodes; none for a worker of plain samples scored by a rule."""

from __future__ import annotations

import openai
import pytest

from dora.config.run import TaskSection
from dora.rollout.engines.stepped import StepWorkerEngine
from dora.rollout.engines.torch.engine import TorchEngine
from dora.tasks.prompts import TaskRun
from tests.engines import test_agents as agents
from tests.engines import test_episodes as episodes

pytestmark = pytest.mark.timeout(120)


async def test_an_agent_workers_counters_are_what_its_endpoint_served_refused_and_failed(tiny_model):
    w = agents.worker(tiny_model, "breaks_the_rules")
    assert w.counters() == {"agent_completions": 0, "agent_refused": 0, "agent_late_calls": 0, "agent_failed": 0,
                            "agent_tool_calls_unread": 0}
    w.submit(agents.lease(w, 9, n=1), 0.0)
    (r,) = await agents.run(w, until=1)
    assert r.reward == 5.0  # five refusals, each with its reason, then one turn
    assert w.counters() == {"agent_completions": 1, "agent_refused": 5, "agent_late_calls": 0, "agent_failed": 0,
                            "agent_tool_calls_unread": 0}

    w = agents.worker(tiny_model, "raises")
    w.submit(agents.lease(w, 3, n=2), 0.0)
    await agents.run(w, until=2)
    assert w.counters() == {"agent_completions": 2, "agent_refused": 0, "agent_late_calls": 0, "agent_failed": 2,
                            "agent_tool_calls_unread": 0}

    w = agents.worker(tiny_model, "calls_late")
    w.submit(agents.lease(w, 10, n=1), 0.0)
    await agents.run(w, until=1)
    _, address = agents.SEEN["calls_late"][-1]
    client = openai.AsyncOpenAI(base_url=address, api_key="dora", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "hi"}])
    assert w.counters()["agent_late_calls"] == 1


async def test_an_environment_workers_counters_are_its_failed_episodes_and_a_plain_worker_has_none(tiny_model):
    w = episodes.worker(tiny_model, "Raises")
    assert w.counters() == {"env_failed": 0}
    w.submit(episodes.lease(w, 6), 0.0)
    await episodes.run(w, until=2)
    assert w.counters() == {"env_failed": 2}
    plain = StepWorkerEngine(TorchEngine(tiny_model, version=7), TaskRun(TaskSection(name="arithmetic"),
                                                                         str(tiny_model)))  # fmt: skip
    assert plain.counters() == {}
