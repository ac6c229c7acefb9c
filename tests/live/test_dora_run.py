"""`dora run`: the whole system from one command, its run directory, and a clean stop on Ctrl-C."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(300)


def dora_run(tmp_path: pathlib.Path, config: str, *sets: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "dora", "run", "--config", str(ROOT / config),
                             "--set", f"run.dir={tmp_path}", *[x for s in sets for x in ("--set", s)]],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip


def the_run(tmp_path: pathlib.Path) -> pathlib.Path:
    (rundir,) = [p for p in tmp_path.iterdir() if p.is_dir() and p.name[0].isdigit()]
    return rundir


def test_dora_run_sim_completes_with_metrics_and_plots(tmp_path):
    proc = dora_run(tmp_path, "examples/live/sim.toml", "run.workers=3", "run.time_scale=0.005",
                    "core.total_steps=12")  # fmt: skip
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    rundir = the_run(tmp_path)
    rows = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(12))
    assert all("reward_mean" in r and r["staleness"] for r in rows)
    assert all(r["elapsed_s"] > 0 and r["max_staleness"] == 2 for r in rows)
    figures = ("reward.png", "staleness.png", "timeline.png")
    assert all((rundir / f).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for f in figures)
    assert json.loads((rundir / "broker.json").read_text())["metrics_url"].startswith("http://127.0.0.1:")
    events = [json.loads(x) for x in (rundir / "timeline.jsonl").read_text().splitlines()]
    assert sorted(e["worker"].split("/")[1] for e in events if e["event"] == "joined") == ["w0", "w1", "w2"]
    assert [e["version"] for e in events if e["event"] == "published"] == list(range(1, 13))
    # the run's own invariant report, printed at the end (the checks of `dora audit RUN_DIR`)
    assert "run finished" in out and "invariants hold" in out and "nothing dispatched left untrained" in out, out
    # `dora plot` draws the same run again, elsewhere
    plots = tmp_path / "plots"
    r = subprocess.run([sys.executable, "-m", "dora", "plot", str(rundir), "--out", str(plots)], capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in plots.iterdir()) == sorted([*figures, "health.png"])  # health: notes, no numbers
    audit = [json.loads(x) for x in (rundir / "audit.jsonl").read_text().splitlines()]
    groups = [g for r in audit for g in r["groups"]]
    assert len(groups) == len(set(groups)) == 12 * 8


def test_dora_run_that_filters_uniform_groups_trains_exactly_its_steps_and_audits_what_it_filtered(tmp_path):
    """learner.filter_uniform_groups = "replace", with half the groups drawn uniform (every sample rewarded the
    same): the run ends, each step trained train_groups groups, the journal holds the groups filtered, never
    trained, and the run's report counts them (dispatched = trained + filtered)."""
    proc = dora_run(tmp_path, "examples/live/sim.toml", "run.workers=3", "run.time_scale=0.005",
                    "core.total_steps=6", "learner.filter_uniform_groups=replace",
                    "workload.uniform_share=0.5")  # fmt: skip
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    rundir = the_run(tmp_path)
    records = [json.loads(x) for x in (rundir / "journal.jsonl").read_text().splitlines()]
    steps = [r for r in records if r["kind"] == "step"]
    trained = [g for r in steps for g in r["groups"]]
    filtered = [g for r in steps for g in r.get("filtered", ())]
    assert len(steps) == 6 and len(trained) == 6 * 8 and filtered, records
    assert sorted(trained + filtered) == list(range(6 * 8 + len(filtered))), "every id below the budget, once"
    audit = [json.loads(x) for x in (rundir / "audit.jsonl").read_text().splitlines()]
    assert sorted(g for r in audit for g in r["groups"]) == sorted(trained)
    assert f"filtered (every reward equal, never trained): {len(filtered)}" in out and "invariants hold" in out, out
    assert "every group dispatched trained or filtered once" in out, out


