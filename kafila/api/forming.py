"""The API while the session forms. A member's address is bound when it starts, and forming takes
minutes (probing, waiting for the others, fetching weights); a client that connected meanwhile used
to wait in the listen backlog with no answer, unable to tell a forming member from a hung one.
Now /session and /healthz say what the member is doing, /metrics serves as always, and every other
route answers 503 at once with the same text and a Retry-After. Once every member is ready, the
server switches to the full app (kafila.api.server.ApiServer.switch)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kafila.api.app import metrics_text
from kafila.api.errors import ApiError, render
from kafila.obs import metrics

RETRY_AFTER_S = 5  # what a 503 while forming asks the client to wait before asking again
METHODS = ["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


@dataclass
class FormingStatus:
    """What a forming member is doing: its last progress line (kafila.session.form.say)."""

    role: str  # "host" or "member"
    name: str | None = None  # known once the member has joined (a joining member's may change)
    model: str | None = None
    session: str | None = None  # the session code's public part, once opened or joined
    members_expected: int | None = None  # members the session forms for, once known
    step: str = "starting"
    started: float = field(default_factory=time.time)  # wall clock, as /session's other times
    spare: str | None = None  # why the host keeps this member as a spare (kafila.api.spare), once it does
    host: str | None = None  # a spare's host, which answers its requests

    def tell(self, text: str) -> None:
        self.step = text

    def document(self, now: float) -> dict[str, Any]:
        spare = {} if self.spare is None else {"host": self.host, "spare": self.spare}
        return {
            "state": "forming" if self.spare is None else "spare",
            "role": self.role,
            "me": self.name,
            "model": self.model,
            "session": self.session,
            "members_expected": self.members_expected,
            "step": self.step,
            "forming_s": round(max(0.0, now - self.started), 1),
        } | spare

    def refusal(self) -> ApiError:
        return ApiError(
            503,
            "forming",
            f"the session is still forming: {self.step}. This member answers requests once it is "
            'ready (GET /session says "serving")',
        )


def forming_app(status: FormingStatus) -> Starlette:
    async def session(request: Request) -> Response:
        return JSONResponse(status.document(time.time()))

    async def healthz(request: Request) -> Response:
        return JSONResponse({"ok": True, "state": "forming"})

    async def forming_metrics(request: Request) -> Response:
        metrics.observe_document(status.document(time.time()))  # kafila_session_state{state="forming"}
        return await metrics_text(request)

    async def not_yet(request: Request) -> Response:
        response = render(request, status.refusal())
        response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response

    routes = [
        Route("/session", session, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/metrics", forming_metrics, methods=["GET"]),  # scraped whether or not the session formed
        Route("/{path:path}", not_yet, methods=METHODS),
    ]
    return Starlette(routes=routes)
