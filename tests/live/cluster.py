"""A live dora run as real processes for tests (``dora.local.LocalRun``), with the exactly-once audit.

The broker binds to 127.0.0.1 port 0; every process is stopped by its PID when the test ends.
"""

from __future__ import annotations

import json
import pathlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dora.local import LocalRun

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


class Cluster(LocalRun):
    def __init__(self, tmp: pathlib.Path, overrides: dict[str, dict[str, Any]] | None = None) -> None:
        cfg = {s: dict(v) for s, v in BASE.items()}
        for section, values in (overrides or {}).items():
            cfg.setdefault(section, {}).update(values)
        cfg.setdefault("learner", {})["audit_file"] = str(tmp / "audit.jsonl")
        super().__init__(tmp, cfg)

    def wait(self, name: str, timeout_s: float) -> int:
        try:
            return super().wait(name, timeout_s)
        except TimeoutError as e:
            raise AssertionError(str(e)) from None

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def audit(self) -> list[dict[str, Any]]:
        path = self.dir / "audit.jsonl"
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
        c.kill_all()
