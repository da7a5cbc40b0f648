"""The API every member serves (bound to localhost by default): OpenAI and Ollama routes,
/session, /traces, /metrics, /healthz, and / saying it runs. Errors are rendered in one place
(kafila.api.errors)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from kafila.api import ollama, openai
from kafila.api.errors import ApiError, handle_api_error, handle_generation_error, render
from kafila.api.service import GenerationError
from kafila.api.state import Api, api_of
from kafila.api.stream import ClientGone
from kafila.obs import metrics
from kafila.obs.log import get_logger

log = get_logger("kafila.api")


async def session(request: Request) -> Response:
    return JSONResponse(api_of(request).service.describe())


async def traces(request: Request) -> Response:
    log = api_of(request).traces
    return JSONResponse({"traces": log.recent() if log else []})


async def metrics_text(request: Request) -> Response:
    return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")


async def healthz(request: Request) -> Response:
    """200 while the member serves; 503 once its ring broke (every request would get 503, and the
    session does not mend: a container's HEALTHCHECK or a monitor should see it as down)."""
    doc = api_of(request).service.describe()
    if doc.get("state") == "broken":
        return JSONResponse({"ok": False, "state": "broken", "error": doc.get("error")}, status_code=503)
    return JSONResponse({"ok": True, "state": doc.get("state")})


async def root(request: Request) -> Response:
    """200 at / (and HEAD), as Ollama's server answers there: clients and monitors that look for a
    running server before calling /api or /v1 find one."""
    return PlainTextResponse(
        "Kafila is running (OpenAI API at /v1, Ollama API at /api, this session at /session)\n"
    )


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


def create_app(api: Api) -> Starlette:
    routes = [
        Route("/", root, methods=["GET"]),
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
    app = Starlette(routes=routes, exception_handlers=handlers)
    app.state.api = api
    return app
