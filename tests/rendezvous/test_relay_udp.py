"""The relay over real UDP sockets: two legs allocated through signaling, forwarding, rejections, expiry."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kafila.net.signaling import SignalingClient
from kafila.proto import udp
from kafila.proto.signaling import RelayAllocated
from kafila.proto.udp import ErrorCode
from kafila.rendezvous.server import RendezvousServer
from tests.rendezvous.conftest import Factory, open_protected

pytestmark = pytest.mark.network


def udp_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def send(sock: socket.socket, data: bytes, dest: tuple[str, int]) -> None:
    await asyncio.get_running_loop().sock_sendto(sock, data, dest)


async def recv(sock: socket.socket, timeout: float = 2.0) -> bytes:
    data, _ = await asyncio.wait_for(asyncio.get_running_loop().sock_recvfrom(sock, 65536), timeout)
    return data


async def nothing_arrives(sock: socket.socket, wait: float = 0.3) -> bool:
    try:
        await recv(sock, wait)
    except TimeoutError:
        return True
    return False


async def two_members(server: RendezvousServer) -> tuple[SignalingClient, SignalingClient, int, bytes, bytes]:
    host = await SignalingClient.connect(server.url)
    _opened, code = await open_protected(host, "m", 2, "a", {})
    guest = await SignalingClient.connect(server.url)
    await guest.join(code, "b", {})
    await host.next_event(2.0)  # member_joined
    mine = await guest.request_relay(1)
    theirs = await host.next_event(2.0)
    assert isinstance(theirs, RelayAllocated) and theirs.channel == mine.channel
    return host, guest, mine.channel, bytes.fromhex(theirs.token), bytes.fromhex(mine.token)


async def bind(sock: socket.socket, dest: tuple[str, int], channel: int, token: bytes) -> udp.UdpMessage:
    await send(sock, udp.encode(udp.RelayBind(channel, token)), dest)
    return udp.decode(await recv(sock))


async def test_forwarding_between_two_bound_legs(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    relay_addr = ("127.0.0.1", server.udp.port)
    host, guest, channel, token_a, token_b = await two_members(server)
    with udp_socket() as a, udp_socket() as b:
        ack = await bind(a, relay_addr, channel, token_a)
        assert ack == udp.RelayBindAck(channel, False, a.getsockname())
        ack = await bind(b, relay_addr, channel, token_b)
        assert ack == udp.RelayBindAck(channel, True, b.getsockname())
        quic = bytes([0xC3]) + bytes(range(256)) * 4  # looks like a QUIC long-header packet
        await send(a, udp.encode(udp.RelayData(channel, quic)), relay_addr)
        assert udp.decode(await recv(b)) == udp.RelayData(channel, quic)  # same header, unchanged bytes
        await send(b, udp.encode(udp.RelayData(channel, b"\x41reply")), relay_addr)
        assert udp.decode(await recv(a)) == udp.RelayData(channel, b"\x41reply")
    stats = server.relay.channels[channel]
    assert (stats.packets, stats.bytes) == (2, 2 * udp.RELAY_HEADER_BYTES + len(quic) + 6)
    await guest.close()
    await host.close()


async def test_third_party_and_bad_token_are_rejected(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    relay_addr = ("127.0.0.1", server.udp.port)
    host, guest, channel, token_a, token_b = await two_members(server)
    with udp_socket() as a, udp_socket() as b, udp_socket() as eve:
        await bind(a, relay_addr, channel, token_a)
        await bind(b, relay_addr, channel, token_b)
        err = await bind(eve, relay_addr, channel, bytes(16))
        assert isinstance(err, udp.RelayBindError) and err.code is ErrorCode.BAD_TOKEN
        err = await bind(eve, relay_addr, channel + 1 if channel < udp.MAX_CHANNEL else 1, token_a)
        assert isinstance(err, udp.RelayBindError) and err.code is ErrorCode.UNKNOWN_CHANNEL
        await send(eve, udp.encode(udp.RelayData(channel, b"\xc3injected")), relay_addr)
        assert await nothing_arrives(a) and await nothing_arrives(b)
        await send(a, udp.encode(udp.RelayData(channel, b"\xc3ok")), relay_addr)
        assert udp.decode(await recv(b)) == udp.RelayData(channel, b"\xc3ok")  # legs unaffected
    assert server.relay.channels[channel].dropped == 1
    await guest.close()
    await host.close()


async def test_idle_channel_expires(start_rendezvous: Factory) -> None:
    server = await start_rendezvous(relay_idle_s=1.0)
    relay_addr = ("127.0.0.1", server.udp.port)
    host, guest, channel, token_a, token_b = await two_members(server)
    with udp_socket() as a, udp_socket() as b:
        await bind(a, relay_addr, channel, token_a)
        await bind(b, relay_addr, channel, token_b)
        await asyncio.sleep(1.5)
        assert channel not in server.relay.channels
        await send(a, udp.encode(udp.RelayData(channel, b"\xc3late")), relay_addr)
        assert await nothing_arrives(b)
        err = await bind(a, relay_addr, channel, token_a)
        assert isinstance(err, udp.RelayBindError) and err.code is ErrorCode.UNKNOWN_CHANNEL
    await guest.close()
    await host.close()


async def test_member_leaving_releases_its_channels(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    host, guest, channel, _, _ = await two_members(server)
    assert channel in server.relay.channels
    await guest.close()
    await asyncio.sleep(0.2)
    assert server.relay.channels == {}
    await host.close()
