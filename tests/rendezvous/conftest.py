"""A real rendezvous on loopback (127.0.0.1, with 127.0.0.2 as its second address), per test."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
from websockets.asyncio.client import ClientConnection

from kafila.net.signaling import SignalingClient
from kafila.proto import signaling as sig
from kafila.proto.codes import SessionCode, join_key, join_proof, new_code
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


async def open_protected(client: SignalingClient, *args: Any, **kw: Any) -> tuple[sig.Opened, SessionCode]:
    """Open a session as a host does: the code drawn on the public part, its verifier registered."""
    opened = await client.open_session(*args, **kw)
    code = new_code(opened.session)
    await client.protect(code)
    return opened, code


async def raw_join(ws: ClientConnection, code: SessionCode, name: str) -> sig.ServerMessage:
    """A join written frame by frame (challenge, proof) on a bare WebSocket; the rendezvous's answer."""
    await ws.send(sig.encode(sig.JoinChallenge(code.public)))
    challenge = sig.decode_server(await ws.recv())
    assert isinstance(challenge, sig.Challenge), challenge
    key = join_key(code, bytes.fromhex(challenge.salt))
    proof = join_proof(key, code.public, bytes.fromhex(challenge.nonce))
    await ws.send(sig.encode(sig.Join(code.public, proof.hex(), name, {})))
    return sig.decode_server(await ws.recv())
