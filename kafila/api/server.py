"""Serving the API app with uvicorn inside the member's event loop (no extra process or thread)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable

import uvicorn
from starlette.applications import Starlette
from starlette.types import ASGIApp, Receive, Scope, Send

from kafila.api.connections import (
    ConnectionGuard,
    GuardedConfig,
    guard_accept_errors,
    throttle_uvicorn_errors,
)
from kafila.api.overload import API_BACKLOG, DEFAULT_LIMITS, ApiLimits
from kafila.api.security import NO_SECURITY, ApiGuard, ApiSecurity
from kafila.net.tcp import STOP_GRACE_S, bind_tcp
from kafila.obs.log import get_logger
from kafila.proto.udp import format_address

log = get_logger("kafila.api")


def parse_addr(text: str, default_port: int = 11434) -> tuple[str, int]:
    """ "127.0.0.1:8000", ":8000", "8000" -> (host, port); the host defaults to localhost."""
    host, _, port = text.rpartition(":") if ":" in text else ("", "", text)
    try:
        number = int(port) if port else default_port
    except ValueError:
        raise ValueError(f"--api {text!r}: expected HOST:PORT, :PORT or PORT") from None
    if not 0 <= number <= 65535:
        raise ValueError(f"--api {text!r}: port {number} is outside 0-65535")
    return host.strip("[]") or "127.0.0.1", number


class _Switch:
    """The ASGI app uvicorn serves: each request goes to whichever app is current when it comes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class ApiServer:
    """uvicorn serving `app` on `sock` (bound before, `bind_tcp`; default: a free localhost port).
    `switch(app)` serves another app from the next request on, on the same address (a forming
    member's API becomes the session's). `security` guards every app it serves (keys, Host, Origin,
    JSON bodies: kafila.api.security); without keys the Host, Origin and JSON checks still hold.
    `limits` bound its connections (kafila.api.overload), fitted under the process's descriptor
    limit as it is when the server is made."""

    def __init__(
        self,
        app: Starlette,
        sock: socket.socket | None = None,
        security: ApiSecurity = NO_SECURITY,
        grace_s: int = STOP_GRACE_S,
        limits: ApiLimits = DEFAULT_LIMITS,
    ) -> None:
        self.sock = sock if sock is not None else bind_tcp("127.0.0.1", 0)
        self._switch = _Switch(app)
        guarded: ASGIApp = ApiGuard(self._switch, security)
        self.descriptors = descriptor_limit()
        self.limits = limits.fitted(self.descriptors)
        self.guard = ConnectionGuard(self.limits, security)
        config = GuardedConfig(
            guarded,
            self.guard,
            log_level="warning",
            lifespan="off",
            timeout_graceful_shutdown=grace_s,
            backlog=API_BACKLOG,
        )
        throttle_uvicorn_errors()  # after the Config, which configures uvicorn's loggers
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None
        self._restore_handler: Callable[[], None] | None = None

    async def start(self) -> ApiServer:
        self._restore_handler = guard_accept_errors(asyncio.get_running_loop(), self.sock, self.guard)
        self._task = asyncio.ensure_future(self._server.serve(sockets=[self.sock]))
        while not self._server.started:
            if self._task.done():
                self._restore_handler()
                self._task.result()  # raises why it could not start
            await asyncio.sleep(0.01)
        limits = self.limits
        log.info(
            "api_listening",
            url=self.url,
            max_connections=limits.max_connections,
            max_unauthenticated=limits.max_unauthenticated,
            read_timeout_s=limits.read_timeout_s,
            descriptor_limit=self.descriptors,
        )
        return self

    def switch(self, app: ASGIApp) -> None:
        self._switch.app = app

    @property
    def port(self) -> int:
        return int(self.sock.getsockname()[1])

    @property
    def host(self) -> str:
        return str(self.sock.getsockname()[0])

    @property
    def url(self) -> str:
        return f"http://{format_address((self.host, self.port))}"

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._restore_handler is not None:
            self._restore_handler()
        self.sock.close()


def descriptor_limit() -> int | None:
    """The process's soft limit on open descriptors (None: none, or no such limit here)."""
    try:
        import resource  # Unix
    except ImportError:
        return None
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return None if soft == resource.RLIM_INFINITY else int(soft)
