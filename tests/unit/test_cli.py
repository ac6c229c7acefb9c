"""The `dora` command line, run as a user would: in a subprocess."""

from __future__ import annotations

import json
import pathlib
import shlex
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def dora(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "dora", *args], capture_output=True, text=True, timeout=timeout)


def test_help_lists_every_command():
    r = dora("--help")
    assert r.returncode == 0
    for name in ("broker", "rollout", "learner", "run", "sim", "status"):
        assert name in r.stdout


def test_unknown_command_is_a_usage_error():
    r = dora("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("argv", [["--help"], ["broker", "--help"], ["sim", "--help"], ["config", "reference"]])
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
    out, plots = tmp_path / "sim.json", tmp_path / "plots"
    r = dora("sim", "--steps", "5", "--faults", "2", "--set", "core.train_groups=8", "--json", str(out),
             "--plots", str(plots))  # fmt: skip
    assert r.returncode == 0, r.stderr
    rows = {row["mode"]: row for row in json.loads(out.read_text())}
    assert set(rows) == {"sync", "one_step", "partial", "dora", "drop_stale"}
    for mode in ("sync", "one_step", "dora"):
        assert rows[mode]["c1_violations"] == 0 and rows[mode]["dropped_groups"] == 0, mode
    for mode, row in rows.items():
        assert row["max_staleness_consumed"] <= row["max_staleness"], mode
        if mode != "drop_stale":
            # the 5 measured steps, then the cooldown's K + 2 (the core still dispatching)
            assert row["steps"] == 5 and row["cooldown_steps"] == row["max_staleness"] + 2, mode
            assert row["groups_trained"] == (5 + row["cooldown_steps"]) * 8
            assert row["max_live_versions"] <= row["max_staleness"] + 1
            assert row["groups_dispatched"] == row["groups_trained"] + row["groups_in_flight_at_end"]
    assert "C1" in r.stdout and "dora" in r.stdout
    pngs = sorted(p.name for p in plots.glob("*.png"))
    assert pngs == sorted(["throughput.png", "staleness.png", *(f"timeline_{m}.png" for m in rows)])
    assert all((plots / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)


def test_sim_prints_each_split_its_search_tries(tmp_path):
    out = tmp_path / "sim.json"
    r = dora("sim", "--mode", "dora", "--steps", "4", "--set", "core.train_groups=8",
             "--set", "cluster.rollout_gpus=none", "--json", str(out))  # fmt: skip
    assert r.returncode == 0, r.stderr
    (row,) = json.loads(out.read_text())
    lines = [line for line in r.stderr.splitlines() if "split search:" in line]
    assert len(lines) == len(row["split_search"]) > 1
    for tried in row["split_search"]:
        gpus, rate = tried["rollout_gpus"], tried["throughput_tokens_per_s"]
        assert any(f" {gpus} rollout GPU" in line and f"{rate:,.0f} tokens/s over 2 steps" in line for line in lines)


@pytest.mark.parametrize(
    ("args", "fragment"),
    [(["--set", "core.train_groups=0"], "train_groups"),
     (["--set", "engine.max_slot=3"], "unknown key 'engine.max_slot'"),
     (["--config", "/nonexistent/x.toml"], "not found"), (["--mode", "async"], "invalid choice"),
     (["--set", "cluster.placement.dora=elsewhere"], "placement.dora must be one of"),
     (["--mode", "sync", "--set", "trainer.data_parallel=count", "--set", "trainer.model_parallel_gpus=99"],
      "no data-parallel replica"),
     (["--set", "trainer.data_parallel=ring"], "trainer.data_parallel must be")],
)  # fmt: skip
def test_sim_bad_input_is_one_clear_error(args, fragment):
    r = dora("sim", *args)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [(["rollout", "--broker", "tcp://127.0.0.1:9", "--engine", "torch", "--model", "/nonexistent"], "no such folder"),
     (["rollout", "--broker", "/nonexistent/broker.json"], "no broker at"),
     (["broker", "--set", "task.name=arithmetic", "--set", "task.tokenizer=/nonexistent"], "no tokenizer.json"),
     (["broker", "--set", "task.name=poetry"], "task.name must be"),
     (["broker", "--set", "task.name=countdown"], "needs task.tokenizer"),
     (["broker", "--set", "broker.liveness=1"], "liveness"),
     (["learner", "--trainer", "sim", "--broker", "tcp://127.0.0.1:9", "--set", "learner.dtype=fp8"], "learner.dtype"),
     (["run", "--set", "run.threads=-1", "--set", "core.total_steps=1"], "run.threads"),
     (["rollout", "--broker", "tcp://127.0.0.1:9", "--set", "rollout.sleep_on_yield=true"], "applies to the torch"),
     (["run", "--set", "core.total_steps=1", "--set", "rollout.sleep_on_yield=true"], "applies to the torch and"),
     (["run", "--set", "core.total_steps=1", "--set", "run.engine=torch", "--set", "rollout.sleep_on_yield=true"],
      "shares cores, not accelerator memory"),
     (["learner", "--trainer", "sim", "--broker", "tcp://127.0.0.1:9", "--set", "run.time_scale=0"], "time_scale"),
     (["run", "--set", "core.total_steps=1", "--set", "run.engine=vllm", "--set", "learner.lora.rank=1024"],
      "vLLM workers serve adapters of rank 512 at most"),
     (["learner", "--trainer", "sim", "--broker", "tcp://127.0.0.1:9", "--set", "learner.lora.rank=0"],
      "learner.lora.rank must be >= 1"),
     (["chaos", "--upstream", "tcp://127.0.0.1:9", "--drop", "0.7", "--delay", "0.5"], "add up to more than 1"),
     (["chaos", "--upstream", "tcp://127.0.0.1:9", "--bind", "nonsense://x"], "cannot bind")],
)  # fmt: skip
def test_live_commands_bad_input_is_one_clear_error(argv, fragment):
    r = dora(*argv)
    assert r.returncode == 2 and fragment in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_paper_configs_load():
    from dora.config import load
    from dora.config.sim import SimConfig

    for name in ("paper-64gpu", "paper-128gpu"):
        cfg = load(SimConfig, path=str(ROOT / "examples" / "sim" / f"{name}.toml"))
        assert cfg.core.train_groups * cfg.core.group_size == 8192 and cfg.core.max_staleness == 3
        assert cfg.workload.cap == 30720


def test_no_pickle_anywhere_in_the_package():
    banned = ("import pickle", "send_pyobj", "recv_pyobj", "weights_only=False", "pkill", "killall")
    for path in (ROOT / "dora").rglob("*.py"):
        text = path.read_text()
        assert not [b for b in banned if b in text], path


def test_local_processes_get_a_thread_budget_unless_the_user_set_one(tmp_path, monkeypatch):
    from dora.launch.local import LocalRun

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert LocalRun(tmp_path / "a", {}, threads=3).env["OMP_NUM_THREADS"] == "3"
    assert "OMP_NUM_THREADS" not in LocalRun(tmp_path / "b", {}).env
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert LocalRun(tmp_path / "c", {}, threads=3).env["OMP_NUM_THREADS"] == "5"


def test_a_reader_that_goes_away_ends_the_command_quietly(tmp_path):
    """`dora audit RUN | head`: the pipe closes under the command; it stops with 141, as a shell tool does, without
    a traceback."""
    from tests.unit.test_audit import GOOD, write_run

    write_run(tmp_path, GOOD)
    script = f'{shlex.quote(sys.executable)} -m dora audit {tmp_path} | true; echo "exit ${{PIPESTATUS[0]}}" >&2'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert "Traceback" not in done.stderr and "Error" not in done.stderr, done.stderr
    assert done.stderr.strip().endswith("exit 141"), done.stderr
