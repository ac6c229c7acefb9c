"""Run untrusted code (a code-execution reward) so that it can neither harm nor stall the rollout worker.

Every run gets a fresh temporary directory and:
- **rlimits, always**: CPU seconds, address space, file size (which also caps what it prints: its
  output goes to files), open files, no core dumps, and a process cap a little above what this user
  already runs;
- **namespaces, where the kernel allows them unprivileged** (``unshare``, probed once): no network
  (an empty network namespace), a read-only view of every mount except its own directory, and its own
  PID namespace, so that when the run ends, every process it started dies with it, even ones that left
  its process group;
- **a wall-clock limit**, after which the whole process group (and the namespace) is killed.

The result is an ``Outcome``: exit status, the first ``output_kib`` of stdout and stderr, the wall time,
and, when the run did not end normally, the reason in words (time, CPU, memory, output, signal).
Without unprivileged namespaces, ``Outcome.isolation`` says "rlimits" and the network and filesystem
rules are not enforced: use a machine or container that allows them for code from a policy. Run as
root, the rlimit on processes does not bind (the kernel exempts root); where this process may make a pids
cgroup (root with cgroup v1's pids hierarchy, or a cgroup v2 subtree with the pids controller), each run gets
one whose ``pids.max`` binds root too, and the first fork it refuses ends the run at once (a fork bomb run as root
without one starves every other process of the machine: docs/fault-tolerance.md).
Elsewhere as root, the PID namespace and the wall-clock limit end a fork bomb. As root without namespaces,
nothing is run at all (the reason says so).
"""

from __future__ import annotations

import contextlib
import functools
import os
import pathlib
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

JAIL = r"""
set -e
dir="$1"; shift
mount --bind "$dir" "$dir"
awk '{print $5}' /proc/self/mountinfo | while read -r mp; do
  [ "$mp" = "$dir" ] || mount -o remount,bind,ro "$mp" 2>/dev/null || true
done
cd "$dir"
"$@"
"""
"""PID 1 of the new namespaces: every mount read-only but the run's own directory, then the program as its
child (its exit status is the program's, 128 + N for signal N). When PID 1 ends, the kernel ends the rest."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Limits:
    wall_s: float = 3.0
    cpu_s: int = 2
    memory_mib: int = 512
    """Address space (RLIMIT_AS) of each process."""
    processes: int = 32
    """Processes it may start, over what this user already runs (RLIMIT_NPROC counts per user)."""
    file_mib: int = 1
    """Largest file it may write, its stdout and stderr included."""
    output_kib: int = 64
    """Of stdout and stderr, kept in the Outcome."""
    open_files: int = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    returncode: int | None
    stdout: str
    stderr: str
    wall_s: float
    reason: str
    """Empty when the program exited on its own; else why it did not (a limit, a signal)."""
    isolation: str
    """'namespaces' (no network, read-only filesystem, own PID namespace) or 'rlimits'."""

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.reason


@functools.cache
def namespaces_available() -> bool:
    """True if unprivileged user, network, mount and PID namespaces work here (probed once)."""
    if shutil.which("unshare") is None:
        return False
    work = tempfile.mkdtemp(prefix="dora-sandbox-probe-")
    try:
        probe = subprocess.run(["unshare", "-rnmpf", "--kill-child", "sh", "-c", JAIL, "jail", work, "true"],
                               capture_output=True, timeout=10)  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return probe.returncode == 0


def _user_processes() -> int:
    uid, n = os.getuid(), 0
    for p in pathlib.Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):  # it ended meanwhile
                n += p.stat().st_uid == uid
    return n


CGROUP_ROOT = pathlib.Path("/sys/fs/cgroup")
POLL_S = 0.02
"""How often a run's pids cgroup is asked whether it refused a fork."""


@functools.cache
def _pids_parent() -> pathlib.Path | None:
    """The pids cgroup this process is in, if it may make child cgroups there (probed once), else None."""
    try:
        lines = pathlib.Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            base = CGROUP_ROOT / "pids" / path.lstrip("/")  # cgroup v1
        elif controllers == "" and "pids" in _read(CGROUP_ROOT / path.lstrip("/") / "cgroup.subtree_control"):
            base = CGROUP_ROOT / path.lstrip("/")  # cgroup v2, the pids controller delegated below it
        else:
            continue
        probe = base / f"dora-sandbox-probe-{os.getpid()}"
        try:
            probe.mkdir()
        except OSError:
            return None
        usable = (probe / "pids.max").is_file()
        with contextlib.suppress(OSError):
            probe.rmdir()
        return base if usable else None
    return None


