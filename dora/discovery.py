"""Finding the broker: an endpoint string, or the discovery file the broker writes atomically."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from dora.config import ConfigError


def resolve_endpoint(target: str) -> str:
    if target.startswith(("tcp://", "ipc://", "inproc://")):
        return target
    path = pathlib.Path(target)
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"no broker at {target!r}: not an endpoint and no such discovery file") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{target}: not a broker discovery file ({e})") from None
    endpoint = data.get("endpoint") if isinstance(data, dict) else None
    if not isinstance(endpoint, str):
        raise ConfigError(f"{target}: no endpoint in the discovery file")
    return endpoint


def announce(ready: dict[str, Any], discovery_file: str | None) -> None:
    """Print the ``ready`` line and, if asked, write it as the discovery file (atomically: a reader sees the
    old file or the new one, never half of one)."""
    if discovery_file:
        tmp = f"{discovery_file}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(ready, f)
        os.replace(tmp, discovery_file)
    print(json.dumps(ready), flush=True)
