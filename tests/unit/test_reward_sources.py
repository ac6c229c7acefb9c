"""Reward sources weighed together (dora.tasks.combine) against a stand-in `dora reward` on 127.0.0.1, the batcher of
`dora reward` (dora.reward.batcher) and the judge's parser, all without torch: each source's value a component
that reaches the broker's step metrics, a step's samples in one POST, a failed source scoring 0 with its reason, and
the config's mistakes as one line. tests/unit/test_reward_server.py runs `dora reward` itself on tiny models."""

from __future__ import annotations

import concurrent.futures
import pathlib
import re
import subprocess
import sys
import threading
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from dora.broker.metrics import batch_stats
from dora.config import ConfigError, build
from dora.config.run import RunConfig, TaskSection
from dora.ids import AttemptId, Finish, GroupId
from dora.launch.local import LocalRun
from dora.launch.run import follow
from dora.reward.batcher import Batcher
from dora.reward.judge import fill, parse_score
from dora.samples import FinishedSample
from dora.tasks import combine, rewards
from dora.tasks.tasks import Item
from dora.wire import packed
from tests.unit.test_remote_reward import Service


def served(_call: int, requests: list[dict[str, Any]]) -> tuple[int, Any]:
    """A stand-in `dora reward`: model = the completion's length, judge = 0.25; "judge?" has no number."""
    results: list[dict[str, Any]] = []
    for r in requests:
        if r["completion"] == "judge?":
            results.append({"id": r["id"], "error": "the judge's answer holds no number: 'good'"})
        else:
            results.append({"id": r["id"], "components": {"model": float(len(r["completion"])), "judge": 0.25}})
    return 200, {"results": results}


@pytest.fixture
def service() -> Iterator[Service]:
    running = Service(served)
    yield running
    running.close()


def item(answer: str) -> Item:
    return Item(task="arithmetic", index=0, prompt="<|im_start|>user\n3 + 4 =<|im_end|>\n", answer=answer)


def task(**kw: Any) -> TaskSection:
    return TaskSection(name="arithmetic", reward_model="rm", reward_judge="judge", **kw)


def test_each_source_is_a_component_and_the_reward_their_weighted_sum(service: Service) -> None:
    fn = combine.resolve(task(reward_weights={"exact": 1.0, "model": 0.5, "judge": 2.0}, reward_server=service.url),
                         None)  # fmt: skip
    assert isinstance(fn, combine.Combined)
    pairs = [("= 7", item("7")), ("= 8", item("7")), ("judge?", item("7")), ("= 7", item("7"))]
    scored = rewards.score_many(fn, pairs, timeout_s=5.0)
    assert sum(len(b) for b in service.batches) == 4  # queued at once: one POST unless the client's 5 ms wait ran out
    assert scored[0] == rewards.Scored(1.0 + 0.5 * 3 + 2.0 * 0.25, "", {"exact": 1.0, "model": 3.0, "judge": 0.25,
                                                                     "reward": 3.0})  # fmt: skip
    assert scored[1].reward == 0.0 + 1.5 + 0.5 and scored[1].components["exact"] == 0.0
    assert scored[2].reward == 0.0 and scored[2].components == {}
    assert "dora reward" in scored[2].reason and "holds no number" in scored[2].reason
    assert service.batches[0][0]["prompt"] == item("7").prompt  # the prompt as the policy saw it, rendered
    # one at a time (held-out evaluation, a custom task's fallback) gives the same
    assert rewards.score(fn, "= 7", item("7"), timeout_s=5.0) == scored[0]
    fn.close()