def test_dora_run_makes_the_first_workers_elastic_and_they_yield_for_every_step(tmp_path):
    """run.elastic_workers = 1 of 3: w0 shares the learner's cores (yields before each train step, resumes after
    the publish), w1 and w2 always roll out; every group is trained once."""
    steps = 8
    proc = dora_run(tmp_path, "examples/live/sim.toml", "run.workers=3", "run.elastic_workers=1",
                    "run.time_scale=0.005", f"core.total_steps={steps}")  # fmt: skip
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    assert "3 sim workers (1 elastic)" in out and "invariants hold" in out, out
    assert "CPU threads:" in out and "per elastic worker (yielded to the learner for each step)" in out, out
    rundir = the_run(tmp_path)
    broker = [json.loads(x) for x in (rundir / "broker.log").read_text().splitlines() if x.startswith("{")]
    yielded = [r["worker"].split("/")[1] for r in broker if r["event"] == "worker_yielded"]
    assert yielded == ["w0"] * steps, yielded
    marks = [r["event"] for r in broker if r["event"] in ("worker_yielded", "train_step")]
    assert marks == ["worker_yielded", "train_step"] * steps, "each step trained after the elastic worker paused"
    for name, resumes in (("w0", True), ("w1", False), ("w2", False)):
        log = [json.loads(x) for x in (rundir / f"{name}.log").read_text().splitlines() if x.startswith("{")]
        assert any(r["event"] == "resumed" for r in log) is resumes, name
    audit = [json.loads(x) for x in (rundir / "audit.jsonl").read_text().splitlines()]
    groups = [g for r in audit for g in r["groups"]]
    assert len(groups) == len(set(groups)) == steps * 8


def test_ctrl_c_stops_every_process(tmp_path):
    proc = dora_run(tmp_path, "examples/live/sim.toml", "run.workers=2", "core.total_steps=100000")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        runs = [p for p in tmp_path.iterdir() if p.is_dir()]
        if runs and (runs[0] / "metrics.jsonl").exists() and (runs[0] / "metrics.jsonl").read_text().strip():
            break
        time.sleep(0.3)
    pids = [int(json.loads(x)["pid"]) for x in [(the_run(tmp_path) / "broker.json").read_text()]]
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 130, out
    assert "stopped" in out
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


@pytest.mark.timeout(600)  # CPU-bound (about 110 CPU-s) and each of its two commands may take 240 s when starved
def test_the_readme_first_command_in_miniature_warm_start_then_rl_with_held_out_evaluation(tmp_path):
    """examples/arithmetic.toml as the README runs it (dora sft from its "dora:tiny", which is built on first use,
    then dora run from its model folder), only shorter: one epoch, four steps of four groups, 12 held-out rows;
    the config, paths and reports stay those of the example. The
    rollout workers evaluate every 2 versions on exactly that version, and dora run evaluates the starting model
    and the final version itself."""
    home, sft = tmp_path / "home", tmp_path / "sft"  # dora:tiny is built into this home's cache, not the user's
    r = subprocess.run([sys.executable, "-m", "dora", "sft", "--config", str(ROOT / "examples/arithmetic.toml"),
                        "--set", f"sft.out={sft}", "--set", "sft.epochs=1"],
                       capture_output=True, text=True, timeout=240, cwd=ROOT,
                       env={**os.environ, "HOME": str(home)})  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert (home / ".cache" / "dora" / "tiny-model" / "config.json").is_file()  # built on first use
    assert "2000 rows of examples/data/arithmetic/train.jsonl" in r.stderr and (sft / "model.safetensors").is_file()
    proc = dora_run(tmp_path, "examples/arithmetic.toml", f"rollout.model={sft}", "core.total_steps=4",
                    "core.train_groups=4", "eval.limit=12", "eval.every_steps=2")  # fmt: skip
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert "dataset " in out and "2000 rows; 2000 groups make an epoch" in out
    assert "held-out accuracy " in out and "(12 rows of examples/data/arithmetic/test.jsonl, version 0 -> 4)" in out
    assert "invariants hold" in out, out
    rundir = the_run(tmp_path)
    rows = [json.loads(x) for x in (rundir / "eval.jsonl").read_text().splitlines()]
    by_workers = [r for r in rows if r.get("by") != "dora run"]
    # a round whose version is overtaken before its first rows reach a worker is dropped whole (and logged)
    versions = [r["version"] for r in by_workers]
    assert len(versions) >= 1 and set(versions) <= {0, 2, 4} and len(set(versions)) == len(versions), rows
    assert all(r["rows"] == 12 and r["samples"] == 1 and 0 <= r["accuracy"] <= 1 for r in rows)
    assert [r["version"] for r in rows if r.get("by") == "dora run"] == [0, 4]
    assert (rundir / "eval.png").stat().st_size > 10_000
    steps = [json.loads(x) for x in (rundir / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 4 and all(r["tokens"] > 0 for r in steps)
    assert any((rundir / "weights").iterdir())  # published versions in the store
    assert [p.name for p in sorted((rundir / "checkpoints").iterdir())] == ["ckpt-v4"]  # the last step's
