"""T15: hostile code-execution rewards each score 0 with a reason, leave no process behind and never stall."""

from __future__ import annotations

import os
import pathlib
import time

import pytest

from dora.tasks import rewards, sandbox
from dora.tasks.tasks import Item

pytestmark = pytest.mark.timeout(60)
ITEM = Item(task="arithmetic", index=0, prompt="6*7=", answer="42")
JAILED = pytest.mark.skipif(not sandbox.namespaces_available(),
                            reason="unprivileged user namespaces are not available here (rlimits only)")  # fmt: skip


def sandboxed() -> set[int]:
    """Processes still working in a sandbox directory (those directories exist only while a run lasts)."""
    found = set()
    for p in pathlib.Path("/proc").iterdir():
        try:
            if p.name.isdigit() and "dora-sandbox-" in os.readlink(p / "cwd"):
                found.add(int(p.name))
        except OSError:
            pass
    return found


def score(code: str) -> tuple[float, str, float]:
    started = time.monotonic()
    scored = rewards.score(rewards.python_stdout, code, ITEM, timeout_s=10.0)
    return scored.reward, scored.reason, time.monotonic() - started


ROOT_UNJAILED = pytest.mark.skipif(not sandbox.namespaces_available() and os.geteuid() == 0,
                                   reason="as root without namespaces the sandbox refuses to run code")  # fmt: skip


@ROOT_UNJAILED
def test_a_correct_program_scores_1_and_a_wrong_one_0_without_a_reason():
    assert score("print(6 * 7)")[:2] == (1.0, "")
    assert score("print(41)")[:2] == (0.0, "")


CASES = {
    "infinite loop": ("while True:\n    pass", "limit"),  # CPU, or wall-clock where load leaves it < 2/3 of a core
    "sleeps forever": ("import time\ntime.sleep(600)", "wall-clock limit"),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", "limit"),
    "2 GB allocation": ("x = bytearray(2 * 1024 ** 3)", "out of memory"),
    "huge stdout": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", "wrote more than"),
    "crash": ("raise SystemExit(3)", "exited with status 3"),
}


@ROOT_UNJAILED
@pytest.mark.parametrize("case", list(CASES))
def test_hostile_programs_score_0_with_the_reason_and_leave_nothing_running(case):
    code, words = CASES[case]
    value, reason, took = score(code)
    assert value == 0.0 and words in reason, reason
    # The worker is never stalled: a program the limits did not stop would hold it 600 s (sleeps forever). Killing
    # and reaping a fork bomb's processes takes seconds more on a loaded machine (6.5 s once, under 3 s alone).
    assert took < sandbox.Limits().wall_s + 20.0
    time.sleep(0.2)
    assert not sandboxed(), "left running"


@ROOT_UNJAILED
@pytest.mark.skipif(sandbox._pids_parent() is None, reason="no pids cgroup can be made here (rlimits cap processes)")
def test_with_a_pids_cgroup_a_fork_bomb_ends_at_its_first_refused_fork_and_the_cgroup_goes(monkeypatch):
    """Run as root, the rlimit on processes does not bind; the run's pids cgroup does, even for root, and its first
    refused fork ends the run (the wall-clock limit would have let the bomb refuse forks for 3 s)."""
    made: list = []
    make = sandbox._pids_cgroup
    monkeypatch.setattr(sandbox, "_pids_cgroup", lambda n: made.append(make(n)) or made[-1])
    out = sandbox.run_python(CASES["fork bomb"][0], limits=sandbox.Limits(processes=8, wall_s=30.0))
    assert out.reason == "killed: over the process limit of 8", out
    assert made and made[0] is not None and not made[0].exists(), f"the run's cgroup {made} is removed"
    time.sleep(0.2)
    assert not sandboxed(), "left running"


@ROOT_UNJAILED
def test_a_busy_loop_is_stopped_by_its_cpu_limit():
    """The CPU limit by itself, under a wall-clock limit far enough away that load cannot reach it first."""
    started = time.monotonic()
    out = sandbox.run_python("while True:\n    pass", limits=sandbox.Limits(cpu_s=1, wall_s=60.0))
    assert not out.ok and "CPU limit" in out.reason, out.reason
    assert time.monotonic() - started < 60.0


@JAILED
@pytest.mark.parametrize(
    ("code", "words"),
    [
        ("import socket\nsocket.create_connection(('127.0.0.1', 22), timeout=1)", "network access is not allowed"),
        ("open('/tmp/dora-sandbox-escape.txt', 'w').write('x')", "outside its own directory"),
    ],
)
def test_in_the_namespaces_there_is_no_network_and_nothing_to_write_but_its_own_directory(code, words):
    value, reason, _ = score(code)
    assert value == 0.0 and words in reason, reason
    assert not pathlib.Path("/tmp/dora-sandbox-escape.txt").exists()


@JAILED
def test_a_process_that_leaves_its_group_dies_with_the_run():
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\nprint(42)"
    assert score(code)[:2] == (1.0, "")
    time.sleep(0.2)
    assert not sandboxed()


@ROOT_UNJAILED
def test_its_own_directory_is_writable_and_removed_afterwards():
    out = sandbox.run_python("import os\nopen('scratch.txt', 'w').write('x')\nprint(os.getcwd())")
    assert out.ok, out
    assert not pathlib.Path(out.stdout.strip()).exists()


@JAILED
def test_signalling_pid_1_reaches_only_its_own_namespace():
    value, reason, took = score("import os, signal\nos.kill(1, signal.SIGKILL)\nprint(42)")
    assert (value, reason) == (1.0, "") and took < sandbox.Limits().wall_s  # the host's init was not its PID 1


def test_as_root_without_namespaces_nothing_is_run(monkeypatch):
    monkeypatch.setattr(sandbox, "namespaces_available", lambda: False)
    monkeypatch.setattr(sandbox.os, "geteuid", lambda: 0)
    out = sandbox.run_python("open('/tmp/dora-sandbox-ran.txt', 'w').write('x')")
    assert out.reason.startswith("refused") and out.isolation == "rlimits"
    assert not pathlib.Path("/tmp/dora-sandbox-ran.txt").exists()
