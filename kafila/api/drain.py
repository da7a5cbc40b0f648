"""A member's session API, drained before the member leaves on purpose (the host handing its role
over): `Drain` counts the requests that ask for work (every method but GET, HEAD and OPTIONS)
while they are answered, streams included; once `close(why)` is called, every new such request
gets 503 with a Retry-After and `why`, reads (/session, /metrics, /healthz, /v1/models) and CORS
preflights are still answered, and `drained(within)` waits until the requests already taken have
ended."""

from __future__ import annotations

import asyncio
import contextlib

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kafila.api.errors import ApiError, render

READS = ("GET", "HEAD", "OPTIONS")


class Drain:
    """The ASGI app the member's API server serves: `app` while open, refusing new work once
    closed."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.active = 0  # requests for work being answered
        self.why: str | None = None  # closed: what a refused request is told
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def closed(self) -> bool:
        return self.why is not None

    def close(self, why: str) -> None:
        """Take no new work from now on; `why` is what a refused request reads."""
        self.why = why

    async def drained(self, within: float) -> int:
        """Wait until every request taken before `close` has ended, at most `within` s; returns how
        many are still being answered (0: drained)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._idle.wait(), within)
        return self.active

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method", "GET") in READS:
            await self.app(scope, receive, send)
            return
        if self.why is not None:
            # "replanning": 503 with Retry-After, as while the session re-plans around a lost member
            response = render(Request(scope), ApiError(503, "replanning", self.why))
            await response(scope, receive, send)
            return
        self.active += 1
        self._idle.clear()
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1
            if self.active == 0:
                self._idle.set()
