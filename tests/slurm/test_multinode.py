"""examples/slurm/dora.sbatch over several nodes of a real Slurm cluster made of namespaces (tests.slurm.nodes):
broker and learner rank 0 on node1, learner rank 1 on node2 (FSDP2, gloo over TCP between the nodes), a rollout
worker on node2 and on node3, CURVE on every connection, every step finding the broker through the shared run
directory. Then the loss of a whole node (its link cut, then its slurmd and every process on it SIGKILLed): a
rollout node's groups are re-run whole on the workers left and the job finishes; the learner's second node, or
the first (the batch script's, the broker's), takes the job through a requeue, which resumes from the checkpoint
and the journal on the nodes left. And a heterogeneous job."""

from __future__ import annotations

import json
import pathlib
import time
from collections.abc import Iterator

import pytest

from dora.ops.audit import audit_run
from tests.slurm.jobs import FINAL, SCRIPT, events, events_in_order, groups_held, job_env, submit_nodes, ts, wait_steps
from tests.slurm.localslurm import LocalSlurm

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(420)]


@pytest.fixture
def cluster(slurm: LocalSlurm) -> Iterator[LocalSlurm]:
    """The session's cluster when it has four nodes; every node lost by the test is started again after it."""
    if slurm.count < 4:
        pytest.skip(f"needs a cluster of four nodes: {slurm.single_because}")
    yield slurm
    for name, state in slurm.states().items():
        if state not in ("idle", "mixed", "allocated"):
            slurm.restore(name)


def test_a_job_over_three_nodes_trains_across_them_with_curve_and_its_invariants_hold(cluster, tiny_model, tmp_path):
    """Learner ranks on node1 and node2, rollout workers on node2 and node3; node2's worker, sharing its node with a
    learner rank, is elastic (DORA_ELASTIC=shared) and yields to the learner for every step."""
    job = submit_nodes(cluster, tmp_path, tiny_model, elastic="shared")
    info = cluster.wait_state(job, FINAL, 300)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert info["NodeList"] == "node[1-3]", info
    for step in ("broker", "rollout@node2", "rollout@node3", "learner"):
        assert f"{step} step exited with 0" in out, out
    assert "invariants hold" in out and "FAILED" not in out, out
    run = tmp_path / "run"
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=8)
    assert report.ok and report.finished and report.steps_committed == 8, report.problems

    found = json.loads((run / "broker.json").read_text())
    assert found["host"] == "node1" and found["endpoint"].startswith("tcp://node1:"), found  # reached over TCP
    logs = run / "logs" / "attempt-0"
    [curve] = events(logs / "broker.log", "curve_on")
    assert curve["allowed"] == 3  # the rollout, learner and client keys
    joined = {(r["role"], r["host"]) for r in events(logs / "broker.log", "peer_joined")}
    assert joined == {("rollout", "node2"), ("rollout", "node3"), ("learner", "node1")}, joined
    [following] = events(logs / "learner-1.log", "rank_following")  # rank 1 met rank 0 across the nodes
    assert (following["host"], following["rank"], following["world"]) == ("node2", 1, 2)
    [done] = events(logs / "learner-1.log", "rank_done")
    assert done["steps"] == 8
    assert "elastic on: node2)" in out, out
    yielded = [r["worker"].split("/")[1].split("-")[0] for r in events(logs / "broker.log", "worker_yielded")]
    assert set(yielded) == {"node2"} and len(events(logs / "broker.log", "yield_requested")) == len(yielded)
    # The elastic worker yields for every batch taken while it is in the fleet. The fleet is ready with node3's
    # worker, so a batch the learner asked for before node2's worker joined (its first, on a loaded machine) may
    # leave without it: the learner asks at its hello and after each publish.
    flow = [(r["event"], r.get("role"), r.get("host")) for r in events_in_order(logs / "broker.log")]
    joined_at = flow.index(("peer_joined", "rollout", "node2"))
    asked_before = sum(1 for e in flow[:joined_at] if e[0] == "train_step" or e == ("peer_joined", "learner", "node1"))
    assert 8 - asked_before <= len(yielded) <= 8, (asked_before, yielded)


SLOW_ROLLOUT = ("rollout.max_slots=2", "rollout.credit_slots=4", "run.max_tokens=32")
"""Workers slower than the learner, so that a worker holds groups most of the time (the losses below hit some)."""


