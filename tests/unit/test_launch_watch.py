"""`dora run`'s watch over its rollout workers: the last error of a log, and when a run cannot go on."""

from __future__ import annotations

import json
import pathlib
from typing import Any

import pytest

from dora.launch.watch import RunStuck, WorkerWatch, last_error, status

TRACEBACK = """\
Traceback (most recent call last):
  File "/x/dora/rollout/main.py", line 140, in serve
    engine = make_engine(cfg, kind, loop.time(), task)
             ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
safetensors._safetensors_rust.SafetensorError: Error while deserializing header: header too large
"""
PYDANTIC = """\
Traceback (most recent call last):
  File "/x/vllm/engine/arg_utils.py", line 1, in create_engine_config
pydantic_core._pydantic_core.ValidationError: 1 validation error for ModelConfig
  Value error, User-specified max_model_len (8192) is greater than the derived max_model_len (2048).
"""
CHAINED = """\
Traceback (most recent call last):
  File "a.py", line 1, in f
KeyError: 'x'

During handling of the above exception, another exception occurred:

Traceback (most recent call last):
  File "a.py", line 3, in g
RuntimeError: engine failed
"""


def line(event: str, level: str = "info", **fields: Any) -> str:
    return json.dumps({"event": event, "level": level, "pid": 7, "process": "rollout", "timestamp": "t", **fields})


@pytest.mark.parametrize(("log", "expected"), [
    (TRACEBACK, "SafetensorError: Error while deserializing header: header too large"),
    (PYDANTIC, "ValidationError: 1 validation error for ModelConfig Value error, User-specified max_model_len (8192) "
               "is greater than the derived max_model_len (2048)."),
    (CHAINED, "RuntimeError: engine failed"),
    (line("started") + "\n" + TRACEBACK, "SafetensorError: Error while deserializing header: header too large"),
    (line("started") + "\n" + line("engine_failed", "error", exception=[
        {"exc_type": "torch.OutOfMemoryError", "exc_value": "CUDA out of memory"}]) + "\n" + line("closing"),
     "engine_failed: OutOfMemoryError: CUDA out of memory"),
    (line("broker_never_answered", "error", reason="timeout") + "\n", "broker_never_answered reason=timeout"),
    ("some warning\ndora rollout: --engine torch needs --model DIR (an HF folder); got None\n",
     "dora rollout: --engine torch needs --model DIR (an HF folder); got None"),
    (line("welcomed", version=0) + "\n", "no error logged; last line: welcomed version=0"),
    ("", "its log is empty"),
])  # fmt: skip
def test_last_error_is_the_last_exception_or_error_line(log, expected):
    assert last_error(log) == expected


def test_last_error_is_cut_to_a_line():
    assert len(last_error("RuntimeError: " + "x" * 1000)) == 300


def test_status_names_the_signal():
    assert (status(1), status(-9), status(0)) == ("exited with 1", "killed by SIGKILL", "exited with 0")


class Proc:
    def __init__(self) -> None:
        self.code: int | None = None

    def poll(self) -> int | None:
        return self.code


class Run:
    """What the watch reads of a LocalRun: its processes, its directory and each one's log."""

    def __init__(self, rundir: pathlib.Path, names: list[str]) -> None:
        self.dir = rundir
        self.procs = {n: Proc() for n in names}

    def log(self, name: str) -> str:
        return TRACEBACK if self.procs[name].code else ""

    def timeline(self, event: str, name: str) -> None:
        with open(self.dir / "timeline.jsonl", "a") as f:
            f.write(json.dumps({"t": 0, "event": event, "worker": f"rollout/{name}/ab12"}) + "\n")


@pytest.fixture
def fleet(tmp_path):
    run = Run(tmp_path, ["w0", "w1"])
    clock = [0.0]
    said: list[str] = []
    watch = WorkerWatch(run, ["w0", "w1"], start_timeout_s=100, clock=lambda: clock[0], say=said.append)  # type: ignore[arg-type]
    return run, watch, clock, said


def test_a_worker_lost_after_the_fleet_joined_is_reported_and_the_run_goes_on(fleet):
    run, watch, _clock, said = fleet
    run.timeline("joined", "w0")
    run.timeline("joined", "w1")
    watch.check()
    run.procs["w1"].code = -9
    watch.check()
    watch.check()
    assert said == [f"rollout worker w1 killed by SIGKILL: SafetensorError: Error while deserializing header: header "
                    f"too large (log: {run.dir / 'w1.log'})"]  # fmt: skip
    assert watch.lost == {"w1": -9}
    run.procs["w0"].code = 1
    with pytest.raises(RunStuck, match="every rollout worker has exited"):
        watch.check()


def test_a_worker_lost_before_the_whole_fleet_joined_stops_the_run(fleet):
    run, watch, _clock, said = fleet
    run.timeline("joined", "w0")
    run.procs["w1"].code = 1
    with pytest.raises(RunStuck, match="the run cannot start: w1 exited before all 2 rollout workers had joined"):
        watch.check()
    assert len(said) == 1 and said[0].startswith("rollout worker w1 exited with 1: SafetensorError")


def test_a_fleet_not_joined_in_time_stops_the_run_naming_who_is_missing(fleet):
    run, watch, clock, said = fleet
    run.timeline("joined", "w0")
    clock[0] = 99.0
    watch.check()
    clock[0] = 101.0
    with pytest.raises(RunStuck, match=r"1 of 2 rollout workers did not join the broker within "
                                       r"run\.worker_start_timeout_s = 100 s"):  # fmt: skip
        watch.check()
    assert said == [f"rollout worker w1 has not joined the broker after 100 s: its log is empty "
                    f"(log: {run.dir / 'w1.log'})"]  # fmt: skip


def test_workers_let_go_by_the_broker_leave_the_run_time_to_end(fleet):
    run, watch, clock, said = fleet
    run.timeline("joined", "w0")
    run.timeline("joined", "w1")
    run.procs["w0"].code = run.procs["w1"].code = 0
    watch.check()
    clock[0] = 9.0
    watch.check()
    assert said == []
    clock[0] = 11.0
    with pytest.raises(RunStuck, match="every rollout worker has exited"):
        watch.check()


def test_settle_reports_a_worker_that_failed_on_its_own_before_the_stop(fleet):
    run, watch, _clock, said = fleet
    run.procs["w0"].code = 1
    watch.settle({"w0": 1, "w1": -15, "broker": 0})
    assert len(said) == 1 and said[0].startswith("rollout worker w0 exited with 1: ")
