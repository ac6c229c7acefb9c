"""A version's write in the background: the learner's step ends once its weights are copied aside, and this thread
makes the copy durable in the store while the next step trains.

``BackgroundWrite`` runs one ``PendingVersion.write`` on a daemon thread: a learner stopped mid-write leaves only the
store's temporary folder, which the next publisher removes (a crash mid-write leaves no version, as a crash
mid-publish always did). The learner holds at most one at a time, announces its version to the broker only once
it is done (durable), and waits for it before it copies the next version aside (the copy buffer is reused).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from dora.learner.trainers import PendingVersion, Published
from dora.samples import Batch


class WriteFailed(Exception):
    """A version could not be made durable (a full disk, a store gone): the learner stops with an error and the
    broker, which never heard of the version, holds its batch for the next learner."""


@dataclass(slots=True)
class BackgroundWrite:
    """Version ``pending.version`` being written, with the step that made it: its batch, the batch's checked facts
    and the step's metrics (sent with the version once it is durable)."""

    pending: PendingVersion
    batch: Batch
    facts: dict[str, Any]
    metrics: dict[str, float]
    done: Future[Published] = field(default_factory=Future)
    started: float = field(default_factory=time.perf_counter)

    @property
    def version(self) -> int:
        return self.pending.version

    def start(self) -> BackgroundWrite:
        threading.Thread(target=self._run, name=f"write-v{self.version}", daemon=True).start()
        return self

    def _run(self) -> None:
        try:
            self.done.set_result(self.pending.write())
        except BaseException as e:  # handed to the learner's loop, which stops on it
            self.done.set_exception(e)

    def result(self) -> Published:
        """The durable version's (uri, digest, seconds); WriteFailed if the write raised."""
        try:
            return self.done.result(timeout=0)
        except Exception as e:
            raise WriteFailed(f"v{self.version}: {type(e).__name__}: {e}") from e
