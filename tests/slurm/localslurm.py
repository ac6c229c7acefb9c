"""A Slurm cluster for tests: Debian's munge, slurmctld and one slurmd per node, all state in a temp dir.

Each node is a set of namespaces made here (``tests.slurm.nodes``): its own hostname, its own address on a
private bridge and an ``/etc/hosts`` naming every node, so the daemons, srun and every job step see several
machines that reach each other over TCP and nothing outside. slurmctld runs on a head node of its own
(``head``: namespaces too, not a compute node), which is also where the tests' Slurm commands run, so that any
compute node, the batch script's included, can be lost. Where the kernel refuses namespaces, a one-node cluster runs
in the host's network on free ports under the host's name (or, asked, the cluster is unavailable).

Every Slurm command of a test goes through ``LocalSlurm.run``. Daemons are stopped by the PIDs in their pid
files, jobs cancelled first; a node can be lost (every process on it SIGKILLed) and started again.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence

from tests.slurm.nodes import Network, NoNamespaces

PACKAGES = ("slurmctld", "slurmd", "slurm-client", "munge")
COMMANDS = ("slurmctld", "slurmd", "sbatch", "munged")


class Unavailable(Exception):
    """Slurm cannot be had on this machine (the reason says why); tests skip."""


def ensure_installed() -> None:
    """Install Debian's Slurm packages if they are missing. Unavailable only where apt-get cannot run here;
    an apt-get that runs and fails is an error (a broken CI machine must not pass by skipping)."""
    if all(shutil.which(c) for c in COMMANDS):
        return
    if shutil.which("apt-get") is None:
        raise Unavailable("Slurm is not installed and there is no apt-get to install Debian's packages")
    if os.geteuid() != 0:
        raise Unavailable("Slurm is not installed and apt-get needs root to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]
    if subprocess.run(install, env=env, capture_output=True).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, check=True)
        done = subprocess.run(install, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"apt-get could not install {' '.join(PACKAGES)}:\n{done.stdout}\n{done.stderr}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalSlurm:
    def __init__(self, nodes: int = 1, kill_wait_s: int = 10, slurmd_timeout_s: int = 300,
                 fall_back: bool = True) -> None:  # fmt: skip
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="dora-slurm-"))
        self.root.chmod(0o755)  # munged, running as its own user, must reach its socket below
        self.count = nodes
        self.kill_wait_s = kill_wait_s
        self.slurmd_timeout_s = slurmd_timeout_s
        self.network: Network | None = Network(self.root, nodes, head="head")
        self.names = [f"node{i}" for i in range(1, nodes + 1)]
        self.conf = self.root / "slurm.conf"
        self.fall_back = fall_back
        """Where namespaces cannot be made: one node in the host's network (True), or Unavailable."""
        self.single_because = ""
        """Why a cluster asked to have several nodes has one (empty when it has them)."""

    @property
    def node(self) -> str:
        """The first compute node."""
        return self.names[0]

    @property
    def controller(self) -> str:
        """slurmctld's host and address: the head node, or the one node where there are no namespaces."""
        head = self.network.head if self.network else None
        return f"{head.name}({head.addr})" if head else f"{self.node}(127.0.0.1)"

    # ---------------------------------------------------------------- start and stop

    def start(self, timeout_s: float = 60.0) -> None:
        ensure_installed()
        try:
            self.network.start()
        except NoNamespaces as e:
            self.network.stop()
            self.network = None
            if not self.fall_back:
                raise Unavailable(f"a cluster of {self.count} nodes needs network namespaces: {e}") from None
            self.single_because = f"one node only: {e}"
            self.count, self.names = 1, [socket.gethostname()]
        ports = (6817, 6818) if self.network else (free_port(), free_port())
        munge = self._munge()
        self.conf.write_text(self._slurm_conf(munge, *ports))
        done = self.run(["slurmctld", "-f", str(self.conf)], check=False)
        if done.returncode != 0:
            raise RuntimeError(f"slurmctld did not start: {done.stderr}{self._logs()}")
        for name in self.names:
            self.start_node(name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.states()
            if len(states) == self.count and all(s in ("idle", "mixed", "allocated") for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the nodes did not become idle ({states}){self._logs()}")

    def start_node(self, name: str) -> None:
        """Start (or start again, after ``lose_node``) the slurmd of node ``name``."""
        done = self.run(["slurmd", "-f", str(self.conf), "-N", name], check=False, on=name)
        if done.returncode != 0:
            raise RuntimeError(f"slurmd on {name} did not start: {done.stderr}{self._logs()}")

    def isolate(self, name: str) -> None:
        """Node ``name`` cut from the others (its link down): they see silence, as from a node that lost power."""
        if self.network is None:
            raise Unavailable("a node can be cut off only on a cluster of namespaces")
        self.network.isolate(name)

    def rejoin(self, name: str) -> None:
        """Node ``name``'s link up again after ``isolate``, its processes untouched."""
        self.network.reconnect(name)

    def lose_node(self, name: str) -> list[int]:
        """Node ``name`` lost as in a power loss: cut off, then its slurmd and every job step's process on it
        SIGKILLed (their PIDs returned)."""
        self.isolate(name)
        return self.network.node(name).kill()

    def restore(self, name: str, timeout_s: float = 60.0) -> float:
        """Start node ``name`` again after ``lose_node`` and wait until Slurm has it back in service (seconds)."""
        started = time.monotonic()
        if self.network is not None:
            self.network.reconnect(name)
        self.start_node(name)
        while (state := self.states().get(name)) not in ("idle", "mixed", "allocated"):
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"{name} is {state} {timeout_s:g} s after its slurmd started again")
            time.sleep(0.5)
        return time.monotonic() - started

    def states(self) -> dict[str, str]:
        """Each node's state as sinfo reports it (idle, allocated, down*, ...)."""
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %T"], check=False).stdout.split()
        return dict(zip(out[::2], out[1::2], strict=True))

    def _munge(self) -> pathlib.Path:
        key_dir, sock_dir = self.root / "munge", self.root / "msock"
        key_dir.mkdir(mode=0o700)
        sock_dir.mkdir(mode=0o755)
        key = key_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        user = pwd.getpwnam("munge")
        for path in (key_dir, sock_dir, key):
            os.chown(path, user.pw_uid, user.pw_gid)
        socket_path = sock_dir / "munge.socket"
        self.run(["runuser", "-u", "munge", "--", "munged", f"--socket={socket_path}", f"--key-file={key}",
                  f"--pid-file={sock_dir / 'munged.pid'}", f"--log-file={key_dir / 'munged.log'}",
                  f"--seed-file={key_dir / 'munge.seed'}"])  # fmt: skip
        return socket_path

    def _slurm_conf(self, munge: pathlib.Path, ctld_port: int, slurmd_port: int) -> str:
        r = self.root
        for d in ("state", "log", *(f"spool/{n}" for n in self.names)):
            (r / d).mkdir(parents=True)
        addrs = [n.addr for n in self.network.nodes] if self.network else ["127.0.0.1"]
        cpus = os.cpu_count() or 1
        pairs = zip(self.names, addrs, strict=True)
        nodes = [f"NodeName={n} NodeAddr={a} CPUs={cpus} RealMemory=1000" for n, a in pairs]
        return "\n".join([
            "ClusterName=dora-test", f"SlurmctldHost={self.controller}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={munge}", "CredType=cred/munge", "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "ReturnToService=2", f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}", f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmdSpoolDir={r}/spool/%n", f"StateSaveLocation={r}/state", f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd-%n.log", "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SwitchType=switch/none", f"KillWait={self.kill_wait_s}",
            f"SlurmdTimeout={self.slurmd_timeout_s}", "MinJobAge=600", *nodes,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "SchedulerType=sched/backfill", "SchedulerParameters=bf_interval=1",
        ]) + "\n"  # fmt: skip

    def stop(self) -> None:
        """Cancel every job, wait for them to leave, then stop the daemons and the nodes by PID."""
        if self.conf.exists():
            self.run(["scancel", "--user", "root"], check=False)
            deadline = time.monotonic() + self.kill_wait_s + 10
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        pidfiles = [self.root / f"slurmd-{n}.pid" for n in self.names]
        pids = []
        for pidfile in [*pidfiles, self.root / "slurmctld.pid", self.root / "msock" / "munged.pid"]:
            try:
                pids.append(int(pidfile.read_text().strip()))
            except (FileNotFoundError, ValueError):
                continue
        for pid in pids:  # all at once, then wait for them together: each daemon's exit takes its own seconds
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
            time.sleep(0.1)
        for pid in filter(_alive, pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if self.network is not None:
            self.network.stop()

    # ---------------------------------------------------------------- commands

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: pathlib.Path | None = None,
            check: bool = True, timeout_s: float = 60.0, on: str | None = None,
            ) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """A command on node ``on`` (default: the head node, where slurmctld runs), with the cluster's SLURM_CONF."""
        prefix = self.network.node(on or self.network.head.name).enter() if self.network else []
        full = {**(env if env is not None else os.environ), "SLURM_CONF": str(self.conf)}
        done = subprocess.run([*prefix, *argv], env=full, cwd=cwd, capture_output=True, text=True, timeout=timeout_s)
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, script: pathlib.Path, *args: str, env: Mapping[str, str], cwd: pathlib.Path) -> str:
        return self.run(["sbatch", "--parsable", *args, str(script)], env=env, cwd=cwd).stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """``scontrol show job``'s fields (JobState, Restarts, ExitCode, ...)."""
        text = self.run(["scontrol", "-o", "show", "job", job_id]).stdout
        return dict(item.split("=", 1) for item in text.split() if "=" in item)

    def wait_state(self, job_id: str, states: set[str], timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} is {info.get('JobState')} after {timeout_s:g} s, not in {states}")
            time.sleep(0.5)

    def _logs(self) -> str:
        out = []
        for log in sorted((self.root / "log").glob("*.log")) if (self.root / "log").exists() else []:
            out.append(f"\n--- {log.name}\n{log.read_text()[-2000:]}")
        return "".join(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
