"""structlog setup, called once in each process's ``main``: JSON lines (console rendering on a TTY)."""

from __future__ import annotations

import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Any, Literal

import structlog

from dora.config import ConfigError


@dataclass(frozen=True, slots=True, kw_only=True)
class LogConfig:
    """Structured logs (structlog): one JSON object per line, or console rendering."""

    level: Literal["debug", "info", "warning", "error"] = "info"
    """Lowest level written."""
    format: Literal["auto", "json", "console"] = "auto"
    """auto: console on a terminal, JSON lines otherwise."""

    def __post_init__(self) -> None:
        if self.level not in ("debug", "info", "warning", "error"):
            raise ConfigError(f"log.level must be debug, info, warning or error; got {self.level!r}")


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
        cache_logger_on_first_use=False,
    )
    structlog.contextvars.clear_contextvars()
    structlog.contextvars.bind_contextvars(**{"process": process, "host": socket.gethostname(), "pid": os.getpid(),
                                              **bound})  # fmt: skip
