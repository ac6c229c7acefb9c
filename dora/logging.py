"""structlog setup, called once in each process's ``main``: JSON lines (console rendering on a TTY)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from typing import Any

import structlog

from dora.config.run import LogConfig


def configure_logging(cfg: LogConfig, *, process: str, stream: Any = None, **bound: Any) -> None:
    stream = stream or sys.stderr
    console = cfg.format == "console" or (cfg.format == "auto" and stream.isatty())
    renderer: Any = structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.dict_tracebacks,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, cfg.level.upper())),
        logger_factory=structlog.PrintLoggerFactory(stream),
        cache_logger_on_first_use=True,  # once configured, a module's logger is built once, not on every call
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**{"process": process, "host": socket.gethostname(), "pid": os.getpid(),
                                              **bound})  # fmt: skip
