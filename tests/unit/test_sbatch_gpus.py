"""examples/slurm/dora.sbatch's GPU placement, run by bash against stand-ins for srun, scontrol, sinfo, scancel and
dora (no Slurm): every task of every step gets exactly its GPUs through CUDA_VISIBLE_DEVICES, the steps ask for their
node's GPUs, a layout that does not fit a node stops the job with exit 2 before any step starts, and without GPUs
nothing is asked for or set (the CPU cluster of tests/slurm runs that path for real)."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "dora.sbatch"
pytestmark = pytest.mark.timeout(60)

SRUN = r"""
import json, os, subprocess, sys
args, opts = sys.argv[1:], {}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    opts[key] = value
nodes = opts.get("nodelist", os.environ["SLURMD_NODENAME"]).split(",")
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"srun": opts, "command": args}) + "\n")
if os.environ["DORA"] not in args:  # the sentinel, a probe: nothing to run here
    sys.exit(0)
per_node = int(opts.get("ntasks-per-node", int(opts.get("ntasks", 1)) // len(nodes)))
procs = []
for t in range(per_node * len(nodes)):
    env = {**os.environ, "SLURM_LOCALID": str(t % per_node), "SLURM_PROCID": str(t),
           "SLURMD_NODENAME": nodes[t // per_node]}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    if opts.get("gres", "").startswith("gpu:"):  # Slurm shows the step the node's GPUs it asked for
        env["CUDA_VISIBLE_DEVICES"] = os.environ.get("FAKE_STEP_GPUS") or ",".join(
            map(str, range(int(opts["gres"][4:]))))
    procs.append(subprocess.Popen(args, env=env))
sys.exit(max(p.wait() for p in procs))
"""
DORA = r"""
import json, os, pathlib, sys, time
role = sys.argv[1]
if role == "slurm":
    run = pathlib.Path(sys.argv[sys.argv.index("--run-dir") + 1])
    run.mkdir(parents=True, exist_ok=True)
    print(run / "run.toml")
elif role == "broker":
    time.sleep(2)  # the run ends when the broker exits 0
elif role in ("rollout", "learner"):
    with open(os.environ["FAKE_LOG"], "a") as f:
        f.write(json.dumps({"role": role, "host": os.environ["SLURMD_NODENAME"],
                            "task": int(os.environ["SLURM_LOCALID"]),
                            "gpus": os.environ.get("CUDA_VISIBLE_DEVICES")}) + "\n")
"""
SHELL = {"scontrol": 'if [[ $1 == show ]]; then tr , "\\n" <<< "$3"; else exit 1; fi',
         "sinfo": "echo idle", "scancel": "exit 0"}  # fmt: skip


def job(tmp_path: pathlib.Path, nodes: str, **settings: str) -> tuple[int, str, list[dict]]:
    """Run the script as Slurm would on ``nodes`` (comma-separated; the first runs it); its exit code, its output,
    and the lines the stand-ins recorded."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for name, code in (("srun", SRUN), ("dora", DORA)):
        (bin_ / name).write_text(f"#!{sys.executable}\n{code}")
    for name, code in SHELL.items():
        (bin_ / name).write_text(f"#!/bin/bash\n{code}\n")
    for f in bin_.iterdir():
        f.chmod(0o755)
    log = tmp_path / "fake.jsonl"
    env = {"PATH": f"{bin_}:{os.environ['PATH']}", "FAKE_LOG": str(log), "SLURM_JOB_NODELIST": nodes,
           "SLURM_JOB_ID": "7", "SLURM_JOB_NAME": "t", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURMD_NODENAME": nodes.split(",")[0], "DORA_CONFIG": "run.toml", "DORA_RUN_DIR": str(tmp_path / "run"),
           "DORA": str(bin_ / "dora"), "DORA_GRACE_S": "3", **settings}  # fmt: skip
    proc = subprocess.Popen(["bash", str(SCRIPT)], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=45)
    finally:
        with contextlib.suppress(ProcessLookupError):  # what is left of the session this test started, by its id
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    rows = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, out, rows


def tasks(rows: list[dict], role: str) -> dict[tuple[str, int], str | None]:
    return {(r["host"], r["task"]): r["gpus"] for r in rows if r.get("role") == role}


def gres(rows: list[dict]) -> dict[str, str | None]:
    """Each step's --gres, by the command it runs (broker, rollout, learner)."""
    out = {}
    for r in rows:
        if "srun" in r and any(x.endswith("/dora") for x in r["command"]):
            role = next(x for x in ("broker", "rollout", "learner") if x in r["command"])
            out[role] = r["srun"].get("gres")
    return out


def test_one_node_learner_ranks_first_then_the_workers_each_on_its_own(tmp_path):
    code, out, rows = job(tmp_path, "n1", SLURM_GPUS_ON_NODE="4", DORA_LEARNER_RANKS_PER_NODE="2",
                          DORA_WORKERS_PER_NODE="2")  # fmt: skip
    assert code == 0, out
    assert tasks(rows, "learner") == {("n1", 0): "0,1", ("n1", 1): "0,1"}  # rank i uses cuda:i of them
    assert tasks(rows, "rollout") == {("n1", 0): "2", ("n1", 1): "3"}
    assert gres(rows) == {"broker": None, "rollout": "gpu:4", "learner": "gpu:4"}
    assert "learner ranks 0,1 each; rollout tasks n1: 2 3;" in out, out


def test_ids_come_from_what_slurm_shows_the_step(tmp_path):
    code, out, rows = job(tmp_path, "n1", SLURM_GPUS_ON_NODE="4", DORA_LEARNER_RANKS_PER_NODE="1",
                          DORA_WORKERS_PER_NODE="3", FAKE_STEP_GPUS="4,5,6,7")  # fmt: skip
    assert code == 0, out
    assert tasks(rows, "learner") == {("n1", 0): "4"}
    assert tasks(rows, "rollout") == {("n1", 0): "5", ("n1", 1): "6", ("n1", 2): "7"}


def test_elastic_workers_share_the_learners_gpus(tmp_path):
    code, out, rows = job(tmp_path, "n1", SLURM_GPUS_ON_NODE="4", DORA_LEARNER_RANKS_PER_NODE="4",
                          DORA_WORKERS_PER_NODE="2", DORA_GPUS_PER_WORKER="2", DORA_ELASTIC="shared")  # fmt: skip
    assert code == 0, out
    assert set(tasks(rows, "learner").values()) == {"0,1,2,3"} and len(tasks(rows, "learner")) == 4
    assert tasks(rows, "rollout") == {("n1", 0): "0,1", ("n1", 1): "2,3"}


def test_two_nodes_learner_on_the_first_tp2_workers_on_the_second(tmp_path):
    code, out, rows = job(tmp_path, "n1,n2", SLURM_GPUS_ON_NODE="4", DORA_WORKERS_PER_NODE="2",
                          DORA_GPUS_PER_WORKER="2")  # fmt: skip
    assert code == 0, out
    assert tasks(rows, "learner") == {("n1", t): "0,1,2,3" for t in range(4)}  # the default: a rank per GPU
    assert tasks(rows, "rollout") == {("n2", 0): "0,1", ("n2", 1): "2,3"}


def test_a_layout_that_does_not_fit_a_node_stops_the_job_before_any_step(tmp_path):
    code, out, rows = job(tmp_path, "n1", SLURM_GPUS_ON_NODE="2", DORA_WORKERS_PER_NODE="1")
    assert code == 2 and rows == [], out
    assert "1 rollout workers x 1 GPUs do not fit beside the learner's 2 on n1 (2 GPUs)" in out, out


def test_without_gpus_the_steps_ask_for_none_and_nothing_is_set(tmp_path):
    code, out, rows = job(tmp_path, "n1", DORA_LEARNER_RANKS_PER_NODE="2", DORA_WORKERS_PER_NODE="2")
    assert code == 0, out
    assert set(tasks(rows, "learner").values()) == {None} and set(tasks(rows, "rollout").values()) == {None}
    assert gres(rows) == {"broker": None, "rollout": None, "learner": None}
    assert "GPUs by position" not in out
