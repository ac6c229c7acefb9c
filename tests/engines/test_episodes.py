"""Multi-turn episodes on a torch worker: turns, environment calls beside decoding, observations rendered with the
chat template (loss mask 0), one version per turn, failures that end an episode and nothing else, and an
episode migrated between turns continuing exactly as it would have."""

from __future__ import annotations

import asyncio
import dataclasses
import pathlib
import time

import numpy as np
import pytest

from dora.config import ConfigError
from dora.config.run import TaskSection
from dora.ids import Finish
from dora.rollout.engines.stepped import StepWorkerEngine
from dora.rollout.engines.torch.engine import TorchEngine
from dora.samples import FinishedSample
from dora.tasks.prompts import TaskRun
from dora.wire import messages as m

pytestmark = pytest.mark.timeout(120)

HERE = "tests.engines.test_episodes"


class Counting:
    """Answers every turn with its number; done after three turns, rewarding 0.5 per turn."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, item):
        return [{"role": "system", "content": "count"}, {"role": "user", "content": item.prompt}]

    async def step(self, action):
        self.turns += 1
        await asyncio.sleep(0.01)
        return [{"role": "tool", "content": f"turn {self.turns}"}], 0.5, self.turns >= 3


class Slow(Counting):
    async def step(self, action):
        await asyncio.sleep(0.3)
        return [{"role": "tool", "content": "ok"}], 1.0, True


class Raises(Counting):
    def step(self, action):
        raise RuntimeError("tool crashed")


class Hangs(Counting):
    def step(self, action):
        time.sleep(1.0)
        return [], 1.0, True


class HangsForever(Counting):
    def step(self, action):
        time.sleep(3600)


class Junk(Counting):
    async def step(self, action):
        return [{"role": 3}], 1.0, False


class BadReset(Counting):
    def reset(self, item):
        raise KeyError("no such item")


class NoStep:
    def reset(self, item):
        return []


def worker(model, env: str, **task) -> StepWorkerEngine:
    task.setdefault("env_timeout_s", 0.3)
    section = TaskSection(name="arithmetic", tokenizer=str(model), chat_template=True, env=f"{HERE}:{env}", **task)
    run = TaskRun(section, str(model))
    return StepWorkerEngine(TorchEngine(model, version=7), run)


def lease(w: StepWorkerEngine, group: int, n: int = 2, max_tokens: int = 6) -> m.Generate:
    return m.Generate(group_id=group, attempt=1, version=7, prompt_ids=w.task.prompt_ids(group), n_samples=n,
                      max_tokens=max_tokens, seed=group)  # fmt: skip


async def run(w: StepWorkerEngine, *, until: int) -> list[FinishedSample]:
    out: list[FinishedSample] = []
    deadline = time.monotonic() + 60
    while len(out) < until and time.monotonic() < deadline:
        w.advance(0.0)
        out += [w.result(s, 0) for s in w.take_finished()]
        await asyncio.sleep(w.next_event_s() or 0)
    return sorted(out, key=lambda r: (r.group_id, r.index))


async def test_an_episode_is_turns_and_rendered_observations_on_one_version(tiny_model):
    w = worker(tiny_model, "Counting")
    w.submit(lease(w, 3), 0.0)
    results = await run(w, until=2)
    assert not w.busy() and [r.index for r in results] == [0, 1]
    for r in results:
        assert r.finish is Finish.STOP and r.reward == pytest.approx(1.5) and r.reward_error == ""
        assert r.turns.shape == (3, 3) and set(r.turns[:, 2].tolist()) == {7}
        model = np.zeros(len(r.token_ids), bool)
        for start, end, _ in r.turns:
            model[start:end] = True
        assert (r.loss_mask == model).all() and np.all(r.logprobs[~model] == 0)
        decode = w.task.tokenizer.decode
        for i, ((_, end, _), (start, _, _)) in enumerate(zip(r.turns[:-1], r.turns[1:], strict=True)):
            said = decode(r.token_ids[end:start].tolist(), skip_special_tokens=False)
            # the template's end of the model's turn (unless the model ended it), the tool's turn, the next start
            assert said.endswith(f"<|im_start|>tool\nturn {i + 1}<|im_end|>\n<|im_start|>assistant\n"), said
        assert r.reward_components == {"turns": 3.0, "env_failed": 0.0}


async def test_a_turn_budget_and_the_episode_budget_end_episodes(tiny_model):
    w = worker(tiny_model, "Counting", max_turns=2)
    w.submit(lease(w, 4), 0.0)
    for r in await run(w, until=2):
        assert r.finish is Finish.LENGTH and len(r.turns) == 2 and r.reward == pytest.approx(1.0)
    w = worker(tiny_model, "Counting", max_episode_tokens=20)
    w.submit(lease(w, 4), 0.0)
    for r in await run(w, until=2):
        assert r.finish is Finish.LENGTH and len(r.token_ids) <= 20 and len(r.turns) >= 1


async def test_decoding_goes_on_while_an_episode_waits_on_its_tool(tiny_model):
    w = worker(tiny_model, "Slow", env_timeout_s=5.0)
    w.submit(lease(w, 5, n=1, max_tokens=3), 0.0)
    while not w.episodes.waiting():
        w.advance(0.0)
        await asyncio.sleep(0)
    assert len(w.engine) == 0, "a waiting episode holds no decode slot"
    w.engine.submit(group_id=-99, attempt=1, prompt=[5, 6, 7], n=4, max_tokens=10_000)  # other work
    before, started = w.engine.tokens_generated, time.monotonic()
    while w.episodes.waiting():
        w.advance(0.0)
        await asyncio.sleep(0)
    assert time.monotonic() - started > 0.2 and w.engine.tokens_generated - before > 8
    w.engine.cancel(-99, 1)
    (r,) = await run(w, until=1)
    assert r.reward == 1.0 and r.finish is Finish.STOP


@pytest.mark.parametrize(
    ("env", "reason"),
    [
        ("Raises", "env raised: RuntimeError: tool crashed"),
        ("Hangs", "env timeout: no answer within 0.3 s"),
        ("Junk", "env malformed: step: turn 0 is not a {role: str, content: str} dict"),
        ("BadReset", "env raised: KeyError: 'no such item'"),
    ],
)
@pytest.mark.parametrize("policy", ["zero", "mask"])
async def test_a_failing_environment_ends_its_episode_scored_zero_and_counted(tiny_model, env, reason, policy):
    w = worker(tiny_model, env, env_failure=policy)
    w.submit(lease(w, 6), 0.0)
    results = await run(w, until=2)
    assert [r.index for r in results] == [0, 1], "the group is still whole"
    for r in results:
        assert r.finish is Finish.STOP and r.reward == 0.0 and r.reward_error.startswith(reason), r.reward_error
        assert r.reward_components["env_failed"] == 1.0
        assert r.loss_mask.any() == (policy == "zero") and len(r.turns) == (policy == "zero")
    assert sum(w.episodes.failures.values()) == 2
    w.submit(lease(w, 8), 0.0)  # the worker lives on
    assert len(await run(w, until=2)) == 2


async def test_an_episode_migrated_between_turns_continues_exactly(tiny_model):
    """The reference runs group 9 on one worker; the other run hands it to a second worker after its first turn
    (one episode waiting on its tool, or both) and finishes there: same tokens, mask, turns, rewards."""
    ref = worker(tiny_model, "Counting")
    ref.submit(lease(ref, 9), 0.0)
    expected = await run(ref, until=2)
    src, dst = worker(tiny_model, "Counting"), worker(tiny_model, "Counting")
    src.submit(lease(src, 9), 0.0)
    while not any(ep.turns for ep in src.episodes.open.values()):
        src.advance(0.0)
        await asyncio.sleep(0)
    states = src.export(9, 1, 0.0)
    assert not src.busy() and any(len(s.turns) for s in states)
    dst.import_(m.MigrateIn(group_id=9, attempt=1, version=7, source="src", prompt_ids=src.task.prompt_ids(9),
                            requests=tuple(states), max_tokens=6), 0.0)  # fmt: skip
    got = await run(dst, until=2)
    for a, b in zip(expected, got, strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist() and a.loss_mask.tolist() == b.loss_mask.tolist()
        assert a.turns.tolist() == b.turns.tolist() and a.reward == b.reward and a.finish == b.finish
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)


def test_a_bad_environment_spec_is_one_clear_error(tiny_model):
    with pytest.raises(ConfigError, match=r"task\.env 'nowhere:Env'"):
        TaskRun(TaskSection(name="arithmetic", tokenizer=str(tiny_model), chat_template=True, env="nowhere:Env"),
                str(tiny_model))  # fmt: skip
    with pytest.raises(ConfigError, match=r"no step\(\) method"):
        TaskRun(TaskSection(name="arithmetic", tokenizer=str(tiny_model), chat_template=True,
                            env=f"{HERE}:NoStep"), str(tiny_model))  # fmt: skip
    with pytest.raises(ConfigError, match=r"needs task\.chat_template"):
        TaskSection(name="arithmetic", env=f"{HERE}:Counting")
    with pytest.raises(ConfigError, match="not a token"):
        worker(tiny_model, "Counting", turn_end=("not one token",))
    with pytest.raises(ConfigError, match="env_failure"):
        dataclasses.replace(TaskSection(), env_failure="drop")


GUESS = pathlib.Path(__file__).resolve().parents[2] / "examples" / "data" / "guess" / "test.jsonl"


class Oracle:
    """The guessing game, answered right at once when the turn says the secret's parity matches (reward 1), and
    never otherwise: a success rate the test knows from the secrets alone."""

    def __init__(self) -> None:
        self.secret = 0

    def reset(self, item):
        self.secret = int(item.answer)
        return [{"role": "user", "content": item.prompt}]

    def step(self, action):
        return [], float(self.secret % 2 == 0), True


def test_held_out_evaluation_of_an_environment_scores_its_episodes(tiny_model):
    from dora.rollout.evaluate import evaluate

    section = TaskSection(dataset=str(GUESS), prompt_field="question", tokenizer=str(tiny_model), chat_template=True,
                          env=f"{HERE}:Oracle")  # fmt: skip
    task = TaskRun(section, str(tiny_model))
    out = evaluate(TorchEngine(tiny_model, version=0), task, max_tokens=4, limit=20)
    even = sum(int(r.answer) % 2 == 0 for r in task.rows[:20])
    assert out["rows"] == 20 and out["accuracy"] == even / 20 and out["turns"] == 1.0 and out["reward_failures"] == 0


async def test_a_workers_evaluation_round_runs_episodes(tiny_model):
    section = TaskSection(dataset=str(GUESS), prompt_field="question", tokenizer=str(tiny_model), chat_template=True,
                          env=f"{HERE}:Oracle")  # fmt: skip
    task = TaskRun(section, str(tiny_model))
    w = StepWorkerEngine(TorchEngine(tiny_model, version=3), task, held_out=task)
    for row in range(4):
        assert w.evaluate(m.Evaluate(version=3, round=1, row=row, prompt_ids=task.prompt_ids(row), n_samples=2,
                                     max_tokens=4, temperature=1.0, seed=row), 0.0)  # fmt: skip
    got = []
    while len(got) < 4:
        w.advance(0.0)
        got += w.take_evaluated()
        await asyncio.sleep(0.002)
    assert not w.take_finished(), "evaluation is never training traffic"
    for e in sorted(got, key=lambda e: e.row):
        assert e.rewards.tolist() == [float(int(task.rows[e.row].answer) % 2 == 0)] * 2 and e.failed == 0


def test_a_blocking_call_that_never_returns_does_not_hold_the_worker_at_exit(tiny_model):
    import subprocess
    import sys

    script = f"""
