"""What the rendezvous's TCP side says: URLs with IPv6 hosts in brackets, plain HTTP on the
signaling path answered 426 with how to connect instead of a bare 404, and its root what it is."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator

import httpx
import pytest

from kafila.net.signaling import SignalingClient
from kafila.rendezvous.server import RendezvousServer, ServerConfig
from tests.rendezvous.conftest import Factory

pytestmark = pytest.mark.network


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as sock:
            sock.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback (::1) here")


@pytest.fixture
async def ipv6_server() -> AsyncIterator[RendezvousServer]:
    server = RendezvousServer(ServerConfig(host="::1", port=0, udp_port=0, udp_alt_port=0))
    await server.start()
    yield server
    await server.stop()


@needs_ipv6
async def test_an_ipv6_host_is_bracketed_in_the_url_and_the_url_works(ipv6_server: RendezvousServer) -> None:
    assert ipv6_server.url == f"ws://[::1]:{ipv6_server.http_port}/v1/signal"
    async with await SignalingClient.connect(ipv6_server.url) as client:
        opened = await client.open_session("m", 2, "v6-host", {})
    assert opened.member == 1


@needs_ipv6
async def test_a_port_in_use_on_ipv6_is_named_in_brackets() -> None:
    with socket.socket(socket.AF_INET6, socket.SOCK_DGRAM) as holder:
        holder.bind(("::1", 0))
        busy = holder.getsockname()[1]
        server = RendezvousServer(ServerConfig(host="::1", port=0, udp_port=busy, udp_alt_port=0))
        with pytest.raises(OSError) as info:
            await server.start()
    assert info.value.strerror == f"cannot listen on UDP [::1]:{busy}: Address already in use"


async def test_plain_http_on_the_signaling_path_says_to_use_a_websocket(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    http_url = server.url.replace("ws://", "http://")
    async with httpx.AsyncClient() as http:
        reply = await http.get(http_url + "?probe=1")
        other = await http.get(http_url.replace("/v1/signal", "/v1/nothing"))
    assert reply.status_code == 426 and reply.headers["upgrade"] == "websocket"
    body = reply.json()
    assert body["error"] == "upgrade_required"
    assert f"connect to {server.url} with a WebSocket client" in body["message"]
    assert other.status_code == 404
    async with await SignalingClient.connect(server.url) as client:  # the WebSocket route is unchanged
        assert await client.heartbeat() < 2.0


async def test_the_root_says_what_this_is_and_how_members_name_it(start_rendezvous: Factory) -> None:
    # a browser or curl at http://HOST:PORT/ found a bare 404
    from kafila import __version__

    server = await start_rendezvous()
    base = server.url.removesuffix("/v1/signal").replace("ws://", "http://")
    async with httpx.AsyncClient() as http:
        reply = await http.get(base + "/?x=1")
    assert reply.status_code == 200
    netloc = base.removeprefix("http://")
    assert reply.json() == {
        "service": "kafila rendezvous",
        "version": __version__,
        "signaling": server.url,
        "members": f"kafila host/join --rendezvous {netloc}",
        "endpoints": ["/healthz", "/metrics", "/v1/signal"],
    }
    async with await SignalingClient.connect(reply.json()["signaling"]) as client:  # the URL it names works
        assert await client.heartbeat() < 2.0
