"""Soak runs: a live run under one fault schedule for minutes, then the exactly-once audit and the figures.

    python bench/soak.py --scenario workers --minutes 10     # T1: SIGKILL a random worker every U(5, 20) s
    python bench/soak.py --scenario broker --minutes 10      # T4: SIGKILL the broker every 2 min, restart 1 s later
    python bench/soak.py --scenario learner --minutes 10     # T5: SIGKILL the learner every U(30, 90) s, restart it
    python bench/soak.py --scenario quiet --minutes 10       # T12: no faults (false deaths, broker memory)
    python bench/soak.py --scenario chaos --minutes 5        # T6: every link through `dora chaos`
                                                             #     (5% dropped, 5% duplicated, 10% delayed <= 200 ms)

Broker, 3 rollout workers (sim engine) and the sim learner, as real processes on loopback, from
examples/live/sim.toml with a broker journal. Killed processes are restarted after the scenario's
delay; the broker comes back on its journal. At the end everything gets SIGTERM, and the run is
checked from the learner's audit (committed steps only) and the journal by `dora.ops.audit` (the checks
of `dora audit`):
- every committed step once and in order, no group trained twice, staleness <= K, no mixed-version
  trajectory;
- the learner and the broker agree on what was trained (a learner killed between the broker's record
  and its own leaves the journal a step ahead: printed as a note).
Printed: kills, how long each took to be noticed (dead worker declared, or the first step after the new
broker or learner started), steps per minute, false dead-worker declarations, the broker's RSS and open file descriptors
at start and end, its event-loop lag (how late its heartbeat timer ran: p50, p99, max), and for the
chaos scenario the proxy's counts and the leases the broker found lost and re-queued.
The seed is printed; the same seed gives the same fault schedule. Exit status 1 if a check fails.
"""

from __future__ import annotations

import argparse
import pathlib
import random
import signal
import sys
import tempfile
import time
import tomllib
from datetime import datetime

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from dora.actor.discovery import resolve_endpoint  # noqa: E402
from dora.launch.local import LocalRun  # noqa: E402
from dora.ops.audit import audit_run  # noqa: E402
from dora.ops.status import fetch  # noqa: E402

SCHEDULES = {  # (seconds between faults, seconds before the restart)
    "workers": ((5.0, 20.0), (0.0, 5.0)),
    "broker": ((120.0, 120.0), (1.0, 1.0)),
    "learner": ((30.0, 90.0), (0.5, 3.0)),
    "quiet": (None, None),
    "chaos": (None, None),
}
CHAOS = ("--drop", "0.05", "--dup", "0.05", "--delay", "0.10", "--max-delay-ms", "200")


def ts(rec: dict) -> float:
    return datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def fds(pid: int) -> int:
    return len(list(pathlib.Path(f"/proc/{pid}/fd").iterdir()))


