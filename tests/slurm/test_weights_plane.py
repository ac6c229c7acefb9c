"""A Slurm job whose rollout nodes share no weight store with the learner: each node has its own store directory
(a tmpfs mounted in that node alone), every version reaches it over the data plane, node3 through node2's relay
(fanout 1: learner -> node2 -> node3); node2 is lost while its worker holds groups, and node3 goes on fetching
from the learner, the lost node's groups are run again, and the job finishes with every invariant held."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
from collections.abc import Iterator

import pytest

from dora.ops.audit import audit_run
from tests.slurm.jobs import FINAL, SCRIPT, events, events_in_order, job_env
from tests.slurm.localslurm import LocalSlurm
from tests.slurm.test_multinode import SLOW_ROLLOUT, lose_while_holding

pytestmark = [pytest.mark.slurm, pytest.mark.slow, pytest.mark.timeout(420)]
ROLLOUT_NODES = ("node2", "node3")


@pytest.fixture
def cluster(slurm: LocalSlurm) -> Iterator[LocalSlurm]:
    if slurm.count < 4 or slurm.network is None:
        pytest.skip(f"needs a cluster of four nodes: {slurm.single_because}")
    yield slurm
    for name, state in slurm.states().items():
        if state not in ("idle", "mixed", "allocated"):
            slurm.restore(name)


@pytest.fixture
def node_stores(cluster: LocalSlurm, tmp_path: pathlib.Path) -> Iterator[pathlib.Path]:
    """One path, a store of its own on each rollout node: a tmpfs mounted there in that node's mount namespace."""
    path = tmp_path / "node-store"
    path.mkdir()
    assert cluster.network is not None
    for name in ROLLOUT_NODES:
        subprocess.run([*cluster.network.node(name).enter(), "mount", "-t", "tmpfs", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        for name in ROLLOUT_NODES:
            subprocess.run([*cluster.network.node(name).enter(), "umount", str(path)], check=False)


def test_rollout_nodes_with_their_own_stores_fetch_every_version_and_a_lost_relay_is_routed_around(
    cluster, node_stores, tiny_model, tmp_path
):
    steps = 40
    keys = tmp_path / "keys"
    subprocess.run([sys.executable, "-m", "dora", "keys", "generate", str(keys)], check=True, capture_output=True)
    env = job_env(tmp_path, tiny_model, f"core.total_steps={steps}", *SLOW_ROLLOUT, f"rollout.store={node_stores}",
                  "rollout.relay_fanout=1", "rollout.fetch_timeout_s=3")  # fmt: skip
    env.update(DORA_LEARNER_NODES="1", DORA_LEARNER_RANKS_PER_NODE="1", DORA_ROLLOUT_FROM_NODE="2")
    env["DORA_SET"] += f" broker.bind=tcp://0.0.0.0:0 security.keys={keys}"
    job = cluster.sbatch(SCRIPT, "--nodes=3", "--overcommit", f"--output={tmp_path}/job-%j.out", env=env,
                         cwd=tmp_path)  # fmt: skip
    run = tmp_path / "run"
    _, killed = lose_while_holding(cluster, job, run, "node2")
    info = cluster.wait_state(job, FINAL, 300)
    out = (tmp_path / f"job-{job}.out").read_text()
    assert killed and info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", out
    report = audit_run(run / "journal.jsonl", run / "audit.jsonl", total_steps=steps)
    assert report.ok and report.finished and report.steps_committed == steps, report.problems
    logs = run / "logs" / "attempt-0"
    [lost] = [r for r in events(logs / "broker.log", "peer_lost") if r["role"] == "rollout"]
    assert lost["peer"].startswith("node2-") and lost["groups"], lost
    trained = {g for row in map(json.loads, (run / "audit.jsonl").read_text().splitlines()) for g in row["groups"]}
    assert set(lost["groups"]) <= trained, "a group of the lost node was never trained"
    [learner_plane] = [r["endpoint"] for r in events(logs / "learner-0.log", "chunk_server_started")]
    [node3_log] = logs.glob("rollout-node3-*.log")
    [node2_log] = logs.glob("rollout-node2-*.log")
    [node2_plane] = [r["endpoint"] for r in events(node2_log, "chunk_server_started")]
    fetched = events(node3_log, "weights_fetched")
    assert fetched and all(r["path"].startswith(str(node_stores)) for r in fetched), fetched
    assert any(node2_plane in r["served"] for r in fetched), "node3 never fetched through node2's relay"
    after = [r for r in fetched if r["version"] > max(f["version"] for f in fetched if node2_plane in f["served"])]
    assert after and all(set(r["served"]) == {learner_plane} for r in after), after  # node2 gone: the learner
    assert not list(node_stores.iterdir()), "the host saw a node's store: it was not the node's own"
    named = [r for r in events_in_order(node3_log) if r["event"] != "config_resolved" and f"{run}/weights" in str(r)]
    assert not named, f"node3 named the learner's store: {named[:2]}"
