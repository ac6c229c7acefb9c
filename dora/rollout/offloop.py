"""The engine's blocking calls, off the worker's event loop.

A decode step of a real engine can take longer than the broker's silence window: a prefill of long prompts, a first
step that compiles or captures graphs, a step on a machine whose CPUs other work holds (docs/benchmarks.md has a
vLLM worker's first step on a loaded machine). So does a full-weight load of several GB. The worker runs such calls on a
thread of its own and goes on heartbeating meanwhile: a worker busy in its engine is slow, not dead.

One thread runs every such call, one at a time and in order, so an engine sees one thread (a CUDA context's current
device, a ZeroMQ socket inside vLLM's client), and nothing else touches the engine while a call runs: the loop
neither reads the broker's commands nor steps the engine again until the call is done. The thread is a daemon, so a
call that never returns (a wedged engine, which the broker's stall watchdog finds from heartbeats without progress)
cannot keep the process from exiting; any other call is waited for (``close``) before the process exits.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any

Job = tuple[concurrent.futures.Future[Any], Callable[..., Any], tuple[Any, ...]]


class EngineThread:
    """A daemon thread that runs the engine's blocking calls one at a time; started on first use."""

    def __init__(self) -> None:
        self.jobs: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self.thread: threading.Thread | None = None

    def call(self, fn: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        """``fn(*args)`` on the engine's thread; its result (or exception) as a future of the running loop."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._serve, name="engine", daemon=True)
            self.thread.start()
        done: concurrent.futures.Future[Any] = concurrent.futures.Future()
        self.jobs.put((done, fn, args))
        return asyncio.wrap_future(done)

    def close(self, wait_s: float = 5.0) -> None:
        """The thread ends after the call it runs, if any, waited for up to ``wait_s``: a daemon thread still inside
        a torch call when the interpreter exits is cut off there, which aborts the process ("terminate called
        without an active exception", exit 134 instead of 0 after a SIGTERM). A call that has not returned by then
        (a wedged engine) is left behind."""
        if self.thread is not None:
            self.jobs.put(None)
            self.thread.join(wait_s)
            self.thread = None

    def _serve(self) -> None:
        while (job := self.jobs.get()) is not None:
            done, fn, args = job
            if not done.set_running_or_notify_cancel():
                continue
            try:
                done.set_result(fn(*args))
            except BaseException as e:  # the caller's: it is raised where the future is awaited
                done.set_exception(e)


async def beating(job: asyncio.Future[Any], interval_s: float, beat: Callable[[], None]) -> Any:
    """``job``'s result, calling ``beat`` every ``interval_s`` until it is done."""
    while not (await asyncio.wait([job], timeout=interval_s))[0]:
        beat()
    return job.result()
