"""The `dora` command line, run as a user would: in a subprocess."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from dora.cli import COMMANDS

ROOT = pathlib.Path(__file__).resolve().parents[2]


def dora(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dora", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command():
    r = dora("--help")
    assert r.returncode == 0
    for name in ("broker", "rollout", "learner", "run", "sim", "status"):
        assert name in r.stdout


@pytest.mark.parametrize("name", [n for n, (_, module) in COMMANDS.items() if module is None])
def test_commands_not_built_yet_say_so_and_exit_2(name):
    r = dora(name, "--help")
    assert r.returncode == 2 and "not built yet" in r.stderr and "Traceback" not in r.stderr


def test_unknown_command_is_a_usage_error():
    r = dora("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv", [["--help"], ["broker", "--help"], ["sim", "--help"]])
def test_help_never_imports_torch_or_vllm(argv):
    code = (
        "import sys\nfrom dora.cli import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'vllm', 'transformers'))\n"
        "print('HEAVY', heavy)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "HEAVY []" in r.stdout, r.stdout + r.stderr


def test_sim_runs_all_modes_and_reports_the_invariants(tmp_path):
    out = tmp_path / "sim.json"
    r = dora("sim", "--steps", "4", "--workers", "4", "--train-groups", "8", "--group-size", "4", "--faults", "2",
             "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {row["mode"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"sync", "one_step", "partial", "dora"}
    for mode, row in rows.items():
        assert row["c2"] and row["c3"] and row["broken_promises"] == [], mode
        assert row["max_live_versions"] <= row["staleness_bound"] + 1
    assert rows["dora"]["c1"] and rows["sync"]["c1"] and rows["one_step"]["c1"]
    assert rows["sync"]["speedup_vs_sync"] == 1.0
    assert "C1" in r.stdout and "dora" in r.stdout


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["--train-groups", "0"], "train_groups"), (["--slots", "2", "--group-size", "4"], "--slots"),
     (["--mode", "async"], "invalid choice")],
)  # fmt: skip
def test_sim_bad_input_is_one_clear_error(args, fragment):
    r = dora("sim", *args)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr


def test_no_pickle_anywhere_in_the_package():
    banned = ("import pickle", "send_pyobj", "recv_pyobj", "weights_only=False", "pkill", "killall")
    for path in (ROOT / "dora").rglob("*.py"):
        text = path.read_text()
        assert not [b for b in banned if b in text], path
