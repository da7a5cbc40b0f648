"""A real rendezvous on loopback (127.0.0.1, with 127.0.0.2 as its second address), per test."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from kafila.rendezvous.limits import Limits
from kafila.rendezvous.server import RendezvousServer, ServerConfig

Factory = Callable[..., Awaitable[RendezvousServer]]


@pytest.fixture
async def start_rendezvous() -> AsyncIterator[Factory]:
    started: list[RendezvousServer] = []

    async def start(
        alt_host: str | None = "127.0.0.2",
        tick_s: float = 0.05,
        cert: str | None = None,
        key: str | None = None,
        **limits: Any,
    ) -> RendezvousServer:
        config = ServerConfig(
            host="127.0.0.1",
            port=0,
            udp_port=0,
            udp_alt_port=0,
            udp_alt_host=alt_host,
            cert=cert,
            key=key,
            limits=dataclasses.replace(Limits(), **limits),
            tick_s=tick_s,
        )
        server = RendezvousServer(config)
        await server.start()
        started.append(server)
        return server

    yield start
    for server in started:
        await server.stop()
