"""Every API error in one place: `ApiError` carries status, code and message; one handler renders it
as OpenAI's `{"error": {...}}` on /v1 routes and as Ollama's `{"error": "..."}` on /api routes."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kafila.api.service import GenerationError

# GenerationError.code -> HTTP status
_STATUS = {
    "bad_request": 400,
    "too_long": 400,
    "busy": 429,
    "cancelled": 499,
    "member_lost": 503,
    "replanning": 503,  # a member was lost and the session re-plans: ask again in a few seconds
    "session_ended": 503,
    "internal": 500,
}


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.param = status, code, message, param

    @classmethod
    def from_generation(cls, exc: GenerationError) -> ApiError:
        return cls(_STATUS.get(exc.code, 500), exc.code, exc.message)


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, "invalid_parameter", message, param)


# a full queue frees a place whenever one of the requests served ends: ask again in the smallest
# whole number of seconds (clients such as openai's honour it; a broken ring's 503 has none, as
# asking again will not help)
RETRY_BUSY_S = 1
RETRY_REPLANNING_S = 3  # a re-plan takes a few seconds (benchmarks/replan.py)


def render(request: Request, exc: ApiError) -> Response:
    headers = {"Retry-After": str(RETRY_BUSY_S)} if exc.status == 429 else None
    if exc.code == "replanning":
        headers = {"Retry-After": str(RETRY_REPLANNING_S)}
    if request.url.path.startswith("/api/"):
        return JSONResponse({"error": exc.message}, status_code=exc.status, headers=headers)
    kind = "invalid_request_error" if exc.status < 500 else "server_error"
    body = {"message": exc.message, "type": kind, "param": exc.param, "code": exc.code}
    return JSONResponse({"error": body}, status_code=exc.status, headers=headers)


async def handle_api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return render(request, exc)


async def handle_generation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, GenerationError)
    return render(request, ApiError.from_generation(exc))
