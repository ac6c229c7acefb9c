"""Finding the broker: an endpoint string, or the discovery file the broker writes atomically.

On a cluster the broker binds a wildcard address (``tcp://0.0.0.0:0``: any interface, any free port)
and publishes where it can be reached, ``tcp://<its node>:<port>``, in a discovery file on the shared
filesystem. Workers and the learner started at the same time wait for that file, and read it again
whenever the broker falls silent, so a restarted broker on another node or port is found.

A requeued Slurm job starts over in the same run directory, where the previous attempt's file may
still name a dead broker. The file records the job id and attempt that wrote it, and a process of a
later attempt of the same job treats an older attempt's file as not written yet.

A broker whose run is over marks its file finished before it leaves. A peer away when the broker said goodbye
(reconnecting after being declared dead) learns there that the broker it served has ended its run, and exits,
instead of calling an absent broker forever. Only the broker that welcomed the peer counts: a file a finished
run left in the directory of a new one is no reason for a new peer to stop.
"""

from __future__ import annotations

import json
import os
import pathlib
import sys
import time
from collections.abc import Callable
from typing import Any

from dora.actor.cluster import ClusterInfo
from dora.config import ConfigError

WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


class NotYetWritten(ConfigError):
    """The discovery file is absent, or left by an earlier attempt of this Slurm job."""


def advertised(endpoint: str, host: str) -> str:
    """The endpoint as others can reach it: a wildcard bind address replaced by ``host``."""
    if not endpoint.startswith("tcp://"):
        return endpoint
    where, _, port = endpoint[len("tcp://") :].rpartition(":")
    return f"tcp://{host}:{port}" if where in WILDCARD_HOSTS else endpoint


def resolve_endpoint(target: str, cluster: ClusterInfo | None = None) -> str:
    """The broker endpoint named by ``target``: an endpoint, or a discovery file to read it from."""
    if target.startswith(("tcp://", "ipc://", "inproc://")):
        return target
    path = pathlib.Path(target)
    if not path.parent.is_dir():
        raise ConfigError(f"no broker at {target!r}: not an endpoint, and no directory {str(path.parent)!r}")
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise NotYetWritten(f"no broker at {target!r}: not an endpoint and no such discovery file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{target}: not a broker discovery file ({e})") from None
    endpoint = data.get("endpoint") if isinstance(data, dict) else None
    if not isinstance(endpoint, str):
        raise ConfigError(f"{target}: no endpoint in the discovery file")
    if cluster is not None and cluster.job_id is not None and str(data.get("slurm_job_id")) == cluster.job_id:
        attempt = data.get("slurm_restart", 0)
        if isinstance(attempt, int) and attempt < cluster.restart_count:
            raise NotYetWritten(f"{target} was written by attempt {attempt} of job {cluster.job_id}, "
                                f"this is attempt {cluster.restart_count}")  # fmt: skip
    return endpoint


def wait_for_endpoint(
    target: str,
    timeout_s: float,
    cluster: ClusterInfo | None = None,
    *,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] | None = None,
) -> str:
    """``resolve_endpoint``, waiting up to ``timeout_s`` for a discovery file that is not written yet
    (processes of one job start together; the broker may not have bound yet). Polls with backoff."""
    say = say or (lambda text: print(text, file=sys.stderr, flush=True))
    deadline = clock() + timeout_s
    delay, told = 0.1, False
    while True:
        try:
            return resolve_endpoint(target, cluster)
        except NotYetWritten as e:
            if clock() + delay > deadline:
                raise ConfigError(f"{e} (waited {timeout_s:g} s: broker.discovery_wait_s)") from None
            if not told:
                say(f"waiting up to {timeout_s:g} s for the broker's discovery file {target} ({e})")
                told = True
        sleep(delay)
        delay = min(2 * delay, 2.0)


def run_finished(target: str, broker_epoch: int) -> bool:
    """Whether ``target`` is a discovery file in which the broker of ``broker_epoch`` says its run is over."""
    if target.startswith(("tcp://", "ipc://", "inproc://")):
        return False
    try:
        data = json.loads(pathlib.Path(target).read_text())
    except (OSError, ValueError):
        return False  # absent, or being replaced: not a finished run
    return isinstance(data, dict) and data.get("finished") is True and data.get("broker_epoch") == broker_epoch


def mark_finished(ready: dict[str, Any], discovery_file: str | None) -> None:
    """Write the discovery file again, saying the run is over (atomically, like ``announce``)."""
    if discovery_file:
        write_atomically({**ready, "finished": True}, discovery_file)


def write_atomically(data: dict[str, Any], path: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
    os.replace(tmp, path)


def announce(ready: dict[str, Any], discovery_file: str | None) -> None:
    """Print the ``ready`` line and, if asked, write it as the discovery file (atomically: a reader sees the
    old file or the new one, never half of one)."""
    if discovery_file:
        write_atomically(ready, discovery_file)
    print(json.dumps(ready), flush=True)
