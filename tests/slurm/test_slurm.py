"""examples/slurm/dora.sbatch on one node of a real Slurm cluster: the broker, a torch rollout worker and a
2-rank FSDP learner as job steps; the invariants read from the job's own output; the early-warning signal
(what --signal=B:USR1@N delivers) drains the learner to a checkpoint and the job requeues itself and
resumes; scancel stops every step cleanly within KillWait, and a resubmission resumes the run and finishes it."""

from __future__ import annotations

import json
import re
import time

import pytest

from dora.broker.journal import replay
from dora.ops.audit import audit_run
from tests.slurm.jobs import FINAL, events, job_env, submit, ts, wait_steps

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]


def test_an_sbatch_job_runs_every_process_as_a_step_scancel_stops_them_and_a_resubmitted_job_finishes_the_run(
    slurm, tiny_model, tmp_path
):
    """One run over two jobs on the same run directory. The first is cancelled after 3 steps: every step (broker,
    rollout worker, two learner ranks) exits 0 within KillWait. The second resumes the run from the broker's
    journal and the learner's checkpoint, finishes it, and its output shows the invariants of the whole run."""
    steps = 8
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
    # Within KillWait: a step still running then is SIGKILLed by Slurm, and its status says so (srun exits with the
    # signal's code). Each step's own status is the check: how long the processes take to exit on a loaded machine,
    # seen from here (scancel's own latency and Slurm's cleanup included), is not.
    assert "Killed" not in out and "stopped" in out, out  # nothing needed SIGKILL
    for step in ("broker", f"rollout@{slurm.job(job)['NodeList']}", "learner"):
        assert f"{step} step exited with 0" in out, out
    logs = run / "logs" / "attempt-0"  # both jobs' first attempts: each process's log goes on where it was
    [stopped] = events(logs / "learner-0.log", "learner_stopped")
    assert stopped["reason"] == "stopping"
    committed = replay(run / "journal.jsonl").newest

    again = submit(slurm, tmp_path, env)  # the same run directory: a new job picks the run up
    info = slurm.wait_state(again, FINAL, 300)
    out = (tmp_path / f"job-{again}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    node = info["NodeList"]
    for step in ("broker", f"rollout@{node}", "learner"):
        assert f"{step} step exited with 0" in out, out
    assert "resuming the run recorded" in out and "run finished" in out, out
    # a learner cancelled after the broker recorded a step and before its own record adopts it from the store when
    # it starts again: the report names such steps, and they count once
    assert re.search(rf"steps: learner committed {steps}( \(\d+ adopted from the store\))?, broker recorded "
                     rf"{steps} of {steps}\n", out), out  # fmt: skip
    assert "invariants hold" in out and "nothing dispatched left untrained" in out and "FAILED" not in out, out
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=steps)
    assert report.ok and report.finished and report.steps_committed == steps, report.problems
    assert [(s["slurm_job_id"], s["slurm_restart"]) for s in report.broker_starts] == [(job, 0), (again, 0)]
    assert 3 <= committed < steps

    found = json.loads((run / "broker.json").read_text())  # how every other step found the broker
    assert (found["slurm_job_id"], found["slurm_restart"], found["host"]) == (again, 0, node)
    assert found["metrics_url"].startswith("http://127.0.0.1:")
    joined = events(logs / "broker.log", "peer_joined")
    assert sorted(r["role"] for r in joined) == ["learner", "learner", "rollout", "rollout"], joined
    assert all(r["host"] == node for r in joined)
    # two learner ranks started by srun met at the rendezvous ClusterInfo derived (FSDP2 over gloo), in each job
    followers = events(logs / "learner-1.log", "rank_following")
    assert [(r["world"], r["rank"], r["slurm_job_id"]) for r in followers] == [(2, 1, job), (2, 1, again)]
    [resumed] = events(logs / "learner-0.log", "resumed_from_checkpoint")
    saved = [r["version"] for r in events(logs / "learner-0.log", "checkpoint_saved")]
    assert resumed["version"] in saved and saved[-1] == steps, saved
    for png in ("reward.png", "staleness.png", "timeline.png"):
        assert (run / png).stat().st_size > 0
    first_peer = min(ts(r) for r in joined if r["slurm_job_id"] == again)
    finished = ts(events(logs / "broker.log", "run_finished")[0])
    print(f"job {again}: the run finished {finished - first_peer:.1f} s after its first peer joined")


@pytest.mark.slow
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
    print(f"\njob {job}: checkpoint of version {saved['version']} written {ts(saved) - warned:.1f} s after USR1")
    assert ts(saved) - warned <= 30

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
