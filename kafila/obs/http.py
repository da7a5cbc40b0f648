"""Every HTTP response of a member's API counted by route and status (`kafila_http_responses_total`),
as ASGI middleware around the app (kafila.api.app.create_app): the 503s of a re-planning or broken
ring included, and the guard's refusals (401, 403) where the app holds the guard. A route is the
matched route's path template; a path no route matched counts under its own path where it is one
of the app's routes, else as "other" (bounded labels)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kafila.obs import metrics

OTHER = "other"


class CountResponses:
    def __init__(self, app: ASGIApp, paths: Iterable[str] = ()) -> None:
        self.app = app
        self.paths = frozenset(paths)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [500]  # what a request that raised through every handler ends as

        async def counted(message: Message) -> None:
            if message["type"] == "http.response.start":
                status[0] = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            metrics.observe_response(self.route(scope), status[0])

    def route(self, scope: Scope) -> str:
        matched: Any = scope.get("route")
        template = getattr(matched, "path", None)
        if isinstance(template, str):
            return template
        path = str(scope.get("path", ""))
        return path if path in self.paths else OTHER
