"""The reward service client (dora.tasks.remote_reward) against a real HTTP server on 127.0.0.1: batches of
concurrent callers matched by id, retries with the same ids after an error status or a timeout, a service that
keeps failing scored 0 with a reason naming it, components, and a bad URL as one ConfigError line."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from dora.config import ConfigError
from dora.tasks import rewards
from dora.tasks.remote_reward import RemoteReward
from dora.tasks.tasks import Item

Answer = Callable[[int, list[dict[str, Any]]], tuple[int, Any]]
"""(call number, the batch's requests) -> (status, JSON body); a status of 0 hangs 1 s before answering 200."""


def by_length(_call: int, requests: list[dict[str, Any]]) -> tuple[int, Any]:
    return 200, {"results": [{"id": r["id"], "reward": float(len(r["completion"]))} for r in reversed(requests)]}


class Service:
    def __init__(self, answer: Answer) -> None:
        self.batches: list[list[dict[str, Any]]] = []
        lock = threading.Lock()
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                requests = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["requests"]
                with lock:
                    service.batches.append(requests)
                    call = len(service.batches)
                status, body = answer(call, requests)
                if status == 0:
                    time.sleep(1.0)
                    status = 200
                data = json.dumps(body).encode()
                with contextlib.suppress(OSError):  # the client gave up on a hung call
                    self.send_response(status)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/score"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[Answer], Service]]:
    started: list[Service] = []

    def start(answer: Answer) -> Service:
        started.append(Service(answer))
        return started[-1]

    yield start
    for s in started:
        s.close()


def item(i: int) -> Item:
    return Item(task="t", index=i, prompt=f"p{i}", answer=str(i), meta={"row": i})


def test_concurrent_callers_share_batches_and_get_their_own_rewards(serve: Callable[[Answer], Service]) -> None:
    service = serve(by_length)
    fn = RemoteReward(service.url, timeout_s=5.0, retries=0, batch_size=8, batch_wait_s=0.05)
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        got = list(pool.map(lambda i: fn("x" * i, item(i)), range(20)))
    fn.close()
    assert got == [float(i) for i in range(20)]
    assert max(len(b) for b in service.batches) > 1
    assert all(len(b) <= 8 for b in service.batches)
    assert service.batches[0][0]["meta"] == {"row": int(service.batches[0][0]["answer"])}
    stats = fn.stats()
    assert stats["samples"] == 20 and stats["requests"] == len(service.batches) and stats["failures"] == 0


def test_score_many_batches_one_step(serve: Callable[[Answer], Service]) -> None:
    service = serve(by_length)
    fn = rewards.resolve(service.url, batch_size=32)
    assert isinstance(fn, RemoteReward)
    scored = rewards.score_many(fn, [("y" * i, item(i)) for i in range(10)], timeout_s=5.0)
    fn.close()
    assert [s.reward for s in scored] == [float(i) for i in range(10)]
    assert [len(b) for b in service.batches] == [10]


def test_an_error_status_is_retried_with_the_same_ids(serve: Callable[[Answer], Service]) -> None:
    service = serve(lambda call, reqs: (500, {}) if call == 1 else by_length(call, reqs))
    fn = RemoteReward(service.url, timeout_s=5.0, retries=2)
    assert fn("abc", item(1)) == 3.0
    fn.close()
    assert len(service.batches) == 2
    assert [r["id"] for r in service.batches[0]] == [r["id"] for r in service.batches[1]]
    assert fn.stats()["retries"] == 1


def test_a_hung_call_times_out_and_is_retried(serve: Callable[[Answer], Service]) -> None:
    service = serve(lambda call, reqs: (0, {}) if call == 1 else by_length(call, reqs))
    fn = RemoteReward(service.url, timeout_s=0.3, retries=1)
    start = time.monotonic()
    assert fn("abcd", item(1)) == 4.0
    assert time.monotonic() - start < 0.9  # not the hung answer, which comes after 1 s
    fn.close()
    assert [r["id"] for r in service.batches[0]] == [r["id"] for r in service.batches[1]]


def test_a_service_that_keeps_failing_scores_zero_with_a_reason_naming_it(serve: Callable[[Answer], Service]) -> None:
    service = serve(lambda call, reqs: (503, {}))
    fn = RemoteReward(service.url, timeout_s=2.0, retries=2)
    scored = rewards.score(fn, "abc", item(1), timeout_s=5.0)
    fn.close()
    assert scored.reward == 0.0
    assert "RewardServiceError" in scored.reason and service.url in scored.reason and "3 attempt" in scored.reason
    assert len(service.batches) == 3 and fn.stats()["failures"] == 1


def test_components_per_sample_errors_and_missing_ids(serve: Callable[[Answer], Service]) -> None:
    def answer(_call: int, reqs: list[dict[str, Any]]) -> tuple[int, Any]:
        out: list[dict[str, Any]] = [{"id": reqs[0]["id"], "components": {"correct": 1.0, "format": 0.5}},
                                     {"id": reqs[1]["id"], "error": "judge unavailable"}, {"id": "stray"}]  # fmt: skip
        return 200, {"results": out}  # the third request gets no result

    service = serve(answer)
    fn = RemoteReward(service.url, timeout_s=5.0, retries=0)
    first, second, third = rewards.score_many(fn, [("a", item(0)), ("b", item(1)), ("c", item(2))], timeout_s=5.0)
    fn.close()
    assert first == rewards.Scored(1.5, "", {"correct": 1.0, "format": 0.5})
    assert second.reward == 0.0 and "judge unavailable" in second.reason
    assert third.reward == 0.0 and "no result" in third.reason
    assert fn.stats()["unknown_ids"] == 1


@pytest.mark.parametrize("spec", ["http://", "https:///path", "http://host:notaport/x", "http://a b/"])
def test_a_bad_url_is_one_config_error_line(spec: str) -> None:
    with pytest.raises(ConfigError) as err:
        rewards.resolve(spec)
    assert "\n" not in str(err.value) and spec in str(err.value)


def test_a_step_worker_scores_a_steps_finished_samples_in_one_call() -> None:
    from dora.ids import Finish
    from dora.rollout.engines.base import Sample
    from dora.rollout.engines.stepped import StepWorkerEngine
    from dora.rollout.engines.versions import Versions

    calls: list[list[tuple[int, list[int]]]] = []

    class Task:
        def score_many(self, pairs: list[tuple[int, list[int]]]) -> list[rewards.Scored]:
            calls.append(pairs)
            return [rewards.Scored(float(sum(tokens)), "", {"n": float(group)}) for group, tokens in pairs]

        def score(self, group: int, tokens: list[int]) -> rewards.Scored:
            raise AssertionError("scored one by one")

    class Engine:
        name, version, versions = "fake", 3, Versions(1, 3, None)

    def sample(group: int, index: int) -> Sample:
        return Sample(group_id=group, attempt=1, index=index, prompt=[1], max_tokens=4, temperature=1.0, top_p=1.0,
                      tokens=[group, index], logprobs=[-0.5, -0.25], finish=Finish.STOP)  # fmt: skip

    w = StepWorkerEngine(Engine(), Task())  # type: ignore[arg-type]
    w.end_step([sample(4, 0), sample(4, 1), sample(6, 0)])
    results = [w.result(s, broker_epoch=2) for s in w.take_finished()]
    assert calls == [[(4, [4, 0]), (4, [4, 1]), (6, [6, 0])]]
    assert [(r.reward, r.reward_components) for r in results] == [(4.0, {"n": 4.0}), (5.0, {"n": 4.0}),
                                                                  (6.0, {"n": 6.0})]  # fmt: skip
    assert w.scored == {}


def test_a_task_run_with_a_service_url_scores_its_samples_in_one_batch(serve: Callable[[Answer], Service],
                                                                       tmp_path: Any) -> None:  # fmt: skip
    from dora.config.run import TaskSection
    from dora.hf.tiny import build_tokenizer
    from dora.tasks.prompts import TaskRun

    build_tokenizer().save_pretrained(tmp_path)
    service = serve(by_length)
    run = TaskRun(TaskSection(name="arithmetic", reward=service.url, reward_batch_size=16), str(tmp_path))
    completions = ["12", "345", "6"]
    pairs = [(g, run.encode(text)) for g, text in enumerate(completions)]
    scored = run.score_many(pairs)
    assert [s.reward for s in scored] == [float(len(run.tokenizer.decode(t, skip_special_tokens=True)))
                                          for _, t in pairs]  # fmt: skip
    assert [len(b) for b in service.batches] == [3]
    assert [r["prompt"] for r in service.batches[0]] == [run.item(g).prompt for g in range(3)]
    assert isinstance(run.reward, RemoteReward) and run.reward.batch_size == 16
    with pytest.raises(ConfigError, match="reward_batch_size >= 1"):
        TaskSection(name="arithmetic", reward=service.url, reward_batch_size=0)
