"""kafila_http_responses_total: every response of an app counted by its route template and status."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.testclient import TestClient

from kafila.obs import metrics
from kafila.obs.http import CountResponses
from tests.obs.test_metrics import value


async def ok(request: Request) -> Response:
    return JSONResponse({"ok": True})


async def busy(request: Request) -> Response:
    return JSONResponse({"error": "replanning"}, status_code=503, headers={"Retry-After": "5"})


async def fails(request: Request) -> Response:
    raise RuntimeError("a bug")


def test_responses_are_counted_by_route_template_and_status_an_unknown_path_as_other() -> None:
    routes = [Route("/healthz", ok), Route("/v1/models/{model:path}", busy), Route("/boom", fails)]
    app = Starlette(routes=routes, middleware=[Middleware(CountResponses, paths=[r.path for r in routes])])
    before = metrics.exposition().decode()
    with TestClient(app, raise_server_exceptions=False) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/models/a").status_code == 503 and client.get("/v1/models/b").status_code == 503
        assert client.get("/healthz", params={"x": 1}).status_code == 200
        assert client.post("/healthz").status_code == 405  # a route, another method
        assert client.get("/no/such/path/42").status_code == 404
        assert client.get("/boom").status_code == 500
    text = metrics.exposition().decode()

    def grew(route: str, status: str) -> float:
        name = "kafila_http_responses_total"
        return value(text, name, route=route, status=status) - value(before, name, route=route, status=status)

    assert grew("/healthz", "200") == 3
    assert grew("/v1/models/{model:path}", "503") == 2  # one series for every model named
    assert grew("/healthz", "405") == 1
    assert grew("other", "404") == 1
    assert grew("/boom", "500") == 1
