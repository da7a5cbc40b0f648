"""structlog setup: one event per thing that happened, never per token.

`KAFILA_LOG=json` switches to JSON lines (containers); the default renders for a terminal.
`KAFILA_LOG_LEVEL` sets the level (default `info`). Logs go to stderr so stdout stays for results.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    fmt = fmt or os.environ.get("KAFILA_LOG", "console")
    level_name = (level or os.environ.get("KAFILA_LOG_LEVEL", "info")).upper()
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, logging.INFO)),
        logger_factory=_StderrLogger,
        cache_logger_on_first_use=False,
    )


class _StderrLogger:
    """Writes each rendered event to whatever `sys.stderr` is at that moment, so a logger made
    before stderr was swapped (pytest's capture, a daemonized process) never holds a closed file."""

    def __init__(self, *_args: object) -> None:
        pass

    def msg(self, message: str) -> None:
        stream = sys.stderr
        stream.write(message + "\n")
        stream.flush()

    log = debug = info = warn = warning = error = critical = exception = fatal = msg


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
