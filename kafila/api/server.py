"""Serving the API app with uvicorn inside the member's event loop (no extra process or thread)."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn
from starlette.applications import Starlette

from kafila.obs.log import get_logger

log = get_logger("kafila.api")


def parse_addr(text: str, default_port: int = 11434) -> tuple[str, int]:
    """ "127.0.0.1:8000", ":8000", "8000" -> (host, port); the host defaults to localhost."""
    host, _, port = text.rpartition(":") if ":" in text else ("", "", text)
    try:
        return host.strip("[]") or "127.0.0.1", int(port) if port else default_port
    except ValueError:
        raise ValueError(f"--api {text!r}: expected HOST:PORT, :PORT or PORT") from None


class ApiServer:
    def __init__(self, app: Starlette, host: str = "127.0.0.1", port: int = 0) -> None:
        config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="off")
        self._server = uvicorn.Server(config)
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> ApiServer:
        self._task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start (port in use, ...)
            await asyncio.sleep(0.01)
        log.info("api_listening", url=self.url)
        return self

    @property
    def port(self) -> int:
        return int(self._server.servers[0].sockets[0].getsockname()[1])

    @property
    def host(self) -> str:
        return str(self._server.config.host)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def stop(self) -> None:
        self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
