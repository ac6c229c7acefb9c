"""1,024 rollout workers on one `dora broker`: memory, event-loop lag, lease and heartbeat latency, false deaths.

    python bench/many_workers.py [--workers 1024] [--procs 4] [--seconds 60] [--profile OUT.prof]

The broker is the real `dora broker` process (dora mode, default heartbeat interval and liveness). The
rollout peers are zmq DEALER sockets spread over ``--procs`` processes (one zmq.Context and one poller
loop each). Every peer says Hello as a rollout worker, heartbeats at the broker's interval as a real
worker does (the highest command seen, the leases it holds, its version), and serves with a
zero-latency engine: a Generate is answered at once with the group's finished samples of ``--tokens``
tokens. A fake learner takes each batch and publishes the next version at once, so a training loop runs
through the fleet and the broker's own work is what limits it.

Measured over the window after the warm-up (all peers joined, a few steps trained):
- broker RSS: VmRSS of the broker process, sampled every 0.2 s through the whole run; the peak;
- event-loop lag: the broker's own probe (a task that sleeps 50 ms and records how late it woke), read
  from its Prometheus histogram at the window's start and end (so: bucket bounds) and from `dora status`
  (p50/p99 of the latest 4,096 samples: the whole run, startup included);
- lease fan-out: from the learner's publish of version v to each Generate of version v arriving at its
  peer. A publish is what opens the next batch's worth of work: the broker re-assigns the idle fleet to
  v, the learner's next request takes a batch, and the room it frees is leased on v. So this is the time
  one training step's work takes to reach the fleet (the weights reload round trips included);
- result round trip: a peer's finished group sent to its acknowledgement received;
- heartbeat round trip: the broker answers every rollout heartbeat; a peer's heartbeat sent to the answer;
- false dead-peer declarations: a Disconnect at a peer (which heartbeats throughout), the broker's count
  of lost rollout peers, and the log's peer_expired/peer_lost/lease_lost lines before the peers stop;
  groups re-queued beside them;
- steps/s and trajectories/s of the training loop; the broker's CPU per step and the share of the window
  it was runnable but waiting for a core (/proc/<pid>/schedstat).

Peers, learner and broker share this machine's cores. The peers run at ``--peer-nice`` (10): on a cluster
they are other machines, here they would otherwise take cores from the broker. Latencies seen by a peer
include its own process's queueing (it serves ``workers / procs`` sockets). The broker logs at warning
(``--log-level info`` adds a line per worker assigned a version, about a thousand per step here).
Writes bench/out/many_workers.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import pathlib
import queue
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from typing import Any

import numpy as np
import zmq

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.broker_throughput import cpu_s, fake_learner  # noqa: E402
from bench.fleet import serve_peers  # noqa: E402
from dora.config.run import BrokerSection  # noqa: E402
from dora.ops.status import fetch  # noqa: E402
from dora.wire import codec  # noqa: E402
from dora.wire import messages as m  # noqa: E402

WARN_EVENTS = ("peer_expired", "peer_lost", "lease_lost")
TARGETS = {"rss_mb": 300.0, "loop_lag_p99_ms": 20.0, "false_deaths": 0}


# ---------------------------------------------------------------------- the broker and its numbers


def start_broker(tmp: pathlib.Path, args: argparse.Namespace) -> tuple[subprocess.Popen, dict]:
    """`dora broker` with the default heartbeat interval, liveness and orchestrator tick; its ready line."""
    (tmp / "run.toml").write_text(
        f'[core]\nmode = "dora"\nmax_staleness = {args.max_staleness}\ntrain_groups = {args.train_groups}\n'
        f"group_size = {args.group_size}\n"
        f'[broker]\nbind = "ipc://{tmp}/broker.sock"\ndiscovery_file = "{tmp}/broker.json"\n'
        'metrics_bind = "127.0.0.1:0"\nexit_when_done = false\n'
        f'[log]\nformat = "json"\nlevel = "{args.log_level}"\n'
    )
    prof = ["-m", "cProfile", "-o", args.profile] if args.profile else []
    with open(tmp / "broker.log", "wb") as err:
        broker = subprocess.Popen([sys.executable, *prof, "-m", "dora", "broker", "--config", str(tmp / "run.toml")],
                                  stdout=subprocess.PIPE, stderr=err)  # fmt: skip
    return broker, json.loads(broker.stdout.readline())


def waited_s(pid: int) -> float:
    """Seconds the process was runnable but waiting for a core (/proc/<pid>/schedstat): the machine's contention."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[1]) / 1e9


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def sample_rss(pid: int, stop: threading.Event, into: list[tuple[float, float]]) -> None:
    while not stop.wait(0.2):
        try:
            into.append((time.monotonic(), rss_mb(pid)))
        except OSError:
            return


