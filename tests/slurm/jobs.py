"""What the Slurm tests share: the job's environment, submitting examples/slurm/dora.sbatch, reading its logs."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

from dora.broker.journal import replay
from tests.slurm.localslurm import LocalSlurm

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "slurm" / "dora.sbatch"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}


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


def submit_nodes(slurm: LocalSlurm, tmp: pathlib.Path, model: pathlib.Path, *sets: str, elastic: str = "none") -> str:
    """The multi-node job: learner on node1 and node2 (one rank each), rollout from node 2 on, CURVE on; ``elastic``
    is DORA_ELASTIC."""
    keys = tmp / "keys"
    subprocess.run([sys.executable, "-m", "dora", "keys", "generate", str(keys)], check=True, capture_output=True)
    env = job_env(tmp, model, *sets)
    env.update(DORA_LEARNER_NODES="2", DORA_LEARNER_RANKS_PER_NODE="1", DORA_ROLLOUT_FROM_NODE="2",
               DORA_ELASTIC=elastic)  # fmt: skip
    env["DORA_SET"] += f" broker.bind=tcp://0.0.0.0:0 security.keys={keys}"
    job = slurm.sbatch(SCRIPT, "--nodes=3", "--overcommit", f"--output={tmp}/job-%j.out", env=env, cwd=tmp)
    return job


def status(slurm: LocalSlurm, run: pathlib.Path) -> dict[str, Any] | None:
    """``dora status --json`` of the run's broker, asked on the first node with the run's client key (None: no
    answer)."""
    done = slurm.run([sys.executable, "-m", "dora", "status", "--broker", str(run / "broker.json"), "--json",
                      "--keys", str(run.parent / "keys")], check=False)  # fmt: skip
    return json.loads(done.stdout) if done.returncode == 0 else None


def groups_held(slurm: LocalSlurm, run: pathlib.Path, host: str) -> int:
    """Groups leased to the rollout workers on ``host`` now (0 when the broker does not answer)."""
    workers = (status(slurm, run) or {}).get("workers", {})
    return sum(w["groups"] for name, w in workers.items() if f"/{host}-" in name)  # rollout/<host>-<pid>/...


def events_in_order(path: pathlib.Path) -> list[dict[str, Any]]:
    """Every JSON log line of ``path``, in order (none if it does not exist)."""
    return [json.loads(x) for x in path.read_text().splitlines() if x.startswith("{")] if path.exists() else []


def events(path: pathlib.Path, event: str) -> list[dict[str, Any]]:
    return [r for r in events_in_order(path) if r.get("event") == event]


def wait_steps(slurm: LocalSlurm, job: str, journal: pathlib.Path, n: int, timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while replay(journal).newest < n:
        state = slurm.job(job).get("JobState")
        assert state in ("PENDING", "RUNNING") and time.monotonic() < deadline, f"job {job} {state}"
        time.sleep(0.5)


def ts(rec: dict[str, Any]) -> float:
    """A log record's timestamp, in seconds since the epoch."""
    return datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()
