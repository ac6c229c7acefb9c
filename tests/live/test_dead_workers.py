"""`dora run` with rollout workers that die: every one at startup stops the run with each one's error, promptly and
with nothing left running; one of two mid-run is reported and the run finishes without it."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import time

import pytest

from tests.live.test_dora_run import dora_run

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(120)


def state(pid: int) -> str | None:
    """The process's state letter from /proc (``Z``: a zombie nobody reaped), or None once it is gone."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return stat.rpartition(")")[2].split()[0]


def children(pid: int) -> set[int]:
    """The processes whose parent is ``pid``."""
    out = set()
    for d in pathlib.Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rpartition(")")[2].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid:
                out.add(int(d.name))
    return out


def wait_for(what, timeout_s: float, proc: subprocess.Popen[str]):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := what()) is not None:
            return got
        assert proc.poll() is None, proc.communicate()[0]
        time.sleep(0.05)
    raise AssertionError(f"timed out; output:\n{stop(proc)}")


def stop(proc: subprocess.Popen[str]) -> str:
    """Stop `dora run` and every process it started, by PID, and return what it printed. SIGTERM first: it stops
    its own children; what is still there after that is killed."""
    kids = children(proc.pid)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        out, _ = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    for pid in kids:
        if state(pid) not in (None, "Z"):
            os.kill(pid, signal.SIGKILL)
    return out


def the_run(tmp_path: pathlib.Path) -> pathlib.Path | None:
    runs = [p for p in (tmp_path / "runs").glob("*") if p.is_dir()]
    return runs[0] if runs else None


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="reads /proc")
def test_every_worker_failing_at_startup_stops_the_run_with_each_error_and_leaves_nothing_running(tmp_path, tiny_model):
    """Torch workers on a model folder whose config and tokenizer load but whose weights are not safetensors: each
    raises while building its engine. `dora run` reports each one's exception, stops the broker and the learner
    and exits 1, instead of waiting forever for a fleet that is not coming."""
    model = tmp_path / "broken"
    shutil.copytree(tiny_model, model)
    (model / "model.safetensors").write_bytes(b"these are not safetensors")
    proc = dora_run(tmp_path / "runs", "examples/quickstart.toml", f"rollout.model={model}", "run.trainer=sim",
                    "core.total_steps=2")  # fmt: skip
    died: dict[int, float | None] = {}
    """Each child of `dora run` (the broker, the workers, the learner): when it was first seen exited."""
    started = time.monotonic()
    while proc.poll() is None and time.monotonic() - started < 90:
        now = time.monotonic()
        died.update((pid, None) for pid in children(proc.pid) - died.keys())
        died.update([(pid, now) for pid, t in died.items() if t is None and state(pid) in (None, "Z")])
        time.sleep(0.2)
    out = stop(proc)  # ended on its own, or stopped here after 90 s with what it started (the assertions tell)
    ended = time.monotonic()
    assert proc.returncode == 1, out
    lines = [x for x in out.splitlines() if x.startswith("dora run: rollout worker w")]
    assert lines, out
    for line in lines:
        assert line.split()[4] in ("w0", "w1"), line
        assert "exited with 1: SafetensorError: Error while deserializing header" in line, line
        assert "(log: " in line and line.endswith(".log)"), line
    assert "nothing is left to roll out" in out or "exited before all 2 rollout workers had joined" in out, out
    assert "stopping every process" in out, out
    assert len(died) == 4, died  # the broker, two workers and the learner
    assert [p for p in died if state(p) is not None] == [], "every child reaped: none left running, no zombie"
    assert "did not join the broker within" not in out, out  # stopped by the exit, not by the start timeout
    # Not a speed check: about 2.5 s on an idle machine, 11 s seen beside a loaded suite (stopping three processes
    # and Python's exit of each, all CPU-bound). A tenth of run.worker_start_timeout_s (600 s), the wait it spares.
    first = min(t for t in died.values() if t is not None)  # a worker's: the others only end when told to
    assert ended - first < 60, f"dora run ended {ended - first:.1f} s after the first worker died"


@pytest.mark.skipif(not pathlib.Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_worker_killed_mid_run_is_reaped_and_reported_and_the_run_finishes_on_the_other(tmp_path):
    steps = 10
    proc = dora_run(tmp_path / "runs", "examples/live/sim.toml", "run.workers=2", "run.time_scale=0.01",
                    f"core.total_steps={steps}")  # fmt: skip

    def both_joined():
        rundir = the_run(tmp_path)
        timeline = rundir / "timeline.jsonl" if rundir else None
        if timeline is None or not timeline.exists():
            return None
        events = [json.loads(x) for x in timeline.read_text().splitlines() if x.endswith("}")]
        joined = {e["worker"].split("/")[1] for e in events if e["event"] == "joined"}
        if joined != {"w0", "w1"}:
            return None
        logged = [json.loads(x) for x in (rundir / "w1.log").read_text().splitlines() if x.endswith("}")]
        return (rundir, logged[0]["pid"]) if logged else None

    try:
        rundir, pid = wait_for(both_joined, 60, proc)
        assert pid in children(proc.pid)
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: True if state(pid) is None else None, 10, proc)  # reaped by dora run, mid-run: no zombie
        assert proc.poll() is None, "the run goes on"
        out, _ = proc.communicate(timeout=100)
    finally:
        if proc.poll() is None:  # the test failed on the way: nothing it started is left running
            stop(proc)
    assert proc.returncode == 0, out
    (line,) = [x for x in out.splitlines() if x.startswith("dora run: rollout worker")]
    assert line.startswith("dora run: rollout worker w1 killed by SIGKILL: "), line
    assert f"(log: {rundir / 'w1.log'})" in line, line
    assert "dora run: done (1 rollout worker lost on the way: w1)" in out, out
    assert "invariants hold" in out, out
    rows = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(steps))
