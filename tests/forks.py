"""Processes forked from a server that has imported torch, transformers and dora's torch modules once
(multiprocessing's forkserver), for tests that start many torch processes: started afresh, each imported them
itself, about 4 CPU-s on this machine's faster days and 7 on its slower ones, most of what a live test's torch
worker or learner costs.

The server has only imported those modules and run no torch op: no OpenMP pool, gloo or CUDA state exists yet to be
cut in half by the fork (torch's own DataLoader workers are forks of a process that has imported torch, on Linux by
default). It is stopped and reaped when a test is done with it (``stop``, multiprocessing's own ``_stop``, which has
no public name), so what its children used counts as that test's child CPU time (tests/cpucost.py): the server
reaps its children, the test's process the server.

What a forked process does not repeat is the import, and only that: ``python -m dora ...`` starting afresh, a
signal during its imports included, is what every other test starts (``tests/live/test_faults.py`` sends SIGTERM
while a torch worker and a learner import)."""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import multiprocessing.forkserver
import os
import signal
import subprocess
import sys
from collections.abc import Mapping

PRELOAD = (
    "torch",
    "torch.distributed.fsdp",
    "transformers",
    "transformers.models.qwen2.modeling_qwen2",
    "transformers.models.gpt2.modeling_gpt2",
    "dora.cli",
    "dora.learner.trainers.torch_trainer",
    "dora.rollout.engines.torch.engine",
)


def context() -> multiprocessing.context.ForkServerContext:
    """multiprocessing's forkserver context, its server (started by the first process) preloading ``PRELOAD``."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def stop() -> None:
    """Stop and reap the server (a later ``context`` starts a new one)."""
    multiprocessing.forkserver._forkserver._stop()


def _dora(argv: list[str], env: dict[str, str], log: str) -> None:
    """In the forked process: what ``python -m dora ARGV`` does in a new session, with ``env`` as its environment
    and its output in ``log``."""
    os.setsid()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    import torch

    if env.get("OMP_NUM_THREADS", "").isdigit():  # OpenMP read the server's environment when torch was loaded
        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    from dora.cli import main

    sys.argv = [str(sys.modules["dora.cli"].__file__), *argv]
    try:
        code = main(argv)
    finally:
        atexit._run_exitfuncs()  # a multiprocessing child leaves by os._exit, past atexit
    sys.exit(code)


class Forked:
    """A forked ``dora`` process behind the part of ``subprocess.Popen`` that ``dora.launch.local.LocalRun`` uses:
    ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``terminate``, ``kill``."""

    def __init__(self, argv: list[str], env: Mapping[str, str], log: str) -> None:
        self.args = argv
        self._proc = context().Process(target=_dora, args=(list(argv), dict(env), log), name=argv[0])
        self._proc.start()
        self.pid = self._proc.pid
        self.returncode: int | None = None
        try:  # the server, not this process, reaps it: signal it through a pidfd, which a reused PID cannot fool
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except ProcessLookupError:  # gone already
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._proc.exitcode
            if self.returncode is not None and self._pidfd is not None:
                os.close(self._pidfd)
                self._pidfd = None
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        self._proc.join(timeout)
        if self.poll() is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        """``sig`` to the process unless it has ended (reaped by the server before its status reached us, too)."""
        if self.poll() is None and self._pidfd is not None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self._pidfd, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)
