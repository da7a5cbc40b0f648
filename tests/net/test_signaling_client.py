"""The signaling client says why its connection to the rendezvous failed or ended, in words a
person reads: from the error connecting, the WebSocket close the rendezvous sent, or its absence.
Real WebSocket servers on loopback play a rendezvous that closes or drops the connection, and a
web server that is not a rendezvous."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from http import HTTPStatus

import pytest
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import InvalidStatus
from websockets.http11 import Request, Response

from kafila.net.signaling import DROPPED, SignalingClient, closed_reason, unreachable_reason
from kafila.rendezvous.server import RendezvousServer
from tests.net.harness import start_rendezvous


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


async def test_connecting_to_an_http_server_that_is_not_a_rendezvous_names_its_status() -> None:
    async def not_found(connection: ServerConnection, request: Request) -> Response:
        return connection.respond(HTTPStatus.NOT_FOUND, "no such page\n")

    async with serve(lambda ws: ws.close(), "127.0.0.1", 0, process_request=not_found) as server:
        port = server.sockets[0].getsockname()[1]
        with pytest.raises(InvalidStatus) as err:
            await SignalingClient.connect(f"ws://127.0.0.1:{port}/v1/signal")
    assert unreachable_reason(err.value) == (
        "it answered HTTP 404 where a rendezvous takes the WebSocket (another server, or a proxy?)"
    )


@pytest.mark.parametrize(
    ("exc", "said"),
    [
        (
            ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 1)"),
            "connection refused: nothing listens on that port",
        ),
        (
            socket.gaierror(-2, "Name or service not known"),
            "its host name could not be looked up (Name or service not known)",
        ),
        (TimeoutError(), "no answer within 10 s (a firewall, or the wrong address?)"),
        (OSError(113, "No route to host"), "No route to host"),
    ],
)
def test_unreachable_reason_names_the_cause(exc: BaseException, said: str) -> None:
    assert unreachable_reason(exc) == said


async def test_a_join_needs_the_whole_code_and_a_wrong_secret_is_refused_by_the_rendezvous() -> None:
    """The rendezvous checks the proof of the secret words before the joiner takes a place (with
    the default limits: the lab's `rdv` backs off only 10 ms, shorter than a join takes)."""
    from kafila.rendezvous.limits import Limits

    rdv = await start_rendezvous(limits=Limits())
    try:
        await _join_checks(rdv)
    finally:
        await rdv.stop()


async def _join_checks(rdv: RendezvousServer) -> None:
    from kafila.net.signaling import SignalingError
    from kafila.proto.codes import SessionCode, new_code

    host = await SignalingClient.connect(rdv.url)
    opened = await host.open_session("m", 2, "h", {})
    code = new_code(opened.session)
    await host.protect(code)
    member = await SignalingClient.connect(rdv.url)
    with pytest.raises(SignalingError, match="it needs the whole code, not only its public part"):
        await member.join(code.public, "j", {})
    others = [w for w in ("tiger-lamp-ocean", "wolf-yacht-zebra") if w != code.secret]
    with pytest.raises(SignalingError, match="secret words differ") as wrong:
        await member.join(SessionCode(code.public, others[0]), "j", {})
    assert wrong.value.code == "wrong_secret"
    with pytest.raises(SignalingError, match=r"retry in 2 s") as held:  # a mistyped code backs off
        await member.join(code, "j", {})
    assert held.value.code == "rate_limited"
    await asyncio.sleep(2.1)
    joined = await member.join(str(code), "j", {})  # the whole code as typed also reads
    assert [m.name for m in joined.members] == ["h", "j"]
    await member.close()
    await host.close()


async def test_an_older_rendezvous_says_in_its_own_version_why_it_cannot_serve_this_member() -> None:
    """A version 1 rendezvous answers a version 2 frame with a v1 error: it reads, by its ref."""
    import json

    from kafila.net.signaling import SignalingError

    async def old_rendezvous(ws: ServerConnection) -> None:
        async for frame in ws:
            ref = json.loads(frame).get("ref")
            message = f"protocol version {json.loads(frame)['v']} not supported (this side speaks 1)"
            error = {"v": 1, "type": "error", "code": "unsupported_version", "message": message, "ref": ref}
            await ws.send(json.dumps(error))

    async with serve(old_rendezvous, "127.0.0.1", 0) as server:
        port = server.sockets[0].getsockname()[1]
        client = await SignalingClient.connect(f"ws://127.0.0.1:{port}/v1/signal")
        with pytest.raises(SignalingError, match="protocol version 2 not supported") as info:
            await client.open_session("m", 2, "h", {}, timeout=5)
        assert info.value.code == "unsupported_version"
        await client.close()
