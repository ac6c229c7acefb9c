"""Signals at the end of a process's life, shared by the broker, rollout and learner processes.

Before that, from the first instruction of ``main`` (``stop_before_serving``), a SIGTERM ends the process with
exit 0 at once: it has nothing to drain yet (it is importing torch, loading a model, waiting for the broker), and
under load those seconds are a window in which the default action would kill it (-15).

Each process's ``serve`` turns SIGTERM into its stop event with ``loop.add_signal_handler``. At interpreter exit,
Python puts the default action back on every signal that has a Python-level handler, and the default action of
SIGTERM kills: one that lands while the process exits (a second one from an impatient operator, or Slurm's after a
wrapper's) would turn a clean exit 0 into a death by signal. ``ignore_sigterm_while_exiting`` closes that window;
SIGKILL still ends the process.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

GOODBYE_LINGER_MS = 2000
"""How long a worker's or learner's socket, closed right after its Goodbye, may hold it until ZeroMQ's I/O thread
has sent it (the context's termination waits that long at most). Closed with no linger, a Goodbye still queued is
dropped, and the broker finds the peer gone without a word (``unreachable``): on a loaded machine the I/O thread
may not run for a second. SIGTERM is ignored before that wait (``ignore_sigterm_while_exiting``): a signal
interrupts the context's termination, which pyzmq then ends, Goodbye unsent."""


def ignore_sigterm_while_exiting() -> None:
    """Serving is over: from now until the process exits, SIGTERM is ignored. One swap of the handler, so no
    SIGTERM finds the default action meanwhile; Python's exit leaves an ignored signal ignored, and a closed
    uvloop loop does not put its own handler's default back."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def stop_before_serving() -> None:
    """The first instruction of a serving process (broker, rollout, learner): until its event loop takes SIGTERM
    over, a SIGTERM ends it at once with exit 0. Not by raising ``SystemExit``: one raised in the middle of a native
    extension's import (torch, transformers) unwinds into half-made C++ state, and the process aborts (-6) on its
    way out. Before serving it has started nothing and holds nothing to drain, so there is nothing to unwind."""
    signal.signal(signal.SIGTERM, _exit_before_serving)


def _exit_before_serving(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)