import asyncio, pathlib
from tests.engines import test_episodes as t

async def main():
    w = t.worker(pathlib.Path({str(tiny_model)!r}), "HangsForever")
    w.submit(t.lease(w, 6), 0.0)
    print(sorted({{r.reward_error for r in await t.run(w, until=2)}}))

asyncio.run(main())
"""
    root = pathlib.Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=root, timeout=90)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "['env timeout: no answer within 0.3 s']"


def test_dora_run_refuses_a_bad_environment_in_one_line(tiny_model, tmp_path, capsys, monkeypatch):
    """Through `dora run`'s own ``main``, in this process: a process of its own costs seconds of imports and checks
    nothing more (tests/unit/test_model_names.py has `dora run`'s one line of bad input as a process); an exception
    instead of the line fails the test here as a traceback would."""
    from dora.launch.run import main

    root = pathlib.Path(__file__).resolve().parents[2]
    monkeypatch.chdir(root)
    code = main(["--config", str(root / "examples/envs/guess.toml"), "--set", "task.env=nowhere:Env",
                 "--set", f"rollout.model={tiny_model}", "--set", f"run.dir={tmp_path}",
                 "--set", f"task.dataset={GUESS}"])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "Traceback" not in err
    assert err.strip().splitlines()[-1] == "dora run: task.env 'nowhere:Env': No module named 'nowhere'"
