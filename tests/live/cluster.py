"""A live dora run as real processes for tests: broker, sim rollout workers and the sim learner.

Every process is started with ``subprocess.Popen`` and stopped by its PID. The broker binds to
127.0.0.1 port 0 (or an ipc path in the test's temp dir) and the others find it through its
discovery file. Logs are JSON lines, one file per process, parsed by ``events``.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

BASE = {
    "run": {"time_scale": 0.005, "max_tokens": 4096},
    "core": {"mode": "dora", "max_staleness": 2, "train_groups": 8, "group_size": 4, "total_steps": 20},
    "broker": {"bind": "tcp://127.0.0.1:0", "heartbeat_interval_s": 0.25, "liveness": 4, "tick_s": 0.5,
               "strict": True},
    "engine": {"tpot_base_s": 0.02, "tpot_per_seq_s": 0.0001, "max_slots": 64, "credit_slots": 64,
               "prefill_s_per_token": 2e-5, "load_s": 1.0},
    "trainer": {"gpu_s_per_token": 0.0005, "step_fixed_s": 2.0, "publish_s": 0.5},
    "workload": {"median": 300.0, "sigma": 1.1, "cap": 4096, "prompt_tokens": 50.0},
    "log": {"format": "json"},
}  # fmt: skip


def to_toml(cfg: dict[str, dict[str, Any]]) -> str:
    lines = []
    for section, values in cfg.items():
        lines.append(f"[{section}]")
        lines.extend(f"{k} = {json.dumps(v)}" for k, v in values.items())
    return "\n".join(lines) + "\n"


def merged(overrides: dict[str, dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    cfg = {s: dict(v) for s, v in BASE.items()}
    for section, values in (overrides or {}).items():
        cfg.setdefault(section, {}).update(values)
    return cfg


class Cluster:
    def __init__(self, tmp: pathlib.Path, overrides: dict[str, dict[str, Any]] | None = None) -> None:
        self.tmp = tmp
        self.cfg = merged(overrides)
        self.cfg["broker"]["discovery_file"] = str(tmp / "broker.json")
        self.cfg.setdefault("learner", {})["audit_file"] = str(tmp / "audit.jsonl")
        self.config = tmp / "run.toml"
        self.config.write_text(to_toml(self.cfg))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.endpoint = ""

    # ---------------------------------------------------------------- processes

    def spawn(self, name: str, *args: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"{name}.log", "wb")  # noqa: SIM115 (closed with the process)
        proc = subprocess.Popen([sys.executable, "-m", "dora", *args, "--config", str(self.config)],
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
        log.close()
        self.procs[name] = proc
        return proc

    def start_broker(self, timeout_s: float = 20.0) -> str:
        disc = self.tmp / "broker.json"
        disc.unlink(missing_ok=True)
        proc = self.spawn("broker", "broker")
        deadline = time.monotonic() + timeout_s
        while not disc.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"broker exited with {proc.returncode}:\n{self.log('broker')[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError("broker did not write its discovery file")
            time.sleep(0.05)
        self.endpoint = json.loads(disc.read_text())["endpoint"]
        return self.endpoint

    def start_worker(self, name: str) -> subprocess.Popen[bytes]:
        return self.spawn(name, "rollout", "--engine", "sim", "--broker", str(self.tmp / "broker.json"), "--name", name)

    def start_learner(self) -> subprocess.Popen[bytes]:
        return self.spawn("learner", "learner", "--trainer", "sim", "--broker", str(self.tmp / "broker.json"))

    def start(self, workers: int = 3) -> None:
        self.start_broker()
        for i in range(workers):
            self.start_worker(f"w{i}")
        self.start_learner()

    def signal(self, name: str, sig: int) -> None:
        os.kill(self.procs[name].pid, sig)

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return self.procs[name].wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} still running after {timeout_s} s:\n{self.log(name)[-3000:]}") from None

    def stop(self) -> None:
        """SIGKILL by PID whatever is still running (tests stop things on purpose before this)."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=10)

    # ---------------------------------------------------------------- evidence

    def log(self, name: str) -> str:
        path = self.tmp / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def events(self, name: str, event: str | None = None) -> list[dict[str, Any]]:
        out = []
        for line in self.log(name).splitlines():
            if line.startswith("{"):
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if event is None or rec.get("event") == event:
                    out.append(rec)
        return out

    def audit(self) -> list[dict[str, Any]]:
        path = self.tmp / "audit.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def check_exactly_once(self) -> list[dict[str, Any]]:
        """Every trained step once, in order; every group trained once; staleness <= K; no mixed trajectories."""
        steps = [r for r in self.audit() if not r["redelivery"]]
        core = self.cfg["core"]
        assert [r["step"] for r in steps] == list(range(core["total_steps"])), [r["step"] for r in steps]
        groups = Counter(g for r in steps for g in r["groups"])
        twice = [g for g, n in groups.items() if n > 1]
        assert not twice, f"trained twice: {twice}"
        assert len(groups) == core["total_steps"] * core["train_groups"]
        for r in steps:
            assert all(0 <= r["step"] - v <= core["max_staleness"] for v in r["versions"]), r
            assert r["mixed"] == 0, r
        return steps


@contextmanager
def cluster(tmp: pathlib.Path, overrides: dict[str, dict[str, Any]] | None = None) -> Iterator[Cluster]:
    c = Cluster(tmp, overrides)
    try:
        yield c
    finally:
        c.stop()
