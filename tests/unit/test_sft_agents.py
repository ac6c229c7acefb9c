"""`dora sft` on an agent's task (``task.agent``): a recorded conversation is encoded token for token as the agent
episode that would have written it is recorded. The episode is run for real: the example's agent
(examples/agents/calculator.py) talks to a worker's endpoint through the openai client, its completions read by the
model family's tool-call parser, on an engine that samples the tokens the warm start trains on."""

from __future__ import annotations

import asyncio
import json
import pathlib
import time

import numpy as np
import pytest

from dora.config import ConfigError, load
from dora.config.run import RunConfig
from dora.ids import Finish
from dora.learner import sft
from dora.rollout.agents.episodes import AgentEpisodes
from dora.rollout.engines.base import Sample
from dora.tasks.prompts import TaskRun
from dora.wire import messages as m

pytest.importorskip("vllm.tool_parsers")

ROOT = pathlib.Path(__file__).resolve().parents[2]
ROWS = ROOT / "examples" / "data" / "agent-calculator" / "train.jsonl"
AGENT = "examples.agents.calculator:agent"


def agent_cfg(rows: pathlib.Path, *extra: str) -> RunConfig:
    task = [f"task.dataset={rows}", "task.prompt_field=question", "task.chat_template=true", f"task.agent={AGENT}"]
    return load(RunConfig, overrides=[*task, "task.max_episode_tokens=512", *extra])


def agent_run(model: pathlib.Path, rows: pathlib.Path) -> TaskRun:
    return TaskRun(agent_cfg(rows, "sft.trace_field=trace").task, str(model))


def rows_file(tmp_path: pathlib.Path, rows: list[dict]) -> pathlib.Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def turns_of(e: sft.Example) -> list[list[int]]:
    """The example's trained runs of tokens: the turns a model imitating it samples."""
    turns: list[list[int]] = []
    after = e.ids[e.prompt_len :]
    for k, (token, trained) in enumerate(zip(after, e.trained, strict=True)):
        if trained:
            (turns[-1].append(token) if k and e.trained[k - 1] else turns.append([token]))
    return turns


class Scripted:
    """A step engine whose sequences sample a script: each turn, the next list of tokens, whole in one step."""

    name = "scripted"
    version = 3

    def __init__(self, turns: list[list[int]]) -> None:
        self.turns = turns
        self.running: list[Sample] = []
        self.done: dict[int, int] = {}
        self.most = 0
        """Sequences in one step at most."""

    def submit(self, *, group_id, attempt, prompt, n, max_tokens, stops=frozenset(), version=None, index=0, **_):
        seq = Sample(group_id=group_id, attempt=attempt, index=index, prompt=prompt, max_tokens=max_tokens,
                     temperature=1.0, top_p=1.0, stops=stops, keep_kv=True, version=version)  # fmt: skip
        self.running.append(seq)
        return [seq]

    def extend(self, seq: Sample, tokens: list[int]) -> None:
        seq.observe(tokens)
        self.running.append(seq)

    def step(self) -> list[Sample]:
        self.most = max(self.most, len(self.running))
        ended, self.running = self.running, []
        for seq in ended:
            turn = self.turns[self.done.setdefault(id(seq), 0)]
            self.done[id(seq)] += 1
            assert len(turn) <= seq.max_tokens, "the turn fits the request's bound"
            seq.tokens += turn
            seq.logprobs += [-0.5] * len(turn)
            seq.mask += [1] * len(turn)
            seq.finish = Finish.STOP if turn[-1] in seq.stops else Finish.LENGTH
        return ended

    def cancel(self, group_id: int, attempt: int) -> None:
        self.running = [s for s in self.running if (s.group_id, s.attempt) != (group_id, attempt)]

    def __len__(self) -> int:
        return len(self.running)


async def episode(run: TaskRun, row: int, turns: list[list[int]]):
    """The agent's episode on ``row`` with the model sampling ``turns``, as the worker reports it."""
    episodes = AgentEpisodes(Scripted(turns), run)  # type: ignore[arg-type]
    gen = m.Generate(group_id=0, attempt=1, version=3, prompt_ids=np.array(run.opening, np.int32), n_samples=1,
                     max_tokens=80, seed=0)  # fmt: skip
    episodes.submit(gen, run.row_item(row))
    deadline = time.monotonic() + 20
    try:
        while time.monotonic() < deadline:
            episodes.advance()
            if done := episodes.take_finished():
                return episodes.result(done[0], 0)
            await asyncio.sleep(0.002)
        raise AssertionError("the agent never returned")
    finally:
        await episodes.close()


