"""The API server's own lifetime: `stop()` is bounded even while an answer never ends."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

from kafila.api.server import ApiServer


async def test_stop_cancels_a_stream_that_never_ends_after_its_grace() -> None:
    """A stream whose generation never ends (its ring gone, say) used to hold `stop()`, and with it
    the member's exit, for good: uvicorn waits for every open response unless told a bound."""
    streaming = asyncio.Event()

    async def forever(request: Request) -> StreamingResponse:
        async def chunks() -> AsyncIterator[bytes]:
            yield b"first\n"
            streaming.set()
            await asyncio.Event().wait()  # the rest never comes
            yield b"never\n"

        return StreamingResponse(chunks(), media_type="text/plain")

    async def ok(request: Request) -> PlainTextResponse:
        return PlainTextResponse("ok")

    app = Starlette(routes=[Route("/forever", forever), Route("/ok", ok)])
    server = await ApiServer(app, grace_s=1).start()
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        assert (await client.get("/ok")).text == "ok"
        async with client.stream("GET", "/forever") as r:
            lines = r.aiter_lines()
            assert await anext(lines) == "first"
            await asyncio.wait_for(streaming.wait(), 5)
            started = time.monotonic()
            await asyncio.wait_for(server.stop(), 10)
            took = time.monotonic() - started
    assert 1.0 <= took < 5.0, took
