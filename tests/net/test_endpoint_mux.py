"""One socket, many kinds of datagram: junk is counted and dropped, links and probes carry on."""

from __future__ import annotations

import socket

import pytest

from kafila.net.endpoint import UdpEndpoint
from kafila.proto import udp

pytestmark = pytest.mark.network


async def test_junk_on_the_shared_socket_is_dropped_and_the_link_keeps_working(linked) -> None:
    client, server = linked
    target = server.endpoint.local_address
    junk = [
        b"",  # empty
        b"\x90garbage",  # 0x80-0xBF: neither QUIC v1 nor ours
        b"\x3f\x01reserved",  # reserved control range
        b"\x01\x07" + bytes(13),  # binding request of an unknown version
        b"\x13\x01\x00\x00\x00\x09quic?",  # relay data for a channel nobody owns
        b"\xc0" + bytes(40),  # a QUIC-looking packet from an unknown source
    ]
    before = server.endpoint.counters.dropped
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as stranger:
        for data in junk:
            stranger.sendto(data, target)
        stranger.sendto(udp.encode(udp.PunchProbe(bytes(12), b"forged")), target)  # no puncher: dropped
        await client.send(16, b"after the junk")
        assert await server.recv(timeout=5) == (16, b"after the junk")
    assert server.endpoint.counters.dropped - before >= len(junk) - 1  # the empty one may not arrive


async def test_path_probes_are_answered_for_peers_only(linked) -> None:
    client, server = linked
    target = server.endpoint.local_address
    assert client.endpoint.dont_fragment  # Linux: IP_PMTUDISC_PROBE on every member socket
    assert await client.endpoint.path_carries(target, 1452, timeout=1.0)
    stranger = await UdpEndpoint.open(local=("127.0.0.1", 0))
    try:
        before = server.endpoint.counters.dropped
        assert not await stranger.path_carries(target, 1452, timeout=0.2)  # no answer to strangers
        assert server.endpoint.counters.dropped - before == 2  # both tries counted and dropped
    finally:
        stranger.close()
