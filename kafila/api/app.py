"""The API every member serves (bound to localhost by default): OpenAI and Ollama routes,
/session, /traces, /metrics, /healthz, and / (the member page for a browser, a line saying it runs
for other clients: kafila.api.page). Errors are rendered in one place
(kafila.api.errors)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kafila.api import ollama, openai, page
from kafila.api.errors import ApiError, handle_api_error, handle_generation_error, render
from kafila.api.security import ApiGuard, ApiSecurity
from kafila.api.service import GenerationError
from kafila.api.state import Api, api_of
from kafila.api.stream import ClientGone
from kafila.obs import metrics
from kafila.obs.http import CountResponses
from kafila.obs.log import get_logger

log = get_logger("kafila.api")


async def session(request: Request) -> Response:
    return JSONResponse(api_of(request).service.describe())


async def traces(request: Request) -> Response:
    log = api_of(request).traces
    return JSONResponse({"traces": log.recent() if log else []})


async def metrics_text(request: Request) -> Response:
    """The member's metrics, its state and queue read from its /session document first (a forming
    member's app has no service yet: its series say what the session last set)."""
    api = getattr(request.app.state, "api", None)
    if api is not None:
        metrics.observe_document(api.service.describe())
    return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")


async def healthz(request: Request) -> Response:
    """200 while the member serves; 503 once its ring broke (every request would get 503, and the
    session does not mend: a container's HEALTHCHECK or a monitor should see it as down)."""
    doc = api_of(request).service.describe()
    if doc.get("state") == "broken":
        return JSONResponse({"ok": False, "state": "broken", "error": doc.get("error")}, status_code=503)
    return JSONResponse({"ok": True, "state": doc.get("state")})


async def not_found(request: Request, exc: Exception) -> Response:
    return render(request, ApiError(404, "not_found", f"no route {request.method} {request.url.path}"))


async def wrong_method(request: Request, exc: Exception) -> Response:
    """405 in the route's own error shape, naming the methods it takes (Starlette's is plain text)."""
    allowed = getattr(exc, "headers", None) or {}
    methods = allowed.get("Allow", "another method")
    message = f"{request.url.path} does not take {request.method}; use {methods}"
    response = render(request, ApiError(405, "method_not_allowed", message))
    response.headers["Allow"] = methods
    return response


async def internal_error(request: Request, exc: Exception) -> Response:
    """A fault of this server (a bug): a JSON 500 in the route's error shape, named, and logged."""
    log.error("api_internal_error", path=request.url.path, error=repr(exc))
    return render(request, ApiError(500, "internal", f"internal error: {exc!r}"))


async def client_gone(request: Request, exc: Exception) -> Response:
    """The client left before its answer (its request is cancelled): 499, which nobody reads."""
    return Response(status_code=499)


def create_app(api: Api, security: ApiSecurity | None = None) -> Starlette:
    """The session's API; with `security`, behind its guard (kafila.api.security: keys, Host,
    Origin, JSON bodies). A member serves it through `ApiServer`, which guards every app it serves
    (the forming app before this one included): give `security` to one of the two, not both."""
    routes = [
        Route("/", page.root, methods=["GET"]),
        Route(page.ASSET_PATH, page.asset, methods=["GET"]),
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/v1/models/{model:path}", openai.model, methods=["GET"]),
        Route("/api/chat", ollama.chat, methods=["POST"]),
        Route("/api/generate", ollama.generate, methods=["POST"]),
        Route("/api/tags", ollama.tags, methods=["GET"]),
        Route("/api/show", ollama.show, methods=["POST"]),
        Route("/api/ps", ollama.ps, methods=["GET"]),
        Route("/api/version", ollama.version, methods=["GET"]),
        Route("/session", session, methods=["GET"]),
        Route("/traces", traces, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    handlers = {
        ApiError: handle_api_error,
        GenerationError: handle_generation_error,
        ClientGone: client_gone,
        404: not_found,
        405: wrong_method,
        Exception: internal_error,
    }
    guard = [Middleware(ApiGuard, security=security)] if security is not None else []
    # outermost: the guard's refusals count too
    counted = Middleware(CountResponses, paths=[r.path for r in routes])
    app = Starlette(routes=routes, exception_handlers=handlers, middleware=[counted, *guard])
    app.state.api = api
    return app
