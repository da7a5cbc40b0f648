"""The signaling client says why its connection to the rendezvous ended, in words a person reads:
from the WebSocket close the rendezvous sent, or from its absence. Real WebSocket servers on
loopback play a rendezvous that closes or drops the connection."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import pytest
from websockets.asyncio.server import ServerConnection, serve

from kafila.net.signaling import DROPPED, SignalingClient, closed_reason


@pytest.mark.parametrize(
    ("code", "reason", "said"),
    [
        (1012, "", "the rendezvous shut down or is restarting (WebSocket close 1012)"),
        (1001, "", "the rendezvous is going away (shutting down) (WebSocket close 1001)"),
        (
            1008,
            "too many joins",
            "the rendezvous closed the connection over a policy violation"
            " (WebSocket close 1008: too many joins)",
        ),
        (4000, "", "the rendezvous closed the connection (WebSocket close 4000)"),
        (
            None,
            "",
            DROPPED,
        ),
        (
            1006,
            "",
            DROPPED,
        ),
    ],
)
def test_closed_reason_names_what_the_close_says(code: int | None, reason: str, said: str) -> None:
    assert closed_reason(code, reason) == said


async def lost_reason(handler: Callable[[ServerConnection], Awaitable[None]]) -> str:
    async with serve(handler, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        client = await SignalingClient.connect(f"ws://127.0.0.1:{port}/v1/signal")
        try:
            return (await client.lost()).message
        finally:
            await client.close()


async def test_a_rendezvous_that_closes_is_named_with_its_code() -> None:
    async def closes(ws: ServerConnection) -> None:
        await ws.close(1012)

    assert await lost_reason(closes) == "the rendezvous shut down or is restarting (WebSocket close 1012)"


async def test_a_rendezvous_that_drops_the_connection_is_said_to_have_gone() -> None:
    async def drops(ws: ServerConnection) -> None:
        ws.transport.abort()  # as a killed process or a cut network: no close frame

    assert await lost_reason(drops) == DROPPED
