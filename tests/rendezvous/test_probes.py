"""UDP probe endpoints from a loopback client: binding answers, replies from the other port/address."""

from __future__ import annotations

import asyncio
import os
import socket

import pytest

from kafila.proto import udp
from kafila.proto.udp import ErrorCode
from tests.rendezvous.conftest import Factory

pytestmark = pytest.mark.network


async def ask(
    sock: socket.socket, dest: tuple[str, int], flags: int = 0
) -> tuple[udp.UdpMessage, tuple[str, int]]:
    loop = asyncio.get_running_loop()
    txid = os.urandom(12)
    await loop.sock_sendto(sock, udp.encode(udp.BindingRequest(txid, flags)), dest)
    data, src = await asyncio.wait_for(loop.sock_recvfrom(sock, 2048), 2.0)
    msg = udp.decode(data)
    assert msg.txid == txid  # type: ignore[union-attr]
    return msg, src


def client_socket() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.setblocking(False)
    return sock


async def test_binding_answers_from_every_endpoint_combination(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    a, p = "127.0.0.1", server.udp.port
    a2, p2 = "127.0.0.2", server.udp.alt_port
    with client_socket() as sock:
        me = sock.getsockname()
        cases = {
            0: (a, p),
            udp.FLAG_CHANGE_PORT: (a, p2),
            udp.FLAG_CHANGE_ADDRESS: (a2, p),
            udp.FLAG_CHANGE_PORT | udp.FLAG_CHANGE_ADDRESS: (a2, p2),
        }
        for flags, expected_source in cases.items():
            msg, src = await ask(sock, (a, p), flags)
            assert isinstance(msg, udp.BindingResponse)
            assert msg.observed == me and msg.flags == flags
            assert src == expected_source == msg.answered_from
            assert msg.other == (a2, p2)
        # a request to the alternate address's alternate port: "other" is the primary endpoint
        msg, src = await ask(sock, (a2, p2))
        assert src == (a2, p2) and msg.other == (a, p)  # type: ignore[union-attr]
    assert server.udp.stats["binding"] == 5


async def test_one_address_rendezvous_refuses_change_address(start_rendezvous: Factory) -> None:
    server = await start_rendezvous(alt_host=None)
    dest = ("127.0.0.1", server.udp.port)
    with client_socket() as sock:
        msg, _ = await ask(sock, dest, udp.FLAG_CHANGE_ADDRESS)
        assert isinstance(msg, udp.BindingError) and msg.code is ErrorCode.UNSUPPORTED
        assert "one address" in msg.reason
        msg, src = await ask(sock, dest, udp.FLAG_CHANGE_PORT)
        assert src == ("127.0.0.1", server.udp.alt_port)
        assert msg.other == ("127.0.0.1", server.udp.alt_port)  # type: ignore[union-attr]


async def test_malformed_and_foreign_datagrams_are_dropped_and_counted(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    dest = ("127.0.0.1", server.udp.port)
    loop = asyncio.get_running_loop()
    with client_socket() as sock:
        for junk in (b"\x01\x01short", b"\xc3quic-looking", b"\x20\x01" + b"\x00" * 14, b"\x05\x01", b"\x90"):
            await loop.sock_sendto(sock, junk, dest)
        msg, _ = await ask(sock, dest)  # still answering, and nothing else came back first
        assert isinstance(msg, udp.BindingResponse)
    stats = server.udp.stats
    assert stats["malformed"] == 2 and stats["quic"] == 1 and stats["punch"] == 1 and stats["unknown"] == 1
