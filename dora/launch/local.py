"""A dora run on one machine as real processes: broker, rollout workers and learner.

Each process is started with ``subprocess.Popen`` in its own session (so a terminal's Ctrl-C does not
reach it twice) and stopped by its PID. They share one TOML file; the broker binds where the config
says and the others find it through its discovery file. Each process logs JSON lines to its own
file in the run directory, which ``events`` parses.
"""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from typing import Any

from dora.config import dumps_toml


def to_toml(cfg: dict[str, dict[str, Any]]) -> str:
    """A two-level mapping as TOML (sections of scalars, lists and tables; what a run config holds)."""
    return dumps_toml(cfg)


class LocalRun:
    def __init__(self, rundir: pathlib.Path, cfg: dict[str, dict[str, Any]], *, threads: int | None = None,
                 envs: Mapping[str, Mapping[str, str]] | None = None) -> None:  # fmt: skip
        """``threads``: OMP_NUM_THREADS for every child (unless set already in this environment; a child started
        with its own ``threads`` gets those); ``envs``: what each child, by name, gets in its environment besides
        this one's (its GPUs: ``dora.launch.placement``)."""
        self.dir = rundir
        self.env = dict(os.environ)
        self.envs = {name: dict(extra) for name, extra in (envs or {}).items()}
        self.threads_given = "OMP_NUM_THREADS" in os.environ
        """The user set OMP_NUM_THREADS: every child keeps it."""
        if threads is not None:
            self.env.setdefault("OMP_NUM_THREADS", str(threads))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.cfg = {s: dict(v) for s, v in cfg.items()}
        self.cfg.setdefault("broker", {})["discovery_file"] = str(rundir / "broker.json")
        self.cfg.setdefault("log", {}).setdefault("format", "json")
        self.config = rundir / "run.toml"
        self.config.write_text(to_toml(self.cfg))
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.endpoint = ""
        self.discovery = rundir / "broker.json"
        """Where workers and the learner look for the broker (a chaos proxy's file when one stands between)."""

    # ---------------------------------------------------------------- processes

    def spawn(self, name: str, *args: str, threads: int | None = None) -> subprocess.Popen[bytes]:
        return self.spawn_command(name, ["-m", "dora", *args], threads=threads)

    def spawn_command(self, name: str, argv: list[str], *, threads: int | None = None) -> subprocess.Popen[bytes]:
        """``python ARGV --config <the run's config>``, logging to ``<name>.log``, with ``child_env``."""
        with open(self.dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen([sys.executable, *argv, "--config", str(self.config)],
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env=self.child_env(name, threads))  # fmt: skip
        self.procs[name] = proc
        return proc

    def child_env(self, name: str, threads: int | None = None) -> dict[str, str]:
        """The environment of child ``name``: this one's, ``threads`` as its OMP_NUM_THREADS (unless the user set
        it), and its entries of ``envs``."""
        env = self.env if threads is None or self.threads_given else {**self.env, "OMP_NUM_THREADS": str(threads)}
        return {**env, **self.envs.get(name, {})}

    def start_broker(self, timeout_s: float = 30.0, name: str = "broker") -> str:
        disc = self.dir / "broker.json"
        disc.unlink(missing_ok=True)
        proc = self.spawn(name, "broker")
        deadline = time.monotonic() + timeout_s
        while not disc.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"the broker exited with {proc.returncode}:\n{self.log(name)[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the broker wrote no discovery file within {timeout_s:g} s")
            time.sleep(0.05)
        self.endpoint = json.loads(disc.read_text())["endpoint"]
        return self.endpoint

    def start_reward(self, timeout_s: float = 600.0) -> str:
        """``dora reward`` (the task's reward model and judge), before the workers: wait until it serves, then point
        task.reward_server at it in the run's config (rewritten; read by every process started after). Its URL."""
        url_file = self.dir / "reward.json"
        url_file.unlink(missing_ok=True)
        proc = self.spawn("reward", "reward", "--url-file", str(url_file))
        deadline = time.monotonic() + timeout_s
        while not url_file.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"dora reward exited with {proc.returncode}:\n{self.log('reward')[-3000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"dora reward did not serve within {timeout_s:g} s (loading its models?)")
            time.sleep(0.05)
        url = str(json.loads(url_file.read_text())["url"])
        self.cfg.setdefault("task", {})["reward_server"] = url
        self.config.write_text(to_toml(self.cfg))
        return url

    def start_chaos(self, *args: str, timeout_s: float = 30.0) -> str:
        """A ``dora chaos`` proxy in front of the broker (``args``: its fault options); peers started after
        this reach the broker through it. Returns the proxy's endpoint."""
        disc = self.dir / "chaos.json"
        disc.unlink(missing_ok=True)
        proc = self.spawn("chaos", "chaos", "--upstream", str(self.dir / "broker.json"), "--discovery-file",
                          str(disc), *args)  # fmt: skip
        deadline = time.monotonic() + timeout_s
        while not disc.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the chaos proxy did not start:\n{self.log('chaos')[-3000:]}")
            time.sleep(0.05)
        self.discovery = disc
        return json.loads(disc.read_text())["endpoint"]

    def start_worker(self, name: str, engine: str = "sim", *extra: str, threads: int | None = None
                     ) -> subprocess.Popen[bytes]:  # fmt: skip
        disc = str(self.discovery)
        return self.spawn(name, "rollout", "--engine", engine, "--broker", disc, "--name", name, *extra,
                          threads=threads)  # fmt: skip

    def start_learner(self, trainer: str = "sim") -> subprocess.Popen[bytes]:
        return self.spawn("learner", "learner", "--trainer", trainer, "--broker", str(self.discovery))

    def start(self, workers: int) -> None:
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
            raise TimeoutError(f"{name} still running after {timeout_s:g} s:\n{self.log(name)[-3000:]}") from None

    def stop(self, grace_s: float = 10.0, *, keep: frozenset[str] = frozenset()) -> dict[str, int]:
        """SIGTERM what still runs (but the processes named in ``keep``), SIGKILL what does not stop within
        ``grace_s``; exit codes by name, of those stopped."""
        stopping = {name: proc for name, proc in self.procs.items() if name not in keep}
        for proc in stopping.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
                proc.terminate()
        deadline = time.monotonic() + grace_s
        for proc in stopping.values():
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        return {name: p.returncode for name, p in stopping.items()}

    # ---------------------------------------------------------------- evidence

    def log(self, name: str) -> str:
        path = self.dir / f"{name}.log"
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