def config(rundir: pathlib.Path, time_scale: float) -> dict:
    cfg = tomllib.loads((ROOT / "examples" / "live" / "sim.toml").read_text())
    cfg["run"]["time_scale"] = time_scale
    cfg["core"]["total_steps"] = 1_000_000  # ended by SIGTERM
    cfg["broker"]["journal"] = str(rundir / "journal.jsonl")
    cfg["learner"]["audit_file"] = str(rundir / "audit.jsonl")
    cfg["log"] = {"format": "json"}
    return cfg


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scenario", choices=list(SCHEDULES), required=True)
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--every", type=float, metavar="SECONDS", help="a fault this often instead of the schedule")
    p.add_argument("--time-scale", type=float, default=0.005)
    p.add_argument("--out", help="run directory (default: a new temporary one)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    rundir = pathlib.Path(args.out or tempfile.mkdtemp(prefix="dora-soak-"))
    run = LocalRun(rundir, config(rundir, args.time_scale), threads=1)
    brokers = ["broker"]
    kills: list[tuple[str, float]] = []
    restarts: list[float] = []
    print(f"soak: {args.scenario}, {args.minutes:g} min, seed {args.seed}, run directory {rundir}", flush=True)
    if args.scenario == "chaos":
        run.start_broker()
        run.start_chaos(*CHAOS, "--seed", str(args.seed))
        for i in range(3):
            run.start_worker(f"w{i}")
        run.start_learner()
    else:
        run.start(workers=3)
    rss = [rss_kib(run.procs["broker"].pid)]
    open_fds = [fds(run.procs["broker"].pid)]
    lag: dict = {}
    end = time.monotonic() + 60 * args.minutes
    every, delay = SCHEDULES[args.scenario]
    if args.every and every:
        every = (args.every, args.every)
    next_fault = time.monotonic() + (rng.uniform(*every) if every else float("inf"))
    try:
        while time.monotonic() < end:
            time.sleep(0.2)
            if time.monotonic() < next_fault:
                continue
            victim = {"workers": f"w{rng.randrange(3)}", "broker": brokers[-1], "learner": "learner"}[args.scenario]
            run.signal(victim, signal.SIGKILL)
            run.procs[victim].wait(10)
            kills.append((victim, time.time()))
            time.sleep(rng.uniform(*delay))
            if args.scenario == "broker":
                brokers.append(f"broker{len(brokers)}")
                run.start_broker(name=brokers[-1])
                restarts.append(time.time())
            elif args.scenario == "learner":
                run.start_learner()
                restarts.append(time.time())
            else:
                run.start_worker(victim)
            print(f"[{time.monotonic() - end + 60 * args.minutes:6.0f} s] killed and restarted {victim}", flush=True)
            next_fault = time.monotonic() + rng.uniform(*every)
        rss.append(rss_kib(run.procs[brokers[-1]].pid))
        open_fds.append(fds(run.procs[brokers[-1]].pid))
        lag = fetch(resolve_endpoint(str(rundir / "broker.json")))["loop_lag_ms"]
    finally:
        codes = run.stop(grace_s=10.0)
    return report(run, rundir, brokers, kills, restarts, rss, codes, args, open_fds, lag)


def report(run, rundir, brokers, kills, restarts, rss, codes, args, open_fds, lag) -> int:
    checked = audit_run(rundir / "journal.jsonl", rundir / "audit.jsonl")
    problems = list(checked.problems)
    lost = [r for b in brokers for r in run.events(b, "peer_lost") if r.get("role") == "rollout"]
    dead = sorted(ts(r) for r in lost if r["reason"] in ("silent", "unreachable", "stalled"))
    noticed = []
    for name, at in kills:
        if name.startswith("w"):
            later = [t for t in dead if t >= at]
            noticed.append(round(later[0] - at, 2) if later else None)
    for at in restarts:
        first = [ts(r) for b in brokers for r in run.events(b, "train_step") if ts(r) > at]
        noticed.append(round(min(first) - at, 2) if first else None)
    false_deaths = len(dead) - sum(1 for n, _ in kills if n.startswith("w"))
    minutes = args.minutes
    steps = checked.steps_committed
    after = "new learner's first step after its start" if args.scenario == "learner" else "new broker's first step"
    print(f"\n{args.scenario}: {steps} steps committed in {minutes:g} min ({steps / minutes:.1f}/min), "
          f"{checked.groups_trained} groups, {len(kills)} kills, max staleness "
          f"{max(checked.staleness, default=0)} (K = {checked.k})")  # fmt: skip
    if noticed:
        shown = [x for x in noticed if x is not None]
        print(f"recovery (dead worker declared / {after}), s: max {max(shown, default=0):.2f}, "
              f"median {sorted(shown)[len(shown) // 2] if shown else 0:.2f}, all {noticed}")  # fmt: skip
    print(f"dead-worker declarations without a kill: {max(0, false_deaths)}; broker RSS {rss[0] / 1024:.0f} -> "
          f"{rss[-1] / 1024:.0f} MiB; open fds {open_fds[0]} -> {open_fds[-1]}; exit codes {codes}")  # fmt: skip
    print(f"broker event-loop lag, ms: {lag}")
    if args.scenario == "chaos":
        counts = {k: v for r in run.events("chaos", "chaos_counts") for k, v in r.items() if k != "event"}
        lost = sum(1 for b in brokers for _ in run.events(b, "lease_lost"))
        print(f"chaos proxy: {counts}; leases found lost by heartbeats and re-queued: {lost}")
    for note in checked.notes:
        print(f"note: {note}")
    for problem in problems:
        print(f"FAILED: {problem}")
    if not problems:
        print("exactly-once: every committed step once, no group twice, staleness <= K, learner and broker agree")
    return 1 if problems or None in noticed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
