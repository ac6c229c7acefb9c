"""A one-node Slurm cluster for tests: Debian's munge, slurmctld and slurmd, all state in a temp dir.

The daemons run in a network namespace of their own holding only the loopback interface, so nothing
they listen on is reachable from outside; where the kernel refuses a namespace they run in the host's,
on free ports. Two details make a loopback-only namespace work: the interface must be brought up, and
it needs an address besides 127.0.0.1, because glibc's ``getaddrinfo(AI_ADDRCONFIG)`` (which Slurm
uses) ignores 127.0.0.1 when deciding whether IPv4 is configured at all.

Every Slurm command of a test goes through ``LocalSlurm.run`` (entering the namespace). Daemons are
stopped by the PIDs in their pid files; jobs are cancelled first.
"""

from __future__ import annotations

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
    def __init__(self, kill_wait_s: int = 10) -> None:
        self.root = pathlib.Path(tempfile.mkdtemp(prefix="dora-slurm-"))
        self.root.chmod(0o755)  # munged, running as its own user, must reach its socket below
        self.node = socket.gethostname()
        self.kill_wait_s = kill_wait_s
        self.holder: subprocess.Popen[bytes] | None = None
        self.netns: str | None = None
        self.conf = self.root / "slurm.conf"

    # ---------------------------------------------------------------- start and stop

    def start(self, timeout_s: float = 60.0) -> None:
        ensure_installed()
        self._namespace()
        ports = (6817, 6818) if self.netns else (free_port(), free_port())
        munge = self._munge()
        self.conf.write_text(self._slurm_conf(munge, *ports))
        for daemon in ("slurmctld", "slurmd"):
            done = self.run([daemon, "-f", str(self.conf)], check=False)
            if done.returncode != 0:
                raise RuntimeError(f"{daemon} did not start: {done.stderr}{self._logs()}")
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout.strip()
            if state in ("idle", "mixed", "allocated"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the node did not become idle (state {state!r}){self._logs()}")

    def _namespace(self) -> None:
        """A network namespace holding loopback only, kept alive by a sleeping holder process."""
        if shutil.which("unshare") is None or shutil.which("nsenter") is None or shutil.which("ip") is None:
            return
        holder = subprocess.Popen(["unshare", "--net", "sleep", "infinity"], stderr=subprocess.DEVNULL)
        time.sleep(0.2)
        if holder.poll() is not None:
            return  # no namespaces here: the host's, on free ports
        self.holder, self.netns = holder, f"/proc/{holder.pid}/ns/net"
        for cmd in (["ip", "link", "set", "lo", "up"], ["ip", "addr", "add", "127.0.0.2/8", "dev", "lo"]):
            self.run(cmd)

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
        for d in ("state", "spool", "log"):
            (r / d).mkdir()
        return "\n".join([
            "ClusterName=dora-test", f"SlurmctldHost={self.node}(127.0.0.1)", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", f"AuthInfo=socket={munge}", "CredType=cred/munge", "MpiDefault=none",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_CPU", "ReturnToService=2", f"SlurmctldPort={ctld_port}",
            f"SlurmdPort={slurmd_port}", f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmdSpoolDir={r}/spool", f"StateSaveLocation={r}/state", f"SlurmctldLogFile={r}/log/slurmctld.log",
            f"SlurmdLogFile={r}/log/slurmd.log", "JobCompType=jobcomp/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "SwitchType=switch/none", f"KillWait={self.kill_wait_s}",
            "MinJobAge=600", f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={os.cpu_count() or 1} RealMemory=1000",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES",
            "SchedulerType=sched/backfill", "SchedulerParameters=bf_interval=1",
        ]) + "\n"  # fmt: skip

    def stop(self) -> None:
        """Cancel every job, wait for them to leave, then stop the daemons and the namespace by PID."""
        if self.conf.exists():
            self.run(["scancel", "--user", "root"], check=False)
            deadline = time.monotonic() + self.kill_wait_s + 10
            while time.monotonic() < deadline and self.run(["squeue", "-h"], check=False).stdout.strip():
                time.sleep(0.5)
        for pidfile in (self.root / "slurmd.pid", self.root / "slurmctld.pid", self.root / "msock" / "munged.pid"):
            try:
                pid = int(pidfile.read_text().strip())
            except (FileNotFoundError, ValueError):
                continue
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                continue
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and _alive(pid):
                time.sleep(0.1)
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if self.holder is not None:
            self.holder.kill()
            self.holder.wait(10)

    # ---------------------------------------------------------------- commands

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: pathlib.Path | None = None,
            check: bool = True, timeout_s: float = 60.0) -> subprocess.CompletedProcess[str]:  # fmt: skip
        """A command in the cluster's namespace, with its SLURM_CONF."""
        prefix = ["nsenter", f"--net={self.netns}"] if self.netns else []
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
