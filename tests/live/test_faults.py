"""Faults against real processes: kill -9 and SIGSTOP of a worker, a learner paused for 30 s, SIGTERM."""

from __future__ import annotations

import contextlib
import pathlib
import signal
import subprocess
import sys
import time
from datetime import datetime

import pytest

from dora.broker.journal import replay
from dora.ops.status import fetch
from tests.live.cluster import BASE, Cluster, cluster

pytestmark = pytest.mark.timeout(180)

INTERVAL = BASE["broker"]["heartbeat_interval_s"]
CRASH_FOUND_S = 4 * INTERVAL
"""A crashed worker is found within about this, at the default liveness (a 10 s silence window): it misses a
heartbeat (2 intervals), the broker's next check sends it one, and that send finds its connection closed."""


def ts(rec: dict) -> float:
    return datetime.fromisoformat(rec["timestamp"].replace("Z", "+00:00")).timestamp()


def wait_until(pred, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def identity_of(c: Cluster, name: str, min_groups: int = 1, besides: frozenset[str] = frozenset()) -> tuple[str, dict]:
    """The broker identity of worker ``name`` once it holds at least ``min_groups`` groups; ``besides``: identities
    of its earlier processes (the broker keeps a killed one registered until its silence is noticed)."""

    def find():
        try:
            snap = fetch(c.endpoint)
        except TimeoutError:  # a loaded machine can keep an answer past the client's 5 s: ask again
            return None
        for ident, row in snap["workers"].items():
            if ident in besides:
                continue
            if ident.startswith(f"rollout/{name}/") and row["groups"] >= min_groups and row["ready"]:
                return ident, snap
        return None

    return wait_until(find, 30, f"{name} to hold a group")


def frozen_holding(c: Cluster, name: str) -> tuple[str, float]:
    """Stop worker ``name`` (SIGSTOP) at a moment the broker still counts a group as its own once what it sent
    before the stop has landed; its identity and when it stopped. (Seen holding a group, a worker can finish it
    before a signal arrives.)"""
    for _ in range(20):
        ident, _ = identity_of(c, name)
        stopped_at = time.time()
        c.signal(name, signal.SIGSTOP)
        time.sleep(0.1)
        row = fetch(c.endpoint)["workers"].get(ident)
        if row is not None and row["groups"] >= 1:
            return ident, stopped_at
        c.signal(name, signal.SIGCONT)
    raise AssertionError(f"{name} never held a group when stopped")


def test_kill_9_worker_mid_group_its_groups_are_re_leased_in_time(tmp_path):
    with cluster(tmp_path, {"core": {"total_steps": 12}, "log": {"level": "debug"}}) as c:
        c.start(workers=3)
        wait_until(lambda: fetch(c.endpoint)["step"] >= 2, 30, "step 2")
        ident, killed_at = frozen_holding(c, "w1")  # it makes no progress from here: the window starts now
        c.signal("w1", signal.SIGKILL)
        assert c.wait("learner", 90) == 0, c.log("learner")[-3000:]

        lost = [r for r in c.events("broker", "peer_lost") if r["peer"] == "w1"]
        assert len(lost) == 1 and lost[0]["reason"] == "unreachable" and lost[0]["groups"], lost
        held = set(lost[0]["groups"])
        leases = c.events("broker", "group_leased")
        window = CRASH_FOUND_S + 1.0
        for g in held:
            again = [r for r in leases if r["group_id"] == g and r["worker"] != ident and ts(r) > killed_at]
            assert again, f"group {g} of the killed worker was never leased again"
            assert ts(again[0]) - killed_at <= window, (g, ts(again[0]) - killed_at, window)
        c.check_exactly_once()  # 0 groups lost, 0 trained twice


def test_sigstop_worker_past_liveness_then_sigcont_nothing_trained_twice(tmp_path):
    # a 2 s silence window (4 x 0.5 s) instead of the default 10 s, to keep the test short
    with cluster(tmp_path, {"core": {"total_steps": 30}, "broker": {"liveness": 4}}) as c:  # room for w2 to be back
        c.start(workers=3)
        wait_until(lambda: fetch(c.endpoint)["step"] >= 2, 30, "step 2")
        frozen_holding(c, "w2")  # it holds work when it freezes
        wait_until(lambda: [r for r in c.events("broker", "peer_lost") if r["peer"] == "w2"], 10, "w2 declared dead")
        time.sleep(0.5)
        c.signal("w2", signal.SIGCONT)
        # it learns it was dropped, voids its work and joins again under a new identity
        wait_until(lambda: c.events("w2", "reconnecting"), 10, "w2 to reconnect")
        wait_until(lambda: len([r for r in c.events("broker", "peer_joined") if r["peer"] == "w2"]) == 2, 15,
                   "w2 to join again")  # fmt: skip
        assert fetch(c.endpoint)["step"] < 30, "the run ended before w2 was back: nothing left to test"
        assert c.wait("learner", 90) == 0, c.log("learner")[-3000:]
        lost = [r for r in c.events("broker", "peer_lost") if r["peer"] == "w2"]
        assert lost[0]["reason"] == "silent" and lost[0]["groups"]
        c.check_exactly_once()


@pytest.mark.parametrize("pause_s", [12, pytest.param(30, marks=pytest.mark.slow)], ids=["12s", "30s"])
def test_learner_paused_nothing_dropped_and_broker_memory_bounded(tmp_path, pause_s):
    """The learner stopped (SIGSTOP) for 12 s (30 s in .ci/slow: the test is mostly that wait), sampled once a
    second: admission holds the backlog from the first seconds on, and the broker's memory stays flat."""
    k, b = 2, 8
    with cluster(tmp_path, {"core": {"total_steps": 10, "max_staleness": k, "train_groups": b}}) as c:
        c.start(workers=3)
        broker_pid = c.procs["broker"].pid
        wait_until(lambda: fetch(c.endpoint)["step"] >= 3, 30, "step 3")
        c.signal("learner", signal.SIGSTOP)
        paused_at = time.monotonic()
        rss, waiting = [], []
        while time.monotonic() - paused_at < pause_s:
            snap = fetch(c.endpoint)
            untrained = snap["finished_waiting"] + sum(v["running"] + v["queued"] for v in snap["versions"].values())
            waiting.append(untrained)
            rss.append(rss_kib(broker_pid))
            time.sleep(1.0)
        c.signal("learner", signal.SIGCONT)
        assert c.wait("learner", 90) == 0, c.log("learner")[-3000:]
        assert c.wait("broker", 15) == 0
        # admission stops new work at (K + 1) x B untrained groups: the backlog cannot grow with the pause
        assert max(waiting) <= (k + 1) * b, waiting
        assert waiting[-1] == waiting[len(waiting) // 2], "still admitting work while the learner is away"
        assert max(rss[5:]) - min(rss[5:]) < 8 * 1024, rss  # KiB: flat, not growing with the pause
        lost = [r["reason"] for r in c.events("broker", "peer_lost") if r["role"] == "learner"]
        assert all(r.startswith("goodbye") for r in lost), lost  # never declared dead during the pause
        c.check_exactly_once()


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_sigterm_to_a_worker_waiting_for_a_broker_that_has_gone_ends_it_at_once(tmp_path):
    """The broker dies; w0 loses its session and waits for a connection again (up to its silence window, 30 s
    here). A SIGTERM meanwhile ends it within the 10 s of any other stop, with exit 0: the wait gives way to it."""
    with cluster(tmp_path, {"broker": {"liveness": 60}}) as c:
        c.start_broker()
        c.start_worker("w0")
        wait_until(lambda: c.events("w0", "registered"), 60, "w0 registered")
        c.signal("broker", signal.SIGKILL)
        wait_until(lambda: c.events("w0", "reconnecting"), 30, "w0 to lose its session")
        time.sleep(1.5)  # past its first backoff (1 s): it waits for a connection now
        started = time.monotonic()
        c.signal("w0", signal.SIGTERM)
        assert c.wait("w0", 10) == 0, c.log("w0")[-2000:]
        assert time.monotonic() - started < 10 and "Traceback" not in c.log("w0"), c.log("w0")[-2000:]


@pytest.mark.parametrize("repeat", ["once", "twice", "storm"], ids=["once", "twice-in-10ms", "every-ms-until-exit"])
def test_sigterm_drains_and_exits_0_within_10s(tmp_path, repeat):
    """T11: SIGTERM, SIGTERM and a second one 10 ms later (an impatient operator, or Slurm plus a wrapper), or
    SIGTERM every millisecond until the process is gone (one that lands while it exits must not kill it): every
    process says goodbye and exits 0 within 10 s, with no traceback."""
    with cluster(tmp_path, {"core": {"total_steps": 1000, "min_workers": 2}}) as c:
        c.start(workers=2)  # both workers serve before any signal (one still starting would exit without a word)
        wait_until(lambda: fetch(c.endpoint)["step"] >= 2, 30, "step 2")
        for name in ("w0", "learner", "w1", "broker"):
            started = time.monotonic()
            c.signal(name, signal.SIGTERM)
            if repeat == "twice":
                time.sleep(0.01)
                c.signal(name, signal.SIGTERM)
            while repeat == "storm" and c.procs[name].poll() is None and time.monotonic() - started < 10:
                time.sleep(0.001)
                with contextlib.suppress(ProcessLookupError):
                    c.signal(name, signal.SIGTERM)
            assert c.wait(name, 10) == 0, c.log(name)[-2000:]
            assert time.monotonic() - started < 10
            assert "Traceback" not in c.log(name), c.log(name)[-2000:]
        left = {r["peer"]: r["reason"] for r in c.events("broker", "peer_lost")}
        assert left.get("w0", "").startswith("goodbye") and left.get("learner-0", "").startswith("goodbye"), left


def test_workers_find_a_restarted_broker_through_the_discovery_file(tmp_path):
    with cluster(tmp_path, {"core": {"total_steps": 6}, "rollout": {"reconnect_max_s": 1.0}}) as c:
        c.start_broker()
        c.start_worker("w0")
        c.start_worker("w1")
        wait_until(lambda: len(fetch(c.endpoint)["workers"]) == 2, 30, "two workers")
        first = c.endpoint
        c.signal("broker", signal.SIGKILL)
        c.wait("broker", 10)
        wait_until(lambda: c.events("w0", "reconnecting") and c.events("w1", "reconnecting"), 15, "reconnects")
        c.start_broker()  # port 0 again: most likely another port, published in the discovery file
        c.start_learner()
        assert c.wait("learner", 90) == 0, c.log("learner")[-3000:]
        assert c.wait("broker", 15) == 0
        assert first != c.endpoint or first.startswith("ipc://")
        c.check_exactly_once()  # a fresh run on the new broker; its workers are the old processes


def test_broker_killed_and_restarted_resumes_from_its_journal(tmp_path):
    """T4: SIGKILL the broker mid-run and start a new one on the same journal. The workers find it through
    the discovery file, the learner rejoins (undoing a step whose publish was never journalled), and the
    run finishes: every step trained once, no group trained twice, the journal agrees with the learner."""
    journal = tmp_path / "journal.jsonl"
    steps = 16
    overrides = {"core": {"total_steps": steps, "min_workers": 2}, "broker": {"journal": str(journal)},
                 "rollout": {"reconnect_max_s": 1.0}}  # fmt: skip
    with cluster(tmp_path, overrides) as c:
        c.start(workers=2)
        wait_until(lambda: len(c.events("broker", "train_step")) >= 5, 60, "5 steps")
        c.signal("broker", signal.SIGKILL)
        c.wait("broker", 10)
        killed = time.monotonic()
        before = max(r["version"] for r in c.events("broker", "train_step"))
        c.start_broker(name="broker2")
        restarted = time.monotonic()
        assert c.wait("learner", 120) == 0, c.log("learner")[-3000:] + c.log("broker2")[-3000:]
        assert c.wait("broker2", 15) == 0, c.log("broker2")[-3000:]
        [resumed] = c.events("broker2", "resumed_from_journal")
        assert resumed["version"] >= before and resumed["earlier_epochs"] == 1
        joined = [r for r in c.events("broker2", "peer_joined")]
        assert {r["role"] for r in joined} == {"rollout", "learner"} and len({r["peer"] for r in joined}) >= 3
        first = min(ts(r) for r in c.events("broker2", "train_step"))
        audit = c.audit()
        assert [r["step"] for r in audit] == list(range(steps))  # every step once, in order
        trained = [g for r in audit for g in r["groups"]]
        assert len(trained) == len(set(trained)) == steps * c.cfg["core"]["train_groups"]
        assert replay(journal).trained == set(trained) and replay(journal).newest == steps
        print(
            f"T4: restart {restarted - killed:.2f} s after the kill; first step of the new broker "
            f"{first - ts(c.events('broker2', 'peer_joined')[0]):.2f} s after its first peer joined"
        )


def test_a_broker_that_filters_killed_and_restarted_consumes_every_group_once(tmp_path):
    """The same kill with learner.filter_uniform_groups = "replace" and half the groups uniform: the restarted
    broker owes neither the trained nor the filtered groups of its journal and counts the filtered ones in its
    budget, so the run ends having trained or filtered exactly ids 0 .. steps x B + filtered - 1, each once."""
    from dora.ops.audit import audit_run

    journal = tmp_path / "journal.jsonl"
    steps = 12
    overrides = {"core": {"total_steps": steps, "min_workers": 2}, "broker": {"journal": str(journal)},
                 "rollout": {"reconnect_max_s": 1.0}, "learner": {"filter_uniform_groups": "replace"},
                 "workload": {"uniform_share": 0.5}}  # fmt: skip
    with cluster(tmp_path, overrides) as c:
        c.start(workers=2)
        wait_until(lambda: len(c.events("broker", "train_step")) >= 4, 60, "4 steps")
        c.signal("broker", signal.SIGKILL)
        c.wait("broker", 10)
        c.start_broker(name="broker2")
        assert c.wait("learner", 120) == 0, c.log("learner")[-3000:] + c.log("broker2")[-3000:]
        assert c.wait("broker2", 15) == 0, c.log("broker2")[-3000:]
        [resumed] = c.events("broker2", "resumed_from_journal")
        assert resumed["filtered_groups"] > 0
        past = replay(journal)
        b = c.cfg["core"]["train_groups"]
        assert not past.trained & past.filtered
        assert sorted(past.trained | past.filtered) == list(range(steps * b + len(past.filtered)))
        assert sorted(g for r in c.audit() for g in r["groups"]) == sorted(past.trained)
        report = audit_run(journal, c.dir / "audit.jsonl", total_steps=steps)
        assert report.ok and report.groups_filtered == len(past.filtered), report.problems


def test_a_hung_engine_behind_a_live_heartbeat_is_declared_stalled_and_its_groups_re_leased(tmp_path):
    """T3: the worker keeps heartbeating but its engine makes no progress; the broker's stall watchdog
    ends its leases after stall_timeout_s and the groups are trained exactly once elsewhere."""
    script = pathlib.Path(__file__).with_name("hung_worker.py")
    overrides = {"core": {"total_steps": 8, "min_workers": 2}, "broker": {"stall_timeout_s": 1.5}}
    with cluster(tmp_path, overrides) as c:
        c.start_broker()
        c.start_worker("w0")
        with open(tmp_path / "hung.log", "wb") as log:
            c.procs["hung"] = subprocess.Popen(
                [sys.executable, str(script), "--broker", str(tmp_path / "broker.json"), "--config", str(c.config),
                 "--name", "hung", "--after", "3"], stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
        c.start_learner()
        assert c.wait("learner", 90) == 0, c.log("learner")[-3000:] + c.log("broker")[-3000:]
        stalled = [r for r in c.events("broker", "peer_lost") if r["reason"] == "stalled"]
        assert stalled and all(r["peer"] == "hung" for r in stalled), c.events("broker", "peer_lost")
        assert all(r["groups"] for r in stalled)  # it held work when it was declared stalled
        c.check_exactly_once()
        assert c.wait("hung", 15) == 0  # alive to the end (its loop ran on): only the watchdog could tell


def test_random_sigkills_of_workers_lose_nothing_and_train_nothing_twice(tmp_path):
    """T1: four SIGKILLs of randomly chosen workers (seeded), each restarted a moment later under the same
    name; the run finishes with every group trained exactly once within K, and each kill is noticed."""
    import random

    rng = random.Random(7)
    with cluster(tmp_path, {"core": {"total_steps": 30}}) as c:
        c.start(workers=3)
        kills = []
        killed: set[str] = set()
        for n in range(4):
            wait_until(lambda n=n: fetch(c.endpoint)["step"] >= 3 + 5 * n, 60, f"step {3 + 5 * n}")
            victim = f"w{rng.randrange(3)}"
            # registered and loaded: a restarted one may still be starting, behind its killed self's registration
            ident, _ = identity_of(c, victim, min_groups=0, besides=frozenset(killed))
            killed.add(ident)
            c.signal(victim, signal.SIGKILL)
            c.procs[victim].wait(10)
            kills.append((victim, time.time()))
            time.sleep(rng.uniform(0.1, 0.8))
            # No step is trained until the new process has joined: on a loaded machine its start can take longer
            # than the steps left, and the run would end before the next kill could find it (a paused learner is
            # not declared dead, and the workers go on rolling out meanwhile).
            c.signal("learner", signal.SIGSTOP)
            try:
                c.start_worker(victim)
                identity_of(c, victim, min_groups=0, besides=frozenset(killed))
            finally:
                c.signal("learner", signal.SIGCONT)
        assert c.wait("learner", 120) == 0, c.log("learner")[-3000:]
        c.check_exactly_once()
        lost = [r for r in c.events("broker", "peer_lost") if r["reason"] in ("silent", "unreachable")]
        assert len(lost) == len(kills) and {r["reason"] for r in lost} == {"unreachable"}, (kills, lost)
        latencies = sorted(round(ts(r) - t, 2) for (_, t), r in zip(kills, sorted(lost, key=ts), strict=True))
        assert max(latencies) <= CRASH_FOUND_S + 1.0, latencies
        print(f"T1: {len(kills)} kills, declared dead after {latencies} s")


def test_message_chaos_on_every_link_loses_nothing_and_trains_nothing_twice(tmp_path):
    """T6: every message between the broker and its peers goes through `dora chaos`, which drops 5%,
    duplicates 5% and holds back 10% for up to 200 ms (so later ones overtake them). Lost commands are
    found by the heartbeats' lease reports, lost results and requests are sent again; the run finishes
    with every group trained exactly once within K and no mixed-version trajectory."""
    with cluster(tmp_path, {"core": {"total_steps": 20}, "broker": {"liveness": 6}}) as c:
        c.start_broker()
        c.start_chaos("--drop", "0.05", "--dup", "0.05", "--delay", "0.10", "--max-delay-ms", "200", "--seed", "6")
        for i in range(3):
            c.start_worker(f"w{i}")
        c.start_learner()
        assert c.wait("learner", 150) == 0, c.log("learner")[-3000:] + c.log("broker")[-3000:]
        assert c.wait("broker", 15) == 0, c.log("broker")[-3000:]
        c.signal("chaos", signal.SIGTERM)
        assert c.wait("chaos", 10) == 0
        c.check_exactly_once()
        [counts] = c.events("chaos", "chaos_counts")
        for direction in ("up", "down"):  # the faults really happened, both ways
            assert counts[f"{direction} dropped"] > 10 and counts[f"{direction} duplicated"] > 10, counts
            assert counts[f"{direction} delayed"] > 20, counts
        lost = c.events("broker", "lease_lost")
        assert lost, "no lease was lost on the way: the reconciliation went untested"
        print(f"T6: {len(lost)} leases found lost by heartbeats and re-queued; proxy counts {counts}")


def maps(pid: int, library: str) -> bool:
    """The process has mapped a shared library whose name holds ``library`` (it is importing it, or has)."""
    with open(f"/proc/{pid}/maps") as f:
        return library in f.read()


# slow: [0.5] is one more moment of the imports [0.0] stops a worker and a learner in
@pytest.mark.parametrize("after_s", [0.0, pytest.param(0.5, marks=pytest.mark.slow)])
def test_sigterm_while_starting_exits_0(tmp_path, tiny_model, after_s):
    """SIGTERM twice 10 ms apart to a worker and a learner still starting (importing torch, loading the model; their
    event loops do not run yet) ends them with exit 0 and no traceback, as it does once they serve: never the
    default action's death by signal (-15)."""
    with cluster(tmp_path, {"rollout": {"model": str(tiny_model)}, "learner": {"model": str(tiny_model)}}) as c:
        procs = {"w0": c.start_worker("w0", "torch"), "learner": c.start_learner("torch")}
        for name, proc in procs.items():  # torch is a second or more of imports before any event loop
            wait_until(lambda p=proc: p.poll() is not None or maps(p.pid, "libtorch"), 60, f"{name} to import torch")
        time.sleep(after_s)
        for name in procs:
            c.signal(name, signal.SIGTERM)
            time.sleep(0.01)
            with contextlib.suppress(ProcessLookupError):
                c.signal(name, signal.SIGTERM)
        for name in procs:
            assert c.wait(name, 10) == 0, c.log(name)[-2000:]
            assert "Traceback" not in c.log(name), c.log(name)[-2000:]
