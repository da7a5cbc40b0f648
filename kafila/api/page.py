"""The member page at `/`: the ring at a glance for a person with a browser, no Grafana needed.

A browser (Accept: text/html) gets a page that reads this member's /session and /traces and shows the
members, their blocks, the head, each edge (direct or relay, its round trip), predicted against
measured per stage, recent requests, and a chat box that streams an answer from /v1/chat/completions.
Everything is served from the package (kafila/api/static): no CDN, works offline. Any other client
(curl, Ollama's clients probing for a server) gets the one line Ollama's server answers with."""

from __future__ import annotations

from importlib import resources

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response

ASSET_PATH = "/_kafila/{name}"
ASSETS = {"page.js": "text/javascript; charset=utf-8", "page.css": "text/css; charset=utf-8"}
RUNNING = "Kafila is running (OpenAI API at /v1, Ollama API at /api, this session at /session)\n"


def _static(name: str) -> bytes:
    return resources.files("kafila.api").joinpath("static", name).read_bytes()


def wants_html(request: Request) -> bool:
    return "text/html" in request.headers.get("accept", "")


async def root(request: Request) -> Response:
    """200 at / (and HEAD): the page for a browser; for other clients the line Ollama answers there,
    so clients and monitors that look for a running server before calling /api or /v1 find one."""
    if wants_html(request):
        return Response(_static("page.html"), media_type="text/html; charset=utf-8")
    return PlainTextResponse(RUNNING)


async def asset(request: Request) -> Response:
    name = request.path_params["name"]
    if name not in ASSETS:
        return PlainTextResponse(f"no asset {name}\n", status_code=404)
    return Response(_static(name), media_type=ASSETS[name], headers={"Cache-Control": "no-cache"})