def test_the_components_reach_the_broker_step_metrics(service: Service) -> None:
    fn = combine.resolve(task(reward_weights={"exact": 1.0, "model": 0.5, "judge": 2.0}, reward_server=service.url),
                         None)  # fmt: skip
    assert isinstance(fn, combine.Combined)
    scored = rewards.score_many(fn, [("= 7", item("7")), ("= 10", item("7"))], timeout_s=5.0)
    fn.close()
    samples = [FinishedSample(group_id=GroupId(0), attempt=AttemptId(0), index=i,
                              segments=np.array([[0, 1]], dtype=np.int32), token_ids=np.array([5], dtype=np.int32),
                              logprobs=np.zeros(1, dtype=np.float32), reward=s.reward, finish=Finish.STOP,
                              reward_components=s.components, reward_error=s.reason)
               for i, s in enumerate(scored)]  # fmt: skip
    heads = packed.pack_samples(samples).samples
    group = types.SimpleNamespace(samples=[types.SimpleNamespace(payload=(h,)) for h in heads])
    _, row = batch_stats([group])  # type: ignore[list-item]
    assert row["reward_components"] == {"exact": 0.5, "judge": 0.25, "model": 3.5, "reward": 2.75}
    assert row["reward_failed"] == 0


def test_a_served_source_alone_is_the_reward_and_a_missing_server_is_a_reason(service: Service) -> None:
    alone = combine.resolve(TaskSection(name="arithmetic", reward_model="rm", reward_server=service.url), "exact")
    assert alone is not None
    assert rewards.score_many(alone, [("abcd", item("7"))])[0] == rewards.Scored(4.0, "", {"model": 4.0,
                                                                                            "reward": 4.0})  # fmt: skip
    assert alone("ab", item("7")) == {"model": 2.0, "reward": 2.0}
    unset = combine.resolve(TaskSection(name="arithmetic", reward_judge="judge"), None)
    assert unset is not None
    got = rewards.score_many(unset, [("x", item("7"))])[0]
    assert got.reward == 0.0 and "task.reward_server is unset" in got.reason
    # a rule that raises fails the sample, naming the source
    broken = combine.Combined({"bad": 1.0}, {"bad": lambda c, i: 1 / 0}, None)
    got = rewards.score_many(broken, [("x", item("7"))])[0]
    assert got.reward == 0.0 and got.reason.startswith("reward raised RewardSourceFailed: bad: reward raised "
                                                       "ZeroDivisionError")  # fmt: skip
    # without a served source the task's reward is as before: the plain function
    assert combine.resolve(TaskSection(name="arithmetic"), "exact") is rewards.exact


@pytest.mark.parametrize(
    ("task_keys", "fragment"),
    [
        ({"reward_model": "m", "reward_judge": "j"}, "several rewards: weigh them in task.reward_weights"),
        ({"reward_model": "m", "reward": "exact"}, "several rewards"),
        ({"reward_weights": {"judge": 1.0}}, "names 'judge' but task.reward_judge is unset"),
        ({"reward_model": "m", "reward_weights": {"exact": 1.0}}, "has no 'model' source"),
        ({"reward_weights": {"exact": 1.0}, "reward": "numeric"}, "put task.reward's there"),
        ({"judge_template": "{question} {completion}"}, "may hold {prompt}, {completion} and {answer}"),
        ({"judge_template": "{completion"}, "task.judge_template is not a template"),
        ({"reward_device": "tpu"}, "cpu, cuda or cuda:N"),
        ({"judge_engine": "tensorrt"}, "task.judge_engine must be 'torch' or 'vllm'; got 'tensorrt'"),
        ({"reward_server_bind": "8600"}, "reward_server_bind must be host:port"),
        ({"reward_server": "localhost:8600"}, "must be the http(s) URL"),
    ],
)
def test_reward_source_mistakes_are_one_line(task_keys: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ConfigError, match=r"task\.") as e:
        build(RunConfig, {"task": {"name": "arithmetic", **task_keys}})
    assert fragment in str(e.value) and "\n" not in str(e.value)


def test_an_unknown_rule_source_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=re.escape("task.reward_weights source 'nope:fn'")):
        combine.resolve(TaskSection(name="arithmetic", reward_weights={"nope:fn": 1.0}), None)


@pytest.mark.parametrize(
    ("answer", "score"),
    [("7", 0.7), (" 8.5/10", 0.85), ("Score: 12", 1.0), ("-3", 0.0), (".5 of 10", 0.05), ("10\n9", 1.0)],
)
def test_the_judge_score_is_its_first_number_scaled_and_clipped(answer: str, score: float) -> None:
    value, reason = parse_score(answer, 10.0)
    assert value == pytest.approx(score) and reason == ""