def _read(path: pathlib.Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _pids_cgroup(processes: int) -> pathlib.Path | None:
    """A new pids cgroup for one run, ``processes`` tasks at most (threads count), or None where none can be made."""
    parent = _pids_parent()
    if parent is None:
        return None
    cg = pathlib.Path(tempfile.mkdtemp(prefix="dora-sandbox-", dir=parent))
    try:
        (cg / "pids.max").write_text(str(processes))
    except OSError:
        _remove_cgroup(cg)
        return None
    return cg


def _refused_fork(cg: pathlib.Path) -> bool:
    """Whether the cgroup has refused a fork (``pids.events``: ``max N``)."""
    return any(line.split()[1:] != ["0"] for line in _read(cg / "pids.events").splitlines() if line.startswith("max"))


def _remove_cgroup(cg: pathlib.Path, timeout_s: float = 5.0) -> None:
    """Kill whatever is left in ``cg`` and remove it once empty (its processes take a moment to be reaped)."""
    deadline = time.monotonic() + timeout_s
    while True:
        for pid in _read(cg / "cgroup.procs").split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        try:
            cg.rmdir()
            return
        except OSError:
            if time.monotonic() > deadline:
                return
            time.sleep(0.01)


def _limit(limits: Limits, nproc: int, cgroup: pathlib.Path | None = None) -> None:
    """In the child, before exec: its rlimits (inherited by everything it starts), and its pids cgroup."""
    if cgroup is not None:
        with contextlib.suppress(OSError):  # not let in: the rlimits still hold, and no fork is seen refused
            (cgroup / "cgroup.procs").write_text(str(os.getpid()))
    mib = 1 << 20
    for res, soft, hard in (
        (resource.RLIMIT_CPU, limits.cpu_s, limits.cpu_s + 1),  # SIGXCPU first, SIGKILL a second later
        (resource.RLIMIT_AS, limits.memory_mib * mib, limits.memory_mib * mib),
        (resource.RLIMIT_FSIZE, limits.file_mib * mib, limits.file_mib * mib),
        (resource.RLIMIT_NOFILE, limits.open_files, limits.open_files),
        (resource.RLIMIT_CORE, 0, 0),
        (resource.RLIMIT_NPROC, nproc, nproc),
    ):
        resource.setrlimit(res, (soft, hard))


def run_python(code: str, *, stdin: str = "", limits: Limits = Limits()) -> Outcome:
    """Run ``code`` with this Python (isolated mode: no site packages of the user, no PYTHON* variables)."""
    return run([sys.executable, "-I", "main.py"], files={"main.py": code}, stdin=stdin, limits=limits)


def run(argv: list[str], *, files: dict[str, str], stdin: str = "", limits: Limits = Limits()) -> Outcome:
    work = pathlib.Path(tempfile.mkdtemp(prefix="dora-sandbox-"))
    out_dir = pathlib.Path(tempfile.mkdtemp(prefix="dora-sandbox-out-"))  # outside the jail's writable dir
    try:
        for name, text in files.items():
            (work / name).write_text(text)
        isolation = "namespaces" if namespaces_available() else "rlimits"
        if isolation == "rlimits" and os.geteuid() == 0:  # it could signal any process, init included
            return Outcome(returncode=None, stdout="", stderr="", wall_s=0.0, isolation=isolation,
                           reason="refused: untrusted code does not run as root without namespaces")  # fmt: skip
        if isolation == "namespaces":
            argv = ["unshare", "-rnmpf", "--kill-child", "sh", "-c", JAIL, "jail", str(work), *argv]
        nproc = _user_processes() + limits.processes
        cgroup = _pids_cgroup(limits.processes + 4)  # + unshare, the jail's shell and the program's first threads
        started = time.monotonic()
        with open(out_dir / "stdout", "wb") as out, open(out_dir / "stderr", "wb") as err:
            proc = subprocess.Popen(argv, cwd=work, stdin=subprocess.PIPE, stdout=out, stderr=err,
                                    start_new_session=True, preexec_fn=lambda: _limit(limits, nproc, cgroup),
                                    env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"})  # fmt: skip
            reason = ""
            try:
                reason = _wait(proc, stdin.encode(), started + limits.wall_s, cgroup, limits)
            finally:
                with contextlib.suppress(ProcessLookupError):  # whatever it left in its group (and namespace)
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                if cgroup is not None:
                    _remove_cgroup(cgroup)
        wall = time.monotonic() - started
        rc = proc.returncode
        stdout, stderr = (_head(out_dir / n, limits.output_kib) for n in ("stdout", "stderr"))
        if not reason and rc != 0:
            reason = _why(rc, stderr, limits)
        return Outcome(returncode=None if reason.startswith("killed: over the wall") else rc, stdout=stdout,
                       stderr=stderr, wall_s=wall, reason=reason, isolation=isolation)  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)


def _wait(proc: subprocess.Popen[bytes], data: bytes, deadline: float, cgroup: pathlib.Path | None,
          limits: Limits) -> str:  # fmt: skip
    """Feed ``data`` and wait for the program until ``deadline``; with a pids cgroup, stop at its first refused
    fork. Returns why it was stopped ("" if it ended by itself)."""
    while True:
        left = deadline - time.monotonic()
        try:
            proc.communicate(data, timeout=max(0.0, min(left, POLL_S) if cgroup is not None else left))
            return ""
        except subprocess.TimeoutExpired:
            data = b""  # sent with the first call; a later call must not send it again
        if cgroup is not None and _refused_fork(cgroup):
            return f"killed: over the process limit of {limits.processes}"
        if time.monotonic() >= deadline:
            return f"killed: over the wall-clock limit of {limits.wall_s:g} s"


def _head(path: pathlib.Path, kib: int) -> str:
    with open(path, "rb") as f:
        return f.read(kib * 1024).decode("utf-8", "replace")


def _why(rc: int, stderr: str, limits: Limits) -> str:
    """Words for an abnormal exit: a signal, or an error that one of the limits explains."""
    sig = -rc if rc < 0 else rc - 128 if rc > 128 else 0
    if sig in (signal.SIGXCPU, signal.SIGKILL):
        return f"killed: over the CPU limit of {limits.cpu_s} s"
    if sig == signal.SIGXFSZ or "File too large" in stderr:
        return f"stopped: wrote more than {limits.file_mib} MiB (output included)"
    if "MemoryError" in stderr or "Cannot allocate memory" in stderr:
        return f"stopped: out of memory (limit {limits.memory_mib} MiB)"
    if "Network is unreachable" in stderr:
        return "stopped: network access is not allowed"
    if "Read-only file system" in stderr:
        return "stopped: writing outside its own directory is not allowed"
    if sig:
        return f"killed by {signal.Signals(sig).name}"
    return f"exited with status {rc}"
