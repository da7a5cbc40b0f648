"""Helpers for loopback link tests: two endpoints on 127.0.0.1, a linked pair, and a real rendezvous
on loopback (`rdv`, also used by tests/session)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from kafila.net.auth import EdgeContext
from kafila.net.certs import make_identity
from kafila.net.endpoint import UdpEndpoint
from kafila.net.link import Link, LinkConfig
from kafila.rendezvous.server import RendezvousServer
from tests.net.harness import start_rendezvous


async def direct_pair(
    client_ctx: EdgeContext, server_ctx: EdgeContext, config: LinkConfig | None = None
) -> tuple[Link, Link, UdpEndpoint, UdpEndpoint]:
    a = await UdpEndpoint.open(local=("127.0.0.1", 0))
    b = await UdpEndpoint.open(local=("127.0.0.1", 0))
    client = Link(a, client_ctx, make_identity(), True, config)
    server = Link(b, server_ctx, make_identity(), False, config)
    server.add_direct(a.local_address)
    client.add_direct(b.local_address)
    server.start()
    client.start()
    return client, server, a, b


@pytest.fixture
async def linked() -> AsyncIterator[tuple[Link, Link]]:
    ctx = EdgeContext("S-loop", "alice", "bob", b"correct horse")
    client, server, a, b = await direct_pair(ctx, ctx)
    await client.wait_ready()
    await server.wait_ready()
    yield client, server
    await client.close()
    await server.close()
    a.close()
    b.close()


@pytest.fixture
async def rdv() -> AsyncIterator[RendezvousServer]:
    """A real rendezvous on loopback (signaling, UDP probes, relay), stopped after the test."""
    server = await start_rendezvous()
    yield server
    await server.stop()
