"""A member's API drained before it leaves (kafila.api.drain): once closed, new work gets 503 with a
Retry-After and the reason, reads still answer, and a stream taken before runs to its end, which
`drained` waits for (bounded). Served by the real API server (uvicorn) on a free port."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from kafila.api.drain import Drain
from kafila.api.server import ApiServer


def _app(release: asyncio.Event, streaming: asyncio.Event) -> Starlette:
    async def generate(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first\n"
            streaming.set()
            await release.wait()
            yield b"last\n"

        return StreamingResponse(chunks(), media_type="text/plain")

    async def session(request: Request) -> JSONResponse:
        return JSONResponse({"state": "serving"})

    return Starlette(
        routes=[Route("/v1/completions", generate, methods=["POST"]), Route("/session", session)]
    )


async def test_a_closed_drain_refuses_new_work_answers_reads_and_lets_a_stream_it_took_finish() -> None:
    release, streaming = asyncio.Event(), asyncio.Event()
    drain = Drain(_app(release, streaming))
    server = await ApiServer(_app(release, streaming)).start()
    server.switch(drain)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            async with client.stream("POST", "/v1/completions", json={}) as r:
                lines = r.aiter_lines()
                assert await anext(lines) == "first"
                await asyncio.wait_for(streaming.wait(), 5)
                assert drain.active == 1
                drain.close("this member hands the session's host role over to beta and leaves")
                refused = await client.post("/v1/completions", json={})
                assert refused.status_code == 503 and refused.headers["Retry-After"] == "3"
                assert refused.json()["error"]["message"].startswith("this member hands the session's host")
                assert (await client.get("/session")).json() == {"state": "serving"}
                assert await drain.drained(0.2) == 1  # the stream still runs: not drained within 0.2 s
                waiting = asyncio.ensure_future(drain.drained(10))
                release.set()
                assert await anext(lines) == "last"
            assert await waiting == 0
            assert drain.active == 0
    finally:
        await server.stop()
