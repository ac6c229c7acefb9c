"""The HTTP side of `dora reward`: the reward service protocol over a threading HTTP server on task.reward_server_bind.

``POST`` (any path; `dora run` gives the workers ``/score``) takes ``{"requests": [{"id", "completion", "prompt",
"answer", ...}]}`` and answers ``{"results": [{"id", "components": {"model", "judge"}} | {"id", "error"}]}``, one per
id, once every sample of the request is scored by the batcher. A body that is not that is answered 400 with the
reason. ``GET /stats`` answers the batcher's counters as JSON (batch sizes among them). Each request is handled on
its own thread, which only waits: the scoring is the batcher's one thread.
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import signal
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import structlog

from dora.config.run import TaskSection
from dora.reward.batcher import Batcher

log = structlog.get_logger()
ANSWER_TIMEOUT_S = 600.0
"""The longest a request waits for its samples' scores (the worker's own timeout is far shorter)."""


def requests_of(body: bytes) -> list[dict[str, Any]]:
    """The samples of a POST body; ValueError with the reason when it is not the reward service's JSON."""
    data = json.loads(body)
    requests = data.get("requests") if isinstance(data, dict) else None
    if not isinstance(requests, list):
        raise ValueError("the body has no 'requests' list")
    for r in requests:
        if not isinstance(r, dict) or not isinstance(r.get("id"), str) or not isinstance(r.get("completion"), str):
            raise ValueError("each request needs a string 'id' and a string 'completion'")
    return requests


def handler(batcher: Batcher) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            try:
                requests = requests_of(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
            except ValueError as e:  # JSONDecodeError included
                self.answer(400, {"error": str(e)[:300]})
                return
            try:
                futures = batcher.submit(requests)
            except RuntimeError as e:  # stopping: the worker's retry finds another server or scores 0
                self.answer(503, {"error": str(e)})
                return
            results = [{"id": r["id"], **f.result(timeout=ANSWER_TIMEOUT_S)}
                       for r, f in zip(requests, futures, strict=True)]  # fmt: skip
            self.answer(200, {"results": results})

        def do_GET(self) -> None:
            if self.path.rstrip("/") == "/stats":
                self.answer(200, batcher.stats())
            else:
                self.answer(404, {"error": "POST reward requests; GET /stats"})

        def answer(self, status: int, body: dict[str, Any]) -> None:
            data = json.dumps(body).encode()
            with contextlib.suppress(OSError):  # the worker hung up (timed out): its retry asks again
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        def log_message(self, format: str, *args: Any) -> None:  # one line per batch is logged, not per POST
            pass

    return Handler


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def url_of(server: ThreadingHTTPServer) -> str:
    host, port = server.server_address[:2]
    shown = socket.gethostname() if host in ("0.0.0.0", "::") else str(host)
    return f"http://{f'[{shown}]' if ':' in shown else shown}:{port}/score"


def serve(task: TaskSection, url_file: str | None) -> int:
    """Load the scorers, serve until SIGTERM or SIGINT, then answer what is queued and stop; 0."""
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    from dora.reward.scorers import Scorers

    batcher = Batcher(Scorers(task), batch_size=task.reward_server_batch_size, wait_s=task.reward_server_wait_s)
    host, _, port = task.reward_server_bind.rpartition(":")
    server = (_Server6 if ":" in host else _Server)((host.strip("[]"), int(port)), handler(batcher))
    threads = [threading.Thread(target=batcher.run, name="reward-batcher"),
               threading.Thread(target=server.serve_forever, args=(0.1,), name="reward-http")]  # fmt: skip
    for t in threads:
        t.start()
    url = url_of(server)
    if url_file is not None:
        tmp = pathlib.Path(url_file + ".tmp")
        tmp.write_text(json.dumps({"url": url}))
        tmp.rename(url_file)
    print(json.dumps({"event": "ready", "url": url}), flush=True)
    log.info("reward_ready", url=url, batch_size=task.reward_server_batch_size, wait_s=task.reward_server_wait_s)
    try:
        while not stop.wait(0.5):
            pass
    finally:
        server.shutdown()
        batcher.close()
        for t in threads:
            t.join()
        server.server_close()
    log.info("reward_stopped", **batcher.stats())
    return 0