def lag_buckets(url: str) -> dict[float, float]:
    """The broker's loop-lag histogram: upper bound (s) -> beats at or below it (cumulative)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("dora_event_loop_lag_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            out[float("inf") if le == "+Inf" else float(le)] = float(line.rsplit(" ", 1)[1])
    return out


def bucket_quantile(before: dict[float, float], after: dict[float, float], q: float) -> tuple[float, int]:
    """The smallest bucket bound (ms) holding a fraction ``q`` of the beats between two scrapes; the beats."""
    diff = {le: after[le] - before.get(le, 0.0) for le in sorted(after)}
    n = int(diff[float("inf")])
    for le, below in diff.items():
        if n and below >= q * n:
            return 1000 * le, n
    return float("nan"), n


def pct(values: list[float], *qs: float) -> dict[str, float]:
    if not values:
        return {"n": 0}
    a = np.asarray(values) * 1000
    return {"n": len(a), **{f"p{round(q * 100)}": round(float(np.quantile(a, q)), 2) for q in qs},
            "max": round(float(a.max()), 2)}  # fmt: skip


def warnings_in(log: pathlib.Path, until: float) -> dict[str, int]:
    """The broker's peer_expired, peer_lost and lease_lost lines logged before ``until`` (wall clock): after it
    the peers stop, and the broker rightly loses them."""
    counts = dict.fromkeys(WARN_EVENTS, 0)
    for line in log.read_text(errors="replace").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        at = datetime.datetime.fromisoformat(row.get("timestamp", "").replace("Z", "+00:00")).timestamp()
        if row.get("event") in counts and at < until:
            counts[row["event"]] += 1
    return counts


# ---------------------------------------------------------------------- the run


def take(out: Any, procs: list[mp.Process], what: str) -> Any:
    """The next ``what`` a peer process reports; an error if one of them died instead."""
    while True:
        try:
            kind, value = out.get(timeout=1.0)
        except queue.Empty:
            if not all(p.is_alive() for p in procs):
                raise RuntimeError("a peer process died (its traceback is above)") from None
            continue
        if kind != what:
            raise RuntimeError(f"a peer process reported {kind} while {what} was awaited")
        return value


def run(args: argparse.Namespace) -> dict[str, Any]:
    tmp = pathlib.Path(tempfile.mkdtemp(prefix="dora-many-"))
    load = os.getloadavg()  # the machine's other work competes for the same cores: reported beside the figures
    interval_s = BrokerSection().heartbeat_interval_s
    broker, ready = start_broker(tmp, args)
    endpoint, started = ready["endpoint"], time.monotonic()
    rss: list[tuple[float, float]] = []
    done = threading.Event()
    threading.Thread(target=sample_rss, args=(broker.pid, done, rss), daemon=True).start()
    stop, out = mp.Event(), mp.Queue()
    names = [f"w{i:04d}" for i in range(args.workers)]
    per = -(-args.workers // args.procs)
    procs = [mp.Process(target=serve_peers, args=(endpoint, names[i : i + per], args.group_size * args.slot_groups,
                                                  args.tokens, interval_s, args.peer_nice, stop, out))
             for i in range(0, args.workers, per)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        welcomed = [take(out, procs, "welcomed") for _ in procs]
        join_s = max(welcomed) - started
        ctx = zmq.Context()
        learner = fake_learner(ctx, endpoint)
        published: dict[int, float] = {}
        steps = trajectories = 0
        t0 = c0 = lag0 = None
        peers_c0 = w0 = 0.0
        warm = time.monotonic() + args.warmup
        end = warm + args.seconds
        while time.monotonic() < end:
            if t0 is None and time.monotonic() >= warm:
                t0, c0, lag0 = time.monotonic(), cpu_s(broker.pid), lag_buckets(ready["metrics_url"])
                w0 = waited_s(broker.pid)
                peers_c0 = sum(cpu_s(p.pid) for p in procs)
            if not learner.poll(100):
                continue
            msg = codec.decode(learner.recv_multipart(copy=False))
            if not isinstance(msg, m.TrainBatch):
                continue
            if t0 is not None:
                steps += 1
                trajectories += sum(len(g.samples) for g in msg.groups)
            published[msg.step + 1] = time.monotonic()
            learner.send_multipart(codec.encode(m.WeightsPublished(version=msg.step + 1, uri="bench", sha256="0" * 64)))
            learner.send_multipart(codec.encode(m.RequestBatch(step=msg.step + 1)))
        t1, t1_wall = time.monotonic(), time.time()
        cpu, lag1, waited = cpu_s(broker.pid) - c0, lag_buckets(ready["metrics_url"]), waited_s(broker.pid) - w0
        peers_cpu = sum(cpu_s(p.pid) for p in procs) - peers_c0
        status = fetch(endpoint, timeout_s=30)
        stop.set()
        reports = [take(out, procs, "report") for _ in procs]
        ctx.destroy(linger=0)
    finally:
        stop.set()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        done.set()
        broker.terminate()  # graceful: a profile gets written
        try:
            broker.wait(timeout=60)
        except subprocess.TimeoutExpired:
            broker.kill()
            broker.wait()
    wall = t1 - t0
    window = [r for r in rss if t0 <= r[0] <= t1]

    def within(key: str) -> list[Any]:
        return [x for r in reports for x in r[key] if t0 <= x[0] <= t1]

    fanout = [t - published[v] for t, v in within("leases") if v in published]
    lag50, beats = bucket_quantile(lag0, lag1, 0.5)
    lag99, _ = bucket_quantile(lag0, lag1, 0.99)
    counters = status["counters"]
    return {
        "config": {
            "workers": args.workers,
            "procs": len(procs),
            "group_size": args.group_size,
            "train_groups": args.train_groups,
            "max_staleness": args.max_staleness,
            "tokens": args.tokens,
            "slots": args.group_size * args.slot_groups,
            "heartbeat_interval_s": interval_s,
            "liveness": BrokerSection().liveness,
            "tick_s": BrokerSection().tick_s,
            "profiled": bool(args.profile),
            "peer_nice": args.peer_nice,
            "log_level": args.log_level,
        },
        "join_s": round(join_s, 2),
        "load_average": {"before": load[0], "after": os.getloadavg()[0]},
        "window_s": round(wall, 2),
        "steps": steps,
        "steps_per_s": round(steps / wall, 2),
        "trajectories_per_s": round(trajectories / wall, 1),
        "peers_served": sum(r["served"] for r in reports),
        "broker_cpu_fraction": round(cpu / wall, 3),
        "broker_cpu_ms_per_step": round(1000 * cpu / max(steps, 1), 1),
        "broker_waiting_for_cpu_fraction": round(waited / wall, 3),
        "peers_cpu_fraction": round(peers_cpu / wall, 3),
        "rss_mb": {
            "peak": round(max(v for _, v in rss), 1),
            "window_peak": round(max(v for _, v in window), 1),
            "end": round(rss[-1][1], 1),
        },
        "loop_lag_ms": {
            "window_p50_le": lag50,
            "window_p99_le": lag99,
            "window_beats": beats,
            "status_all_beats": status["loop_lag_ms"],
        },
        "lease_fanout_ms": pct(fanout, 0.5, 0.99),
        "result_rtt_ms": pct([x for _, x in within("result_rtt")], 0.5, 0.99),
        "heartbeat_rtt_ms": pct([x for _, x in within("beat_rtt")], 0.5, 0.99),
        "heartbeats": {
            "sent": sum(r["beats_sent"] for r in reports),
            "answered": sum(r["beats_answered"] for r in reports),
        },
        "false_deaths": {
            "disconnects_at_peers": sum(len(r["disconnects"]) for r in reports),
            "broker_lost_rollout": counters.get("lost rollout", 0),
            "broker_requeued_groups": status["requeued_groups"],
            "log": warnings_in(tmp / "broker.log", until=t1_wall),
        },
        "peer_counts": {k: sum(r["counts"][k] for r in reports) for k in reports[0]["counts"]},
        "broker_counters": counters,
        "decision_s": {k: round(v, 3) for k, v in status["decision_s"].items()},
    }


def quantiles(d: dict[str, float]) -> str:
    return f"{d.get('p50', float('nan')):g} / {d.get('p99', float('nan')):g} ms"


def print_table(r: dict[str, Any]) -> None:
    fd, lag, c = r["false_deaths"], r["loop_lag_ms"], r["config"]
    deaths = fd["disconnects_at_peers"] + fd["broker_lost_rollout"] + sum(fd["log"].values())
    seen = f"peers {fd['disconnects_at_peers']}, broker {fd['broker_lost_rollout']}, log {sum(fd['log'].values())}"
    window = f"<= {lag['window_p50_le']:g} / <= {lag['window_p99_le']:g} ms ({lag['window_beats']} samples)"
    rows = [
        ("broker RSS peak", f"{r['rss_mb']['peak']:.0f} MB", "<= 300 MB", r["rss_mb"]["peak"] <= TARGETS["rss_mb"]),
        ("event-loop lag p50 / p99 (window, bucket bound)", window, "p99 <= 20 ms",
         lag["window_p99_le"] <= TARGETS["loop_lag_p99_ms"]),
        ("event-loop lag p50 / p99 (status, latest 4,096)", quantiles(lag["status_all_beats"]), "", None),
        ("lease fan-out p50 / p99 (publish -> Generate)", quantiles(r["lease_fanout_ms"]), "", None),
        ("result round trip p50 / p99", quantiles(r["result_rtt_ms"]), "", None),
        ("heartbeat round trip p50 / p99", quantiles(r["heartbeat_rtt_ms"]), "", None),
        ("false dead-peer declarations", f"{deaths} ({seen})", "0", deaths == 0),
        ("re-queued groups", f"{fd['broker_requeued_groups']}", "", None),
        ("training loop", f"{r['steps_per_s']:g} steps/s, {r['trajectories_per_s']:,.0f} trajectories/s", "", None),
    ]  # fmt: skip
    print(
        f"{c['workers']} rollout peers in {c['procs']} processes, G={c['group_size']}, B={c['train_groups']}, "
        f"K={c['max_staleness']}, {c['tokens']} tokens/sample, heartbeat {c['heartbeat_interval_s']} s; all joined "
        f"in {r['join_s']} s; {r['steps']} steps in {r['window_s']} s; {r['peers_served']} peers served"
    )
    print(
        f"broker CPU {100 * r['broker_cpu_fraction']:.0f}% of a core ({r['broker_cpu_ms_per_step']:g} ms a step), "
        f"waiting for a core {100 * r['broker_waiting_for_cpu_fraction']:.0f}% of the time; peers' CPU "
        f"{100 * r['peers_cpu_fraction']:.0f}%; load average {r['load_average']['before']:.1f} -> "
        f"{r['load_average']['after']:.1f} on {os.cpu_count()} cores"
    )
    for name, value, target, met in rows:
        verdict = "" if met is None else ("met" if met else "MISSED")
        print(f"  {name:<50} {value:<40} {target:<13} {verdict}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=1024)
    p.add_argument("--procs", type=int, default=4, help="processes the peers are spread over")
    p.add_argument("--seconds", type=float, default=60.0, help="measured window")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of training before the window starts")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--train-groups", type=int, default=128)
    p.add_argument("--max-staleness", type=int, default=2)
    p.add_argument("--slot-groups", type=int, default=1, help="groups a peer may hold at once (slots = this x G)")
    p.add_argument("--peer-nice", type=int, default=10, help="niceness of the peer processes: on a cluster the "
                   "workers are other machines, here they share the broker's cores (0: compete with it)")  # fmt: skip
    p.add_argument("--log-level", default="warning", choices=("debug", "info", "warning", "error"),
                   help="the broker's log level (info writes a line per worker assigned a version)")  # fmt: skip
    p.add_argument("--profile", metavar="OUT.prof", help="run the broker under cProfile (slower) and write the profile")
    p.add_argument("--out", default=str(ROOT / "bench/out/many_workers.json"))
    args = p.parse_args()
    result = run(args)
    print_table(result)
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