def lose_while_holding(slurm: LocalSlurm, job: str, run: pathlib.Path, host: str) -> tuple[float, list[int]]:
    """Lose ``host`` while its workers hold groups, after the run's fourth step (the time it fell silent, and the
    PIDs killed). The broker is watched, with nothing cut, until the workers on ``host`` hold a group; the node is
    then cut off and the broker asked again. Holding nothing by then, the node is let back in (a blip shorter than
    the liveness window) and the watch goes on: cutting a node off only when it was just seen holding keeps its
    links up most of the time, so the broker never takes the blips themselves for a loss."""
    wait_steps(slurm, job, run / "journal.jsonl", 4)
    deadline = time.monotonic() + 90
    while True:
        assert time.monotonic() < deadline, f"the workers on {host} never held a group when cut off"
        if not groups_held(slurm, run, host):
            time.sleep(0.2)
            continue
        silent_at = time.time()
        slurm.isolate(host)
        if groups_held(slurm, run, host):
            return silent_at, slurm.lose_node(host)
        slurm.rejoin(host)
        time.sleep(2.0)  # the node's connections come back before the next cut


def wait_requeued(slurm: LocalSlurm, job: str, tmp: pathlib.Path) -> float:
    """Wait until ``job`` is pending again after one requeue, then skip the requeued job's start delay; the time it
    was seen requeued."""
    deadline = time.monotonic() + 240
    while (state := slurm.job(job)).get("Restarts") != "1" or state.get("JobState") != "PENDING":
        assert time.monotonic() < deadline, (state, (tmp / f"job-{job}.out").read_text())
        time.sleep(0.5)
    requeued_at = time.time()
    while slurm.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False).returncode:
        assert time.monotonic() < deadline, "the requeued job's start time could not be set"  # "try again in a bit"
        time.sleep(0.5)
    return requeued_at


@pytest.mark.slow
def test_a_lost_rollout_node_has_its_groups_rerun_on_the_workers_left_and_the_job_finishes(
    cluster, tiny_model, tmp_path
):
    steps = 60  # the run outlasts Slurm's verdict on node3 (SlurmdTimeout), so the sentinel moves
    job = submit_nodes(cluster, tmp_path, tiny_model, f"core.total_steps={steps}", *SLOW_ROLLOUT)
    run = tmp_path / "run"
    lost_at, killed = lose_while_holding(cluster, job, run, "node3")
    info = cluster.wait_state(job, FINAL, 300)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert killed and info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert info["Restarts"] == "0", info
    assert "the sentinel on node3 is gone: node1 is watched from node2" in out, out  # it went down with node3
    logs = run / "logs" / "attempt-0"
    [lost] = [r for r in events(logs / "broker.log", "peer_lost") if r["role"] == "rollout"]
    assert lost["peer"].startswith("node3-") and lost["reason"] != "unreachable", lost  # silence, not a reset
    assert lost["groups"], "the lost worker held no group: nothing was re-run"
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=steps)
    assert report.ok and report.finished and report.steps_committed == steps, report.problems
    trained = {g: row["step"] for row in map(json.loads, (run / "audit.jsonl").read_text().splitlines())
               for g in row["groups"]}  # fmt: skip
    assert set(lost["groups"]) <= set(trained), "a group of the lost node was never trained"
    step_at = {r["step"]: ts(r) for r in events(logs / "broker.log", "train_step")}
    done_at = max(step_at[trained[g]] for g in lost["groups"])
    window = 0.5 * 20  # tiny.toml: heartbeat_interval_s x liveness
    print(
        f"\njob {job}: node3 lost ({len(killed)} processes SIGKILLed, link cut first); its worker declared "
        f"dead {ts(lost) - lost_at:.1f} s later (liveness window {window:g} s), its {len(lost['groups'])} "
        f"group(s) re-run and trained {done_at - lost_at:.1f} s after the loss; Slurm says node3 is "
        f"{cluster.states()['node3']}"
    )
    assert ts(lost) - lost_at <= window + 3


@pytest.mark.slow
def test_a_lost_learner_node_requeues_the_job_and_it_resumes_from_the_checkpoint_on_the_nodes_left(
    cluster, tiny_model, tmp_path
):
    steps = 24
    job = submit_nodes(cluster, tmp_path, tiny_model, f"core.total_steps={steps}", *SLOW_ROLLOUT)
    run = tmp_path / "run"
    lost_at, killed = lose_while_holding(cluster, job, run, "node2")
    requeued_at = wait_requeued(cluster, job, tmp_path)
    info = cluster.wait_state(job, FINAL, 300)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert killed and info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert info["Restarts"] == "1" and "node2" not in info["NodeList"], info
    assert "the learner failed and its node(s) node2 no longer answer" in out, out
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=steps)
    assert report.ok and report.finished and report.steps_committed == steps, report.problems
    assert [s["slurm_restart"] for s in report.broker_starts] == [0, 1]
    again = run / "logs" / "attempt-1"
    [resumed] = events(again / "learner-0.log", "resumed_from_checkpoint")
    first = min(ts(r) for r in events(again / "broker.log", "train_step"))
    print(
        f"\njob {job}: node2 lost ({len(killed)} processes SIGKILLed, link cut first); job requeued "
        f"{requeued_at - lost_at:.1f} s later; attempt 1 on {info['NodeList']} resumed from the checkpoint of "
        f"version {resumed['version']} and committed its first step {first - requeued_at:.1f} s after the "
        f"requeue (the requeue's start delay skipped); {report.steps_adopted} step(s) adopted from the store; "
        f"Slurm says node2 is {cluster.states()['node2']}"
    )