@pytest.mark.parametrize(("row", "calls"), [(0, 1), (1, 0)])
async def test_a_recorded_conversation_is_encoded_as_its_agent_episode_records_it(tiny_model, tmp_path, row, calls):
    """Row 0 calls calc, row 1 answers at once. The example is the group's prompt (the template's opening), then the
    episode's tokens; the loss covers exactly the turns the model samples; and the agent, reading those turns
    through the endpoint, makes the recorded calls and is scored right."""
    run = agent_run(tiny_model, rows_file(tmp_path, [json.loads(x) for x in ROWS.read_text().splitlines()[:2]]))
    e = sft.encode_conversations(run, "trace", max_answer_tokens=96).items[row]
    assert list(e.ids[: e.prompt_len]) == run.opening
    turns = turns_of(e)
    assert len(turns) == calls + 1
    r = await episode(run, row, turns)
    assert r.reward == 1.0 and r.reward_error == "" and r.finish is Finish.STOP, r.reward_error
    assert [*run.opening, *r.token_ids.tolist()] == list(e.ids)
    assert r.loss_mask.astype(bool).tolist() == list(e.trained)
    assert len(r.turns) == calls + 1
    decode = run.tokenizer.decode
    question, answer = run.rows[row].messages[-1]["content"], run.rows[row].answer
    said = [decode(t, skip_special_tokens=False) for t in turns]
    call = '<tool_call>\n{"name": "calc", "arguments": {"expression": "%s"}}\n</tool_call><|im_end|>'
    assert said == [call % question.rstrip("=")] * calls + [f"{answer}<|im_end|>"]


async def test_a_wrong_answer_recorded_is_a_wrong_answer_sampled(tiny_model, tmp_path):
    """The check can fail: the same conversation ending in another number is encoded, sampled and scored 0."""
    row = json.loads(ROWS.read_text().splitlines()[0])
    row["trace"]["messages"][-1]["content"] = str(int(row["answer"]) + 1)
    run = agent_run(tiny_model, rows_file(tmp_path, [row]))
    [e] = sft.encode_conversations(run, "trace", max_answer_tokens=96).items
    r = await episode(run, 0, turns_of(e))
    assert r.reward == 0.0 and [*run.opening, *r.token_ids.tolist()] == list(e.ids)


@pytest.mark.parametrize(
    ("trace", "fragment"),
    [
        ([{"role": "assistant", "content": "1"}], 'must be {"tools": [...], "messages": [...]}'),
        ({"messages": [{"role": "user", "content": "1+1="}]}, "ending with its last answer"),
        ({"messages": [{"role": "user", "content": "1+1="}, {"content": "2"}]}, "every message needs a role"),
        ({"tools": "calc", "messages": [{"role": "user", "content": "1"}, {"role": "assistant"}]}, "tools must be a"),
    ],
)
def test_a_malformed_conversation_is_one_line_naming_its_row(tiny_model, tmp_path, trace, fragment):
    run = agent_run(tiny_model, rows_file(tmp_path, [{"question": "1+1=", "answer": "2", "trace": trace}]))
    with pytest.raises(ConfigError, match="row 0") as e:
        sft.encode_conversations(run, "trace", max_answer_tokens=96)
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_dora_sft_on_an_agents_task_needs_the_trace_field(tiny_model, tmp_path):
    rows = rows_file(tmp_path, [json.loads(ROWS.read_text().splitlines()[0])])
    cfg = agent_cfg(rows, f"sft.model={tiny_model}", f"sft.out={tmp_path / 'o'}")
    with pytest.raises(ConfigError, match=r"an agent's task needs sft\.trace_field"):
        sft.plan(cfg)


def test_held_out_evaluation_runs_the_agents_episodes(tiny_model, tmp_path):
    """`dora run`'s before and after (and `dora eval`): each row's samples are agent episodes, scored by what the
    agent returns, not completions of the template's opening."""
    from dora.rollout.evaluate import evaluate

    rows = [json.loads(x) for x in ROWS.read_text().splitlines()[:2]]
    run = agent_run(tiny_model, rows_file(tmp_path, rows))
    right = turns_of(sft.encode_conversations(run, "trace", max_answer_tokens=96).items[0])
    out = evaluate(Scripted(right), run, samples=1, max_tokens=80, limit=1)
    assert out["accuracy"] == 1.0 and out["turns"] == 2.0 and out["reward_failures"] == 0.0
    assert out["mean_tokens"] == len(sft.encode_conversations(run, "trace", 96).items[0].ids) - len(run.opening)
    for most, together in ((1, 1), (64, 2)):  # at most one open: the second row's episode starts after the first's
        engine = Scripted(right)
        out = evaluate(engine, run, samples=1, max_tokens=80, open_episodes=most)
        assert out["rows"] == 2 and out["turns"] == 2.0 and out["reward_failures"] == 0.0
        assert 1 <= engine.most <= together  # the cap holds; two at once depends on when each agent asks


def test_the_shipped_rows_are_what_their_generator_writes(tmp_path):
    from examples.agents.rows import write_rows

    write_rows(tmp_path)
    for name in ("train", "test"):
        assert (tmp_path / f"{name}.jsonl").read_bytes() == (ROWS.parent / f"{name}.jsonl").read_bytes()
    rows = [json.loads(x) for x in ROWS.read_text().splitlines()]
    assert [bool(len(r["trace"]["messages"]) > 3) for r in rows[:4]] == [True, False, True, False]
