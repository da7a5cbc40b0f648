"""The API every member serves (bound to localhost by default): OpenAI and Ollama routes,
/session, /traces, /metrics, /healthz. Errors are rendered in one place (kafila.api.errors)."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from kafila.api import ollama, openai
from kafila.api.errors import ApiError, handle_api_error, handle_generation_error
from kafila.api.state import Api, api_of
from kafila.obs import metrics
from kafila.session.service import GenerationError


async def session(request: Request) -> Response:
    return JSONResponse(api_of(request).service.describe())


async def traces(request: Request) -> Response:
    log = api_of(request).traces
    return JSONResponse({"traces": log.recent() if log else []})


async def metrics_text(request: Request) -> Response:
    return Response(metrics.exposition(), media_type="text/plain; version=0.0.4")


async def healthz(request: Request) -> Response:
    return JSONResponse({"ok": True, "state": api_of(request).service.describe().get("state")})


async def not_found(request: Request, exc: Exception) -> Response:
    from kafila.api.errors import render

    return render(request, ApiError(404, "not_found", f"no route {request.method} {request.url.path}"))


def create_app(api: Api) -> Starlette:
    routes = [
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/models", openai.models, methods=["GET"]),
        Route("/api/chat", ollama.chat, methods=["POST"]),
        Route("/api/generate", ollama.generate, methods=["POST"]),
        Route("/api/tags", ollama.tags, methods=["GET"]),
        Route("/session", session, methods=["GET"]),
        Route("/traces", traces, methods=["GET"]),
        Route("/metrics", metrics_text, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
    ]
    handlers = {ApiError: handle_api_error, GenerationError: handle_generation_error, 404: not_found}
    app = Starlette(routes=routes, exception_handlers=handlers)  # type: ignore[arg-type]
    app.state.api = api
    return app
