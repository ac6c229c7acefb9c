"""A multi-node soak: examples/slurm/dora.sbatch for minutes on the namespace Slurm cluster of the tests (four
nodes, each its own network, hostname and slurmd; tests/slurm/nodes.py), then the exactly-once audit.

    sudo .venv/bin/python bench/slurm_soak.py --minutes 10                      # no faults
    sudo .venv/bin/python bench/slurm_soak.py --minutes 10 --lose node3 --at 300   # a rollout node lost at 5 min
    sudo .venv/bin/python bench/slurm_soak.py --minutes 10 --lose node2 --at 300   # the learner's second node

The job is the multi-node test's: the broker and learner rank 0 on node1, rank 1 on node2 (gloo over TCP
between the nodes), a torch rollout worker (the tiny model) on node2 and on node3, CURVE on. A lost node has its
link cut, then every process on it SIGKILLed (tests/slurm/localslurm.py: ``lose_node``); a lost learner node
requeues the job, whose start delay is skipped. At the end the job is cancelled (every step stops on TERM) and
checked with ``dora.ops.audit`` (the checks of ``dora audit``). Needs root (namespaces, Slurm's daemons).

Printed: steps committed and per minute, dead-peer declarations (and which were not on the lost node: false),
the lost node's detection (dead worker declared, or the requeued job's first step), the broker's RSS and open
file descriptors at the start and the end (of each attempt), its event-loop lag, and the audit's verdict.
Writes bench/out/slurm_soak.json.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.broker.journal import replay  # noqa: E402
from dora.ops.audit import audit_run, render  # noqa: E402
from tests.slurm.jobs import FINAL, events, status, submit_nodes, ts  # noqa: E402
from tests.slurm.localslurm import LocalSlurm, Unavailable  # noqa: E402


def rss_fds(pid: int) -> tuple[int, int]:
    """(RSS in KiB, open file descriptors) of a process; (0, 0) once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        return rss, len(list(pathlib.Path(f"/proc/{pid}/fd").iterdir()))
    except (FileNotFoundError, ProcessLookupError):
        return 0, 0


def broker_pid(run: pathlib.Path, attempt: int) -> int | None:
    try:
        found = json.loads((run / "broker.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    return int(found["pid"]) if found.get("slurm_restart", 0) == attempt else None


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--lose", choices=["node2", "node3"], help="lose this node once (node2: a learner node too)")
    p.add_argument("--at", type=float, default=300.0, metavar="SECONDS", help="when to lose it")
    p.add_argument("--out", default=str(ROOT / "bench" / "out" / "slurm_soak.json"))
    args = p.parse_args(argv)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="dora-slurm-soak-"))
    tmp.chmod(0o755)
    run = tmp / "run"
    cluster = LocalSlurm(nodes=4, kill_wait_s=10, slurmd_timeout_s=20, fall_back=False)
    try:
        cluster.start()
    except Unavailable as e:
        print(f"slurm_soak: {e}", file=sys.stderr)
        cluster.stop()
        return 2
    try:
        from dora.hf.tiny import build_model

        model = build_model(tmp / "model")
        job = submit_nodes(cluster, tmp, model, "core.total_steps=1000000")
        print(f"slurm soak: {args.minutes:g} min, job {job} on 3 of 4 nodes, run directory {run}"
              + (f"; {args.lose} lost at {args.at:g} s" if args.lose else ""), flush=True)  # fmt: skip
        samples: dict[int, list[tuple[float, int, int]]] = {}  # attempt -> (t, rss KiB, fds)
        lag: dict = {}
        started = time.monotonic()
        lost_at: float | None = None
        attempt = 0
        while time.monotonic() - started < 60 * args.minutes:
            time.sleep(2.0)
            state = cluster.job(job)
            attempt = int(state.get("Restarts", 0))
            if state.get("JobState") == "PENDING" and attempt:  # requeued: skip the start delay
                cluster.run(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False)
            if state.get("JobState") in FINAL:
                print(f"the job ended early: {state.get('JobState')}", flush=True)
                break
            pid = broker_pid(run, attempt)
            if pid is not None and (taken := rss_fds(pid))[0]:
                samples.setdefault(attempt, []).append((time.monotonic() - started, *taken))
            if args.lose and lost_at is None and time.monotonic() - started >= args.at:
                lost_at = time.time()
                killed = cluster.lose_node(args.lose)
                print(f"[{time.monotonic() - started:5.0f} s] {args.lose} lost: {len(killed)} processes", flush=True)
            if int(time.monotonic() - started) % 60 < 2:
                print(f"[{time.monotonic() - started:5.0f} s] attempt {attempt}, {replay(run / 'journal.jsonl').newest}"
                      " steps", flush=True)  # fmt: skip
        snap = status(cluster, run)
        lag = snap.get("loop_lag_ms", {}) if snap else {}
        cluster.run(["scancel", job])
        info = cluster.wait_state(job, FINAL, 120)
        return report(run, job, info, samples, lag, lost_at, args, cluster)
    finally:
        cluster.stop()


def report(run, job, info, samples, lag, lost_at, args, cluster) -> int:
    checked = audit_run(run / "journal.jsonl", run / "audit.jsonl")
    brokers = sorted(run.glob("logs/attempt-*/broker.log"))
    lost = [r for b in brokers for r in events(b, "peer_lost")]
    dead = [r for r in lost if r["reason"] in ("silent", "unreachable", "stalled")]
    false = [r for r in dead if not (args.lose and r["peer"].startswith(f"{args.lose}-"))]
    detect = None
    if lost_at is not None:
        mine = [ts(r) for r in dead if r["peer"].startswith(f"{args.lose}-")]
        later = [ts(r) for b in brokers[1:] for r in events(b, "train_step")]
        detect = round(min(later if args.lose == "node2" and later else mine or [lost_at]) - lost_at, 1)
    minutes = args.minutes
    result = {
        "minutes": minutes, "job": job, "final_state": info.get("JobState"), "restarts": int(info.get("Restarts", 0)),
        "steps": checked.steps_committed, "steps_per_min": round(checked.steps_committed / minutes, 1),
        "groups": checked.groups_trained, "dead_peers": len(dead), "false_deaths": len(false),
        "lost": args.lose, "recovery_s": detect, "loop_lag_ms": lag,
        "broker": {a: {"rss_mib": [round(s[0][1] / 1024), round(s[-1][1] / 1024)], "fds": [s[0][2], s[-1][2]]}
                   for a, s in samples.items()},
        "audit_ok": checked.ok, "problems": checked.problems,
    }  # fmt: skip
    print(
        f"\n{checked.steps_committed} steps committed in {minutes:g} min ({result['steps_per_min']}/min), "
        f"{checked.groups_trained} groups; job {info.get('JobState')}, restarts {result['restarts']}"
    )
    print(f"dead peers declared: {len(dead)}, of which false (not on a lost node): {len(false)}")
    if detect is not None:
        what = "the requeued job's first step" if args.lose == "node2" else "its worker declared dead"
        print(f"{args.lose} lost: {what} {detect} s later")
    for a, row in result["broker"].items():
        print(f"broker (attempt {a}): RSS {row['rss_mib'][0]} -> {row['rss_mib'][1]} MiB, open fds {row['fds'][0]} "
              f"-> {row['fds'][1]}")  # fmt: skip
    print(f"broker event-loop lag at the end, ms: {lag}")
    print(render(checked))
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))
    return 0 if checked.ok and not false else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
