"""A live dora run as real processes for tests (``dora.launch.local.LocalRun``), with the exactly-once audit.

The broker binds to 127.0.0.1 port 0; every process is stopped by its PID when the test ends.
"""

from __future__ import annotations

import json
import pathlib
import tomllib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from dora.launch.local import LocalRun
from tests import forks
from tests.forks import Forked

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "live" / "sim.toml"
BASE = tomllib.loads(EXAMPLE.read_text())  # the documented example, faster and stricter for tests
for section, values in {
    "run": {"time_scale": 0.005},
    "core": {"min_workers": 1},
    "broker": {"strict": True},
    "log": {"format": "json"},
}.items():
    BASE[section].update(values)


def torch_process(argv: list[str]) -> bool:
    """``-m dora rollout --engine torch ...`` or ``-m dora learner --trainer torch ...``."""
    flag = {"rollout": "--engine", "learner": "--trainer"}.get(argv[2] if argv[:2] == ["-m", "dora"] else "")
    return flag is not None and flag in argv and argv[argv.index(flag) + 1 :][:1] == ["torch"]


class Cluster(LocalRun):
    def __init__(self, tmp: pathlib.Path, overrides: dict[str, dict[str, Any]] | None = None, *,
                 fork: bool = False) -> None:  # fmt: skip
        """``fork``: torch workers and learners are forked from a server that has imported torch (tests/forks.py)
        instead of starting afresh; for tests that start several and test no process's own start."""
        cfg = {s: dict(v) for s, v in BASE.items()}
        for section, values in (overrides or {}).items():
            cfg.setdefault(section, {}).update(values)
        cfg.setdefault("learner", {})["audit_file"] = str(tmp / "audit.jsonl")
        super().__init__(tmp, cfg, threads=1)  # several torch processes share 2 cores
        self.fork = fork
        self.forked = False

    def spawn_command(self, name: str, argv: list[str], *, threads: int | None = None) -> Any:
        if not (self.fork and torch_process(argv)):
            return super().spawn_command(name, argv, threads=threads)
        log = self.dir / f"{name}.log"
        log.write_bytes(b"")
        proc = Forked([*argv[2:], "--config", str(self.config)], self.child_env(name, threads), str(log))
        self.procs[name] = proc  # type: ignore[assignment]
        self.forked = True
        return proc

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
        if self.forked:
            forks.stop()

    def audit(self) -> list[dict[str, Any]]:
        """The learner's steps, in order. A step it committed is its audit line. A step a restarted learner
        adopted from the store, which no learner's line names (the one that trained it was killed after the
        broker's record and before its own), is the broker journal's record of it: its groups, as published."""
        path = self.dir / "audit.jsonl"
        rows = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
        steps = {r["step"]: r for r in rows if not r.get("adopted")}
        journal = self.cfg.get("broker", {}).get("journal")
        published = {}
        if journal and pathlib.Path(journal).exists():
            records = (json.loads(x) for x in pathlib.Path(journal).read_text().splitlines() if x.strip())
            published = {r["version"]: r["groups"] for r in records if r.get("kind") == "step"}
        for r in rows:
            if r.get("adopted") and r["step"] not in steps and r["version"] in published:
                steps[r["step"]] = {"step": r["step"], "groups": published[r["version"]], "adopted": True}
        return [steps[s] for s in sorted(steps)]

    def check_exactly_once(self) -> list[dict[str, Any]]:
        """Every trained step once, in order; every group trained once; staleness <= K; no mixed trajectories."""
        steps = self.audit()  # a step is audited once the broker acknowledged its publish
        core = self.cfg["core"]
        assert [r["step"] for r in steps] == list(range(core["total_steps"])), [r["step"] for r in steps]
        groups = Counter(g for r in steps for g in r["groups"])
        twice = [g for g, n in groups.items() if n > 1]
        assert not twice, f"trained twice: {twice}"
        assert len(groups) == core["total_steps"] * core["train_groups"]
        for r in steps:  # an adopted step's batch was checked by the learner that trained it, which is gone
            assert all(0 <= r["step"] - v <= core["max_staleness"] for v in r.get("versions", ())), r
            assert r.get("mixed", 0) == 0, r
        return steps


@contextmanager
def cluster(tmp: pathlib.Path, overrides: dict[str, dict[str, Any]] | None = None, *,
            fork: bool = False) -> Iterator[Cluster]:  # fmt: skip
    c = Cluster(tmp, overrides, fork=fork)
    try:
        yield c
    finally:
        c.kill_all()
