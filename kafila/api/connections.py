"""The API's connections held to kafila.api.overload's limits, inside uvicorn.

uvicorn 0.54's h11 protocol has no deadline for a request's headers or body (its keep-alive
timeout stops at the first byte of the next request) and admits every connection it accepts
(`limit_concurrency` answers 503 only once a request's headers are in, and counts the idle ones
it keeps), so `GuardedH11Protocol` adds both, through the hooks uvicorn calls anyway:
`connection_made` asks the `ConnectionGuard` whether to keep the connection, and after each
read and each answer the protocol arms the deadline its h11 state asks for (headers, body, or
none while the app answers). `guard_accept_errors` takes asyncio's accept failures (out of
descriptors) off the loop's default handler, which logs each one with its traceback.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any, cast

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from kafila.api.overload import ApiLimits, ConnectionBook, Throttle
from kafila.api.security import ApiSecurity, shows_key
from kafila.obs.log import get_logger

log = get_logger("kafila.api")

ACCEPT_FAILED = "socket.accept() out of system resource"  # asyncio's message (selector_events)


class ConnectionGuard:
    """One API server's connections: the book of them, and the events of what was shed (each kind
    at most once per kafila.api.overload.LOG_EVERY_S, with a count of those left out)."""

    def __init__(
        self, limits: ApiLimits, security: ApiSecurity, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits, self.security, self.clock = limits, security, clock
        self.book: ConnectionBook[GuardedH11Protocol] = ConnectionBook(limits)
        self.shed = {kind: Throttle() for kind in ("refused", "evicted", "headers", "body", "accept")}

    def opened(self, conn: GuardedH11Protocol) -> bool:
        kept, evicted = self.book.admit(conn, self.clock())
        if evicted is not None:
            evicted.close_now()
            self._report("evicted", "api_connection_evicted", why="unauthenticated connections at their cap")
        if not kept:
            self._report("refused", "api_connection_refused", why="at a cap, none to push out")
        return kept

    def headers_in(self, conn: GuardedH11Protocol, headers: list[tuple[bytes, bytes]]) -> None:
        if shows_key(self.security, headers):
            self.book.authenticated(conn)

    def closed(self, conn: GuardedH11Protocol) -> None:
        self.book.forget(conn)

    def timed_out(self, phase: str) -> None:
        self._report(phase, "api_read_timeout", phase=phase, timeout_s=self.limits.read_timeout_s)

    def accept_failed(self, exc: BaseException | None) -> None:
        self._report("accept", "api_accept_failed", error=str(exc), level="warning")

    def _report(self, kind: str, event: str, level: str = "info", **fields: Any) -> None:
        left_out = self.shed[kind].due(self.clock())
        if left_out is None:
            return
        emit = log.warning if level == "warning" else log.info
        emit(
            event,
            left_out=left_out,
            open=len(self.book.open),
            unauthenticated=len(self.book.unauthenticated),
            max_connections=self.limits.max_connections,
            max_unauthenticated=self.limits.max_unauthenticated,
            **fields,
        )


class GuardedConfig(uvicorn.Config):
    """uvicorn's Config carrying the `ConnectionGuard` its protocols report to. No WebSockets (the
    API serves none): an upgraded connection leaves the h11 protocol without its connection_lost,
    so it would stay counted for good."""

    def __init__(self, app: Any, guard: ConnectionGuard, **kwargs: Any) -> None:
        super().__init__(app, http=GuardedH11Protocol, ws="none", **kwargs)
        self.guard = guard


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with its connection admitted by the guard and a read deadline."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: Any,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.guard = cast(GuardedConfig, config).guard
        self._deadline: asyncio.TimerHandle | None = None
        self._phase = "headers"  # what the deadline waits for: headers, body, or "answer" (none)
        self._kept = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[arg-type]
        self._kept = self.guard.opened(self)
        if not self._kept:
            self.transport.close()
            return
        self._expect("headers")

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._follow()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel()
        self.guard.closed(self)
        super().connection_lost(exc)

    def close_now(self) -> None:
        self._cancel()
        if not self.transport.is_closing():
            self.transport.close()

    def _follow(self) -> None:
        """Arm the deadline the request's state asks for."""
        if not self._kept or self.transport.is_closing():
            self._cancel()
            return
        state = self.conn.their_state
        if state is h11.IDLE:  # a request's headers to come (the first, or the next on keep-alive)
            if self._phase != "headers":
                self._expect("headers")
        elif state is h11.SEND_BODY:
            if self._phase == "headers":
                self.guard.headers_in(self, self.headers)
            if self._phase != "body":
                self._expect("body")
        elif self._phase != "answer":  # DONE (or closing): the request is in, the app answers
            if self._phase == "headers" and self.headers is not None:
                self.guard.headers_in(self, self.headers)
            self._cancel()
            self._phase = "answer"

    def _expect(self, phase: str) -> None:
        self._cancel()
        self._phase = phase
        self._deadline = self.loop.call_later(self.guard.limits.read_timeout_s, self._timed_out)

    def _cancel(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _timed_out(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.guard.timed_out(self._phase)
            self.transport.close()  # the app, if reading a body, gets http.disconnect


def guard_accept_errors(
    loop: asyncio.AbstractEventLoop, listener: Any, guard: ConnectionGuard
) -> Callable[[], None]:
    """Send asyncio's accept failures on `listener` (a socket) to `guard` (a throttled event)
    instead of the loop's handler; returns the function that puts the previous handler back.
    asyncio 3.11 tries `backlog` accepts per wake-up and reports each failure with a traceback:
    71,593 of them in 45 s once a member's descriptors ran out."""
    previous = loop.get_exception_handler()
    fileno = listener.fileno()

    def handler(loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        sock = context.get("socket")
        if context.get("message") == ACCEPT_FAILED and sock is not None and sock.fileno() == fileno:
            guard.accept_failed(context.get("exception"))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)

    def restore() -> None:
        if loop.get_exception_handler() is handler:
            loop.set_exception_handler(previous)

    return restore


class ThrottledRecords(logging.Filter):
    """A stdlib logging filter letting each message through at most once per `every_s`, the next
    one saying how many were left out: uvicorn's own warnings ("Invalid HTTP request received.")
    come once per request."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.clock = clock
        self._throttles: dict[tuple[int, str], Throttle] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.levelno, str(record.msg))
        throttle = self._throttles.setdefault(key, Throttle())
        left_out = throttle.due(self.clock())
        if left_out is None:
            return False
        if left_out:
            record.msg = f"{record.msg} ({left_out} more like it left out)"
        return True


UVICORN_ERRORS = logging.getLogger("uvicorn.error")


def throttle_uvicorn_errors() -> None:
    """Install `ThrottledRecords` on uvicorn's error logger, once per process."""
    if not any(isinstance(f, ThrottledRecords) for f in UVICORN_ERRORS.filters):
        UVICORN_ERRORS.addFilter(ThrottledRecords())
