"""examples/slurm/dora.sbatch on a real one-node Slurm cluster: the broker, a torch rollout worker and a
2-rank FSDP learner as job steps; the invariants read from the job's own output; the early-warning signal
(what --signal=B:USR1@N delivers) drains the learner to a checkpoint and the job requeues itself and
resumes; scancel stops every step cleanly within KillWait, and a resubmission resumes the run."""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from typing import Any

import pytest

from dora.broker.journal import replay
from dora.ops.audit import audit_run
from tests.slurm.localslurm import LocalSlurm

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "dora.sbatch"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}
pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(420)]


def job_env(tmp: pathlib.Path, model: pathlib.Path, *sets: str) -> dict[str, str]:
    """What the job inherits (sbatch exports the submitting environment): this checkout's dora and the tiny run."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "DORA_"))}
    env.update(
        PATH=f"{pathlib.Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}",
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS="1",  # four torch processes share the cores
        DORA=f"{sys.executable} -m dora",
        DORA_CONFIG=str(ROOT / "examples" / "slurm" / "tiny.toml"),
        DORA_MODEL=str(model),
        DORA_RUN_DIR=str(tmp / "run"),
        DORA_ENGINE="torch",
        DORA_LEARNER_RANKS_PER_NODE="2",
        DORA_SRUN_ARGS="--overcommit",
        DORA_SET=" ".join(("broker.bind=tcp://127.0.0.1:0", "broker.metrics_bind=127.0.0.1:0", *sets)),
    )
    return env


def submit(slurm: LocalSlurm, tmp: pathlib.Path, env: dict[str, str]) -> str:
    return slurm.sbatch(SCRIPT, "--nodes=1", "--ntasks=4", "--overcommit", f"--output={tmp}/job-%j.out",
                        env=env, cwd=tmp)  # fmt: skip


def events(path: pathlib.Path, event: str) -> list[dict[str, Any]]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")] if path.exists() else []
    return [r for r in rows if r.get("event") == event]


def wait_steps(slurm: LocalSlurm, job: str, journal: pathlib.Path, n: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while replay(journal).newest < n:
        state = slurm.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, f"job {job} {state}"
        time.sleep(0.5)


def test_an_sbatch_job_runs_every_process_as_a_step_and_its_output_shows_the_invariants(slurm, tiny_model, tmp_path):
    job = submit(slurm, tmp_path, job_env(tmp_path, tiny_model))
    info = slurm.wait_state(job, FINAL, 300)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    for step in ("broker", "rollout", "learner"):
        assert f"{step} step exited with 0" in out, out
    assert "run finished" in out and "steps: learner committed 8, broker recorded 8 of 8" in out, out
    assert "invariants hold" in out and "nothing dispatched left untrained" in out and "FAILED" not in out, out

    run = tmp_path / "run"
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=8)
    assert report.ok and report.finished and report.steps_committed == 8, report.problems
    assert report.broker_starts == [{"epoch": report.broker_starts[0]["epoch"], "slurm_job_id": job,
                                     "slurm_restart": 0}]  # fmt: skip
    found = json.loads((run / "broker.json").read_text())  # how every other step found the broker
    assert (found["slurm_job_id"], found["slurm_restart"], found["host"]) == (job, 0, slurm.node)
    assert found["metrics_url"].startswith("http://127.0.0.1:")
    logs = run / "logs" / "attempt-0"
    joined = events(logs / "broker.log", "peer_joined")
    assert sorted(r["role"] for r in joined) == ["learner", "rollout"] and all(r["host"] == slurm.node for r in joined)
    # two learner ranks started by srun met at the rendezvous ClusterInfo derived (FSDP2 over gloo)
    [follower] = events(logs / "learner-1.log", "rank_following")
    assert follower["world"] == 2 and follower["rank"] == 1 and follower["slurm_job_id"] == job
    assert [r["version"] for r in events(logs / "learner-0.log", "checkpoint_saved")] == [2, 4, 6, 8]
    for png in ("reward.png", "staleness.png", "timeline.png"):
        assert (run / png).stat().st_size > 0
    written = (run / "broker.json").stat().st_mtime
    first, last = min(_ts(r) for r in joined), max(_ts(r) for r in joined)
    finished = _ts(events(logs / "broker.log", "run_finished")[0])
    print(
        f"\njob {job}: peers joined {first - written:.2f}-{last - written:.2f} s after the discovery file was "
        f"written; the run took {finished - first:.1f} s"
    )


def test_the_early_warning_drains_the_learner_to_a_checkpoint_and_the_requeued_job_resumes(slurm, tiny_model, tmp_path):
    steps = 20
    env = job_env(tmp_path, tiny_model, f"core.total_steps={steps}", "learner.checkpoint_every=1000")
    job = submit(slurm, tmp_path, env)
    run = tmp_path / "run"
    wait_steps(slurm, job, run / "journal.jsonl", 3)
    warned = time.time()
    slurm.run(["scancel", "--batch", "--signal=USR1", job])  # what --signal=B:USR1@120 sends the batch shell
    deadline = time.monotonic() + 60
    while not (slurm.job(job).get("Restarts") == "1" and slurm.job(job).get("JobState") == "PENDING"):
        assert time.monotonic() < deadline, f"not requeued: {slurm.job(job)}"
        time.sleep(0.5)
    first = run / "logs" / "attempt-0" / "learner-0.log"
    [saved] = [r for r in events(first, "checkpoint_saved") if r["reason"] == "drained"]
    [stopped] = events(first, "learner_stopped")
    assert stopped["reason"] == "drained" and stopped["checkpointed"] == saved["version"] >= 3
    assert (run / "checkpoints" / f"ckpt-v{saved['version']}").is_dir()
    print(f"\njob {job}: checkpoint of version {saved['version']} written {_ts(saved) - warned:.1f} s after USR1")
    assert _ts(saved) - warned <= 30

    slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"])  # skip the 120 s a requeued job waits
    info = slurm.wait_state(job, FINAL, 300)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", out
    assert f"job {job} attempt 1" in out and "resuming the run recorded" in out and "requeued" in out, out
    assert "invariants hold" in out and "FAILED" not in out, out
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=steps)
    assert report.ok and report.finished and report.steps_committed == steps, report.problems
    assert [(s["slurm_job_id"], s["slurm_restart"]) for s in report.broker_starts] == [(job, 0), (job, 1)]
    [resumed] = events(run / "logs" / "attempt-1" / "learner-0.log", "resumed_from_checkpoint")
    assert resumed["version"] == saved["version"] and resumed["groups"] == 4 * saved["version"]


def test_scancel_stops_every_step_within_killwait_and_a_resubmitted_job_resumes(slurm, tiny_model, tmp_path):
    steps = 20
    env = job_env(tmp_path, tiny_model, f"core.total_steps={steps}")
    job = submit(slurm, tmp_path, env)
    run = tmp_path / "run"
    wait_steps(slurm, job, run / "journal.jsonl", 3)
    cancelled = time.monotonic()
    slurm.run(["scancel", job])
    deadline = cancelled + slurm.kill_wait_s + 20
    while slurm.run(["squeue", "-h", "-j", job], check=False).stdout.strip():  # until every process is gone
        assert time.monotonic() < deadline, slurm.job(job)
        time.sleep(0.2)
    took = time.monotonic() - cancelled
    out = (tmp_path / f"job-{job}.out").read_text()
    print(f"\njob {job}: every step gone {took:.1f} s after scancel (KillWait {slurm.kill_wait_s} s)")
    assert took <= slurm.kill_wait_s, out
    assert "Killed" not in out and "stopped" in out, out  # nothing needed SIGKILL
    for step in ("broker", "rollout", "learner"):
        assert f"{step} step exited with 0" in out, out
    logs = run / "logs" / "attempt-0"
    [stopped] = events(logs / "learner-0.log", "learner_stopped")
    assert stopped["reason"] == "stopping"
    committed = replay(run / "journal.jsonl").newest

    again = submit(slurm, tmp_path, env)  # the same run directory: a new job picks the run up
    info = slurm.wait_state(again, FINAL, 300)
    out = (tmp_path / f"job-{again}.out").read_text()
    assert info["JobState"] == "COMPLETED", out
    assert "resuming the run recorded" in out and "invariants hold" in out, out
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=steps)
    assert report.ok and report.finished and report.steps_committed == steps, report.problems
    assert [(s["slurm_job_id"], s["slurm_restart"]) for s in report.broker_starts] == [(job, 0), (again, 0)]
    assert 3 <= committed < steps


def _ts(rec: dict[str, Any]) -> float:
    from datetime import datetime

    return datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
