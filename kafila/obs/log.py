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
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name)