@pytest.mark.slow
def test_a_heterogeneous_job_learns_on_its_first_component_and_rolls_out_on_its_second(cluster, tiny_model, tmp_path):
    """sbatch <learner options> : <rollout options> dora.sbatch: the learner (two ranks) and the broker on the
    first component's node, one rollout worker on each node of the second."""
    env = job_env(tmp_path, tiny_model)
    env["DORA_SET"] += " broker.bind=tcp://0.0.0.0:0"
    job = cluster.sbatch(SCRIPT, "--nodes=1", "--overcommit", f"--output={tmp_path}/job-%j.out", ":", "--nodes=2",
                         "--overcommit", env=env, cwd=tmp_path)  # fmt: skip
    info = cluster.wait_state(f"{job}+0", FINAL, 300)  # the first component (scontrol shows each one)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    # the second component is read once it is final too: while a component is COMPLETING, Slurm lists only the
    # nodes still completing, so a read in between could see one of its two nodes
    second = cluster.wait_state(f"{job}+1", FINAL, 60)
    assert second["JobState"] == "COMPLETED" and second["ExitCode"] == "0:0", (second, out)
    learner, rollout = info["NodeList"], second["NodeList"]
    assert f"learner on {learner} (2 rank(s) per node)" in out, out
    hosts = cluster.run(["scontrol", "show", "hostnames", rollout]).stdout.split()
    assert len(hosts) == 2 and learner not in hosts, (learner, hosts)
    for step in ("broker", "learner", *(f"rollout@{h}" for h in hosts)):
        assert f"{step} step exited with 0" in out, out
    assert "invariants hold" in out, out
    run = tmp_path / "run"
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=8)
    assert report.ok and report.finished, report.problems
    logs = run / "logs" / "attempt-0"
    joined = {(r["role"], r["host"]) for r in events(logs / "broker.log", "peer_joined")}
    assert joined == {("learner", learner), *(("rollout", h) for h in hosts)}, joined
    [following] = events(logs / "learner-1.log", "rank_following")
    assert (following["host"], following["world"]) == (learner, 2)


@pytest.mark.slow
def test_a_lost_first_node_with_the_batch_script_and_the_broker_requeues_the_job_which_resumes(
    cluster, tiny_model, tmp_path
):
    """node1 runs the batch script, the broker and learner rank 0: Slurm itself requeues the job when it marks the
    node down, and the next attempt resumes from the journal and the checkpoint on the nodes left."""
    steps = 24
    job = submit_nodes(cluster, tmp_path, tiny_model, f"core.total_steps={steps}", *SLOW_ROLLOUT)
    run = tmp_path / "run"
    wait_steps(cluster, job, run / "journal.jsonl", 4)
    lost_at = time.time()
    killed = cluster.lose_node("node1")
    requeued_at = wait_requeued(cluster, job, tmp_path)
    info = cluster.wait_state(job, FINAL, 300)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert killed and info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    assert info["Restarts"] == "1" and "node1" not in info["NodeList"], info
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=steps)
    assert report.ok and report.finished and report.steps_committed == steps, report.problems
    assert [s["slurm_restart"] for s in report.broker_starts] == [0, 1]
    found = json.loads((run / "broker.json").read_text())
    assert found["slurm_restart"] == 1 and found["host"] != "node1", found
    again = run / "logs" / "attempt-1"
    first = min(ts(r) for r in events(again / "broker.log", "train_step"))
    print(
        f"\njob {job}: node1 lost ({len(killed)} processes SIGKILLed, link cut first): Slurm requeued the job "
        f"{requeued_at - lost_at:.1f} s later; attempt 1 on {info['NodeList']} (broker on {found['host']}) "
        f"committed its first step {first - requeued_at:.1f} s after the requeue; {report.steps_adopted} step(s) "
        f"adopted from the store"
    )
