"""structlog setup: one event per thing that happened, never per token.

`KAFILA_LOG=json` switches to JSON lines (containers); the default renders for a terminal.
`KAFILA_LOG_LEVEL` sets the level (default `info`). Logs go to stderr so stdout stays for results.
A value outside those (see FORMATS, LEVELS) is refused, naming the variable, not taken for the default.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

FORMATS = ("console", "json")
LEVELS = ("debug", "info", "warning", "error")


def configure_logging(fmt: str | None = None, level: str | None = None) -> None:
    """Logs in `fmt` (else $KAFILA_LOG, else console) from `level` up (else $KAFILA_LOG_LEVEL, else
    info); ValueError naming the setting if either is not one of FORMATS or LEVELS."""
    fmt = _setting("KAFILA_LOG", fmt, "console", FORMATS)
    level_name = _setting("KAFILA_LOG_LEVEL", level, "info", LEVELS).upper()
    # An event's exc_info becomes its plain traceback text: structlog's default console renderer
    # draws a rich traceback with every frame's locals, which for a member's failed task walked
    # its whole model and session state (a test's process grew past 20 GB rendering one).
    renderer: structlog.typing.Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    else:
        tb = structlog.dev.plain_traceback
        renderer = structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty(), exception_formatter=tb)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name)),
        logger_factory=_StderrLogger,
        cache_logger_on_first_use=False,
    )


def _setting(env: str, given: str | None, default: str, allowed: tuple[str, ...]) -> str:
    value = (given or os.environ.get(env) or default).strip().lower()
    if value not in allowed:
        raise ValueError(f"{env}={value!r}: expected one of {', '.join(allowed)}")
    return value


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
