"""A reward computed by an HTTP service (``task.reward = "http://host:port/path"``), micro-batched.

A reward that needs a model, a sandbox farm or a judge lives best behind a service. ``RemoteReward`` is a
reward function (``(completion, item) -> float | dict``) that gathers concurrent calls, from several threads
or from ``submit``, for up to ``batch_wait_s`` or ``batch_size`` calls into one POST of JSON::

    {"requests": [{"id": "<uuid>", "completion": "...", "prompt": "...", "answer": "...", "meta": {...}}]}

(``meta`` only when it is JSON-able), answered by::

    {"results": [{"id": "...", "reward": 1.0} | {"id": "...", "components": {...}} | {"id": "...", "error": "..."}]}

Results are matched by id: an id missing from the answer, or answered twice, is an error for that sample; an
id that was not asked is counted and ignored. Each POST has ``timeout_s`` (per socket operation, as urllib
applies it) and is retried ``retries`` times with the same ids, after 0.1 s, 0.2 s, ... A batch whose every
attempt failed raises ``RewardServiceError`` (one line: the URL, the attempts, the last error) in each of its
callers, which ``dora.tasks.rewards.score`` turns into reward 0.0 with that reason. Standard library only; the
threads start with the first call, so a process that only resolves the spec (the broker) starts none.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from typing import Any

import structlog

from dora.config import ConfigError
from dora.tasks.tasks import Item

log = structlog.get_logger()
BACKOFF_S = 0.1
"""The wait before the first retry; it doubles with each further one."""
SENDERS = 4
"""Batches in flight to the service at once."""


class RewardServiceError(Exception):
    """The reward service failed a sample: every attempt of its batch failed, or it answered an error for it."""


def check_url(url: str) -> str:
    """``url`` if it is an http(s) URL with a host; a one-line ConfigError otherwise."""
    try:
        parts = urllib.parse.urlsplit(url)
        _ = parts.port  # a port that is not a number raises
    except ValueError as e:
        raise ConfigError(f"task.reward {url!r} is not a valid reward service URL: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname or any(c.isspace() for c in url):
        raise ConfigError(f"task.reward {url!r} is not a valid reward service URL (http[s]://host[:port]/path)")
    return url


@dataclass(slots=True)
class _Pending:
    id: str
    payload: dict[str, Any]
    future: concurrent.futures.Future[Any] = field(default_factory=concurrent.futures.Future)


def _payload(request_id: str, completion: str, item: Item) -> dict[str, Any]:
    out: dict[str, Any] = {"id": request_id, "completion": completion, "prompt": item.prompt, "answer": item.answer}
    try:
        json.dumps(item.meta)
        out["meta"] = item.meta
    except (TypeError, ValueError):  # an episode's meta holds items and messages objects: not sent
        pass
    return out


class RemoteReward:
    """A reward function calling the reward service at ``url`` in micro-batches (see the module docstring)."""

    def __init__(self, url: str, *, timeout_s: float = 10.0, retries: int = 2, batch_size: int = 32,
                 batch_wait_s: float = 0.005) -> None:  # fmt: skip
        if timeout_s <= 0 or retries < 0 or batch_size < 1 or batch_wait_s < 0:
            raise ConfigError(f"reward service: timeout_s > 0, retries >= 0, batch_size >= 1 and batch_wait_s >= 0 "
                              f"needed; got {timeout_s}, {retries}, {batch_size}, {batch_wait_s}")  # fmt: skip
        self.url = check_url(url)
        self.timeout_s, self.retries, self.batch_size, self.batch_wait_s = timeout_s, retries, batch_size, batch_wait_s
        self._cond = threading.Condition()
        self._queue: list[_Pending] = []
        self._oldest_s = 0.0
        self._batcher: threading.Thread | None = None
        self._senders: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False
        self._counts = {"requests": 0, "retries": 0, "failures": 0, "batches": 0, "samples": 0, "unknown_ids": 0,
                        "batch_size_max": 0, "latency_sum_s": 0.0, "latency_max_s": 0.0}  # fmt: skip

    def __call__(self, completion: str, item: Item) -> Any:
        """The service's reward for ``completion``: a number or a dict of components (blocks until answered)."""
        return self.submit(completion, item).result()

    def submit(self, completion: str, item: Item) -> concurrent.futures.Future[Any]:
        """Queue one sample for the next batch; the future holds its reward, or a ``RewardServiceError``."""
        pending = _Pending(str(uuid.uuid4()), {})
        pending.payload = _payload(pending.id, completion, item)
        with self._cond:
            if self._closed:
                raise RewardServiceError(f"reward service {self.url}: the client is closed")
            if self._batcher is None:
                self._senders = concurrent.futures.ThreadPoolExecutor(SENDERS, thread_name_prefix="reward-service")
                self._batcher = threading.Thread(target=self._gather, name="reward-batcher", daemon=True)
                self._batcher.start()
            if not self._queue:
                self._oldest_s = time.monotonic()
            self._queue.append(pending)
            self._cond.notify()
        return pending.future

    def stats(self) -> dict[str, float]:
        """The counters: POSTs, retries, failed batches, batches and samples sent, the largest batch, ids answered
        that were not asked, and the POSTs' latency (sum and max, seconds)."""
        with self._cond:
            out = dict(self._counts)
        out["batch_size_mean"] = out["samples"] / out["batches"] if out["batches"] else 0.0
        return out

    def close(self) -> None:
        """Send what is queued, then stop the threads."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            batcher, senders = self._batcher, self._senders
        if batcher is not None:
            batcher.join()
        if senders is not None:
            senders.shutdown(wait=True)

    def _gather(self) -> None:
        """The batcher thread: from the first queued call, wait up to ``batch_wait_s`` or ``batch_size`` calls,
        then hand the batch to a sender."""
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                while len(self._queue) < self.batch_size and not self._closed:
                    left = self._oldest_s + self.batch_wait_s - time.monotonic()
                    if left <= 0:
                        break
                    self._cond.wait(left)
                batch, self._queue = self._queue[: self.batch_size], self._queue[self.batch_size :]
                self._oldest_s = time.monotonic()
            assert self._senders is not None
            self._senders.submit(self._send_safely, batch)

    def _send_safely(self, batch: list[_Pending]) -> None:
        try:
            self._send(batch)
        except Exception as e:  # a bug here must reach the callers, never leave them waiting
            for p in batch:
                if not p.future.done():
                    p.future.set_exception(RewardServiceError(f"reward service {self.url}: {type(e).__name__}: {e}"))

    def _send(self, batch: list[_Pending]) -> None:
        """POST the batch, retrying with the same ids, and settle every caller's future."""
        body = json.dumps({"requests": [p.payload for p in batch]}).encode()
        with self._cond:
            self._counts["batches"] += 1
            self._counts["samples"] += len(batch)
            self._counts["batch_size_max"] = max(self._counts["batch_size_max"], len(batch))
        last = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                results = self._post(body, retry=attempt > 0)
            except (OSError, ValueError, http.client.HTTPException) as e:  # refused, timed out, error status, not JSON
                last = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            self._settle(batch, results)
            return
        with self._cond:
            self._counts["failures"] += 1
        attempts = self.retries + 1
        log.warning("reward_service_failed", url=self.url, attempts=attempts, error=last, samples=len(batch))
        error = f"reward service {self.url} failed {attempts} attempt(s); last error: {last}"
        for p in batch:
            p.future.set_exception(RewardServiceError(error))

    def _post(self, body: bytes, *, retry: bool) -> list[Any]:
        request = urllib.request.Request(self.url, data=body, method="POST",
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                answer = json.loads(response.read())
        finally:
            took = time.monotonic() - start
            with self._cond:
                self._counts["requests"] += 1
                self._counts["retries"] += int(retry)
                self._counts["latency_sum_s"] += took
                self._counts["latency_max_s"] = max(self._counts["latency_max_s"], took)
        results = answer.get("results") if isinstance(answer, dict) else None
        if not isinstance(results, list):
            raise ValueError("the answer has no 'results' list")
        return results

    def _settle(self, batch: list[_Pending], results: list[Any]) -> None:
        """Each caller's result, matched by id."""
        by_id: dict[str, list[Any]] = {}
        for r in results:
            key = r.get("id") if isinstance(r, dict) else None
            by_id.setdefault(key if isinstance(key, str) else "", []).append(r)
        asked = {p.id for p in batch}
        unknown = sum(len(rs) for key, rs in by_id.items() if key not in asked)
        if unknown:
            with self._cond:
                self._counts["unknown_ids"] += unknown
        for p in batch:
            found = by_id.get(p.id, [])
            if len(found) != 1:
                what = "no result" if not found else f"{len(found)} results"
                p.future.set_exception(RewardServiceError(f"reward service {self.url} answered {what} for id {p.id}"))
            else:
                _settle_one(p, found[0], self.url)


def _settle_one(p: _Pending, result: dict[str, Any], url: str) -> None:
    if "error" in result:
        p.future.set_exception(RewardServiceError(f"reward service {url}: {str(result['error'])[:200]}"))
    elif "components" in result:
        p.future.set_result(result["components"])
    elif "reward" in result:
        p.future.set_result(result["reward"])
    else:
        p.future.set_exception(RewardServiceError(f"reward service {url} answered neither reward, components "
                                                  f"nor error for id {p.id}"))  # fmt: skip
