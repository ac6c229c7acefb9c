"""Where a process runs (Slurm, torchrun) and how it finds the broker: ClusterInfo and discovery files."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

from dora.actor.cluster import RENDEZVOUS_PORT_BASE, ClusterInfo, expand_hostlist
from dora.actor.discovery import (
    NotYetWritten,
    advertised,
    announce,
    mark_finished,
    resolve_endpoint,
    run_finished,
    wait_for_endpoint,
)
from dora.config import ConfigError

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("hostlist", "names"),
    [
        ("vm", ("vm",)),
        ("gpu[01-03,07],cpu1", ("gpu01", "gpu02", "gpu03", "gpu07", "cpu1")),
        ("n[8-11]", ("n8", "n9", "n10", "n11")),
        ("r[1-2]n[1-2]", ("r1n1", "r1n2", "r2n1", "r2n2")),
        ("a,b[0009-0010]", ("a", "b0009", "b0010")),
    ],
)
def test_slurm_host_lists_expand_as_scontrol_does(hostlist: str, names: tuple[str, ...]) -> None:
    assert expand_hostlist(hostlist) == names


@pytest.mark.parametrize("bad", ["gpu[01-", "gpu01]", "gpu[a-b]", "gpu[1-x]"])
def test_a_malformed_host_list_is_a_clear_error(bad: str) -> None:
    with pytest.raises(ValueError, match="bad Slurm host list"):
        expand_hostlist(bad)


SRUN_RANK_1 = {
    "SLURM_JOB_ID": "4242",
    "SLURM_RESTART_COUNT": "2",
    "SLURM_STEP_ID": "3",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NTASKS": "8",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_STEP_NODELIST": "trainer[3-4]",
    "SLURM_JOB_NODELIST": "trainer[1-4]",
    "SLURMD_NODENAME": "trainer3",
}


def test_an_srun_task_knows_its_rank_step_and_rendezvous() -> None:
    c = ClusterInfo.from_env(SRUN_RANK_1)
    assert (c.job_id, c.restart_count, c.step_id, c.host) == ("4242", 2, "3", "trainer3")
    assert (c.rank, c.local_rank, c.world) == (1, 1, 4)  # the step's tasks, not the allocation's
    assert c.step_nodes == ("trainer3", "trainer4")
    assert c.master_addr == "trainer3"  # the step's first node: every rank derives the same one
    assert c.master_port == RENDEZVOUS_PORT_BASE + 4242
    assert c.under_slurm
    assert c.log_fields() == {"host": "trainer3", "slurm_job_id": "4242", "slurm_restart": 2}


def test_torchrun_variables_win_over_slurm_ones() -> None:
    env = {**SRUN_RANK_1, "RANK": "5", "LOCAL_RANK": "0", "WORLD_SIZE": "16", "MASTER_ADDR": "head", "MASTER_PORT": "7"}
    c = ClusterInfo.from_env(env)
    assert (c.rank, c.local_rank, c.world, c.master_addr, c.master_port) == (5, 0, 16, "head", 7)


def test_a_batch_shell_is_one_process_not_the_allocation() -> None:
    c = ClusterInfo.from_env({"SLURM_JOB_ID": "7", "SLURM_NTASKS": "8", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert (c.rank, c.world, c.restart_count) == (0, 1, 0)


def test_outside_any_launcher() -> None:
    c = ClusterInfo.from_env({})
    assert not c.under_slurm and (c.rank, c.world, c.master_addr, c.master_port) == (0, 1, "127.0.0.1", 29_500)
    assert set(c.log_fields()) == {"host"}


@pytest.mark.parametrize("env", [{"SLURM_PROCID": "one"}, {"SLURM_JOB_ID": "12x"}, {"SLURM_RESTART_COUNT": "-"}])
def test_malformed_launcher_variables_are_named(env: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="SLURM_"):
        ClusterInfo.from_env(env)


def test_only_the_cluster_module_reads_slurm_variables() -> None:
    """Slurm's variables are read in exactly one place (every other module gets a ClusterInfo)."""
    readers = []
    for path in sorted((ROOT / "dora").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("SLURM"):
                readers.append(str(path.relative_to(ROOT)))
    assert set(readers) == {"dora/actor/cluster.py"}, readers


@pytest.mark.parametrize(
    ("endpoint", "host", "expected"),
    [
        ("tcp://0.0.0.0:5555", "node7", "tcp://node7:5555"),
        ("tcp://*:41000", "node7", "tcp://node7:41000"),
        ("tcp://[::]:41000", "node7", "tcp://node7:41000"),
        ("tcp://127.0.0.1:5555", "node7", "tcp://127.0.0.1:5555"),
        ("ipc:///tmp/b.sock", "node7", "ipc:///tmp/b.sock"),
    ],
)
def test_a_wildcard_bind_is_advertised_under_the_node_name(endpoint: str, host: str, expected: str) -> None:
    assert advertised(endpoint, host) == expected


def test_a_discovery_file_from_an_earlier_attempt_of_the_job_is_not_the_broker(tmp_path: pathlib.Path) -> None:
    disc = tmp_path / "broker.json"
    announce({"endpoint": "tcp://n1:1", "slurm_job_id": "9", "slurm_restart": 0}, str(disc))
    second = ClusterInfo(host="n1", job_id="9", restart_count=1)
    with pytest.raises(NotYetWritten, match="attempt 0 of job 9"):
        resolve_endpoint(str(disc), second)
    assert resolve_endpoint(str(disc), ClusterInfo(host="n1", job_id="9")) == "tcp://n1:1"
    assert resolve_endpoint(str(disc), ClusterInfo(host="n1", job_id="10", restart_count=3)) == "tcp://n1:1"
    announce({"endpoint": "tcp://n2:2", "slurm_job_id": "9", "slurm_restart": 1}, str(disc))
    assert resolve_endpoint(str(disc), second) == "tcp://n2:2"
    assert not list(tmp_path.glob("*.tmp"))  # written through a temporary file, renamed into place


def test_a_finished_run_is_read_only_for_the_broker_that_wrote_it(tmp_path: pathlib.Path) -> None:
    disc = tmp_path / "broker.json"
    ready = {"endpoint": "tcp://n1:1", "broker_epoch": 7}
    assert not run_finished(str(disc), 7)  # no file yet
    announce(ready, str(disc))
    assert not run_finished(str(disc), 7)  # serving
    mark_finished(ready, str(disc))
    assert run_finished(str(disc), 7) and resolve_endpoint(str(disc)) == "tcp://n1:1"
    assert not run_finished(str(disc), 8)  # a peer of another broker (a new run in this directory) stays
    assert not run_finished("tcp://n1:1", 7)  # an endpoint says nothing of the run
    disc.write_text("{")
    assert not run_finished(str(disc), 7)


def test_waiting_for_a_discovery_file_that_appears(tmp_path: pathlib.Path) -> None:
    disc = tmp_path / "broker.json"
    now = [0.0]
    said: list[str] = []

    def sleep(s: float) -> None:
        now[0] += s
        if now[0] > 3:  # the broker writes it three seconds in
            disc.write_text(json.dumps({"endpoint": "tcp://n1:5"}))

    got = wait_for_endpoint(str(disc), 60, clock=lambda: now[0], sleep=sleep, say=said.append)
    assert got == "tcp://n1:5" and 3 < now[0] < 6
    assert len(said) == 1 and "waiting up to 60 s" in said[0]


def test_waiting_gives_up_with_the_setting_named(tmp_path: pathlib.Path) -> None:
    now = [0.0]

    def sleep(s: float) -> None:
        now[0] += s

    with pytest.raises(ConfigError, match="discovery_wait_s"):
        wait_for_endpoint(str(tmp_path / "b.json"), 10, clock=lambda: now[0], sleep=sleep, say=lambda _: None)
    assert 8 <= now[0] <= 10


def test_no_wait_for_a_file_in_a_missing_directory_or_a_bad_file(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ConfigError, match="no directory"):
        wait_for_endpoint("/nonexistent/dir/broker.json", 60, sleep=lambda s: pytest.fail("waited"))
    bad = tmp_path / "b.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not a broker discovery file"):
        wait_for_endpoint(str(bad), 60, sleep=lambda s: pytest.fail("waited"))