def test_a_judge_answer_without_a_number_has_a_reason_and_the_template_is_filled() -> None:
    assert parse_score("excellent!", 10.0) == (None, "the judge's answer holds no number: 'excellent!'")
    template = TaskSection().judge_template
    text = fill(template, {"id": "a", "prompt": "P?", "completion": "C {x}", "answer": None})
    assert "Prompt:\nP?" in text and "Response:\nC {x}" in text and "reference answer is ." in text


def test_the_batcher_joins_concurrent_requests_up_to_its_batch_size() -> None:
    sizes: list[int] = []

    def score(requests: list[dict[str, Any]]) -> list[dict[str, Any]]:
        sizes.append(len(requests))
        if any(r["completion"] == "boom" for r in requests):
            raise RuntimeError("out of memory")
        return [{"components": {"model": float(r["completion"])}} for r in requests]

    batcher = Batcher(score, batch_size=5, wait_s=0.5)
    thread = threading.Thread(target=batcher.run)
    thread.start()
    start = threading.Barrier(4)

    def client(k: int) -> list[dict[str, Any]]:
        start.wait()
        futures = batcher.submit([{"id": f"{k}.{i}", "completion": str(k * 10 + i)} for i in range(2)])
        return [f.result(timeout=5) for f in futures]

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(client, range(4)))
    assert got == [[{"components": {"model": float(k * 10 + i)}} for i in range(2)] for k in range(4)]
    assert sorted(sizes) == [3, 5]  # 8 samples of 4 requests: one full batch, then the rest after the wait
    failed = batcher.submit([{"id": "x", "completion": "boom"}])[0].result(timeout=5)
    assert failed == {"error": "dora reward: RuntimeError: out of memory"}
    batcher.close()
    thread.join(timeout=5)
    stats = batcher.stats()
    assert stats["batch_sizes"] == {"1": 1, "3": 1, "5": 1} and stats["batch_size_max"] == 5
    assert stats["requests"] == 5 and stats["samples"] == 9 and stats["errors"] == 1


def test_dora_reward_help_imports_no_torch_and_needs_a_model() -> None:
    code = ("import sys\nfrom dora.cli import main\ntry:\n    main(['reward', '--help'])\nexcept SystemExit:\n"
            "    pass\nheavy = ('torch', 'vllm', 'transformers')\n"
            "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in heavy))")  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in r.stdout and "--url-file" in r.stdout, r.stdout + r.stderr
    r = subprocess.run([sys.executable, "-m", "dora", "reward"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "set one of them" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_reward_model_that_is_not_there_stops_dora_run_and_dora_reward_in_one_line(tmp_path: pathlib.Path) -> None:
    missing = str(tmp_path / "no-such-model")
    r = subprocess.run([sys.executable, "-m", "dora", "run", "--set", f"run.dir={tmp_path / 'runs'}", "--set",
                        "core.total_steps=1", "--set", "task.name=arithmetic", "--set", f"task.reward_model={missing}"],
                       capture_output=True, text=True, timeout=60)  # fmt: skip
    assert r.returncode == 2 and "task.reward_model = " in r.stderr and "no such folder" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "runs").exists()  # nothing started, no run directory
    run = LocalRun(tmp_path / "run", {"task": {"name": "arithmetic", "reward_judge": missing}})
    with pytest.raises(RuntimeError, match="dora reward exited with 2") as e:
        run.start_reward(timeout_s=60)
    assert "task.reward_judge = " in str(e.value) and "no such folder" in str(e.value)
    assert "reward_server" not in (tmp_path / "run" / "run.toml").read_text()


def test_dora_run_stops_when_its_reward_server_is_gone(tmp_path: pathlib.Path) -> None:
    run = LocalRun(tmp_path, {})
    sleeping = {name: subprocess.Popen(["sleep", "30"]) for name in ("broker", "learner")}
    gone = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    gone.wait(timeout=30)
    run.procs.update(sleeping, reward=gone)
    try:
        with pytest.raises(RuntimeError, match="dora reward exited with 3"):
            follow(run, tmp_path, 2, lambda: False)
    finally:
        for p in sleeping.values():
            p.kill()
            p.wait()
