"""A ring of three members on loopback: each member's one socket carries two links (one of them
relayed), and a message travels all the way round."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kafila.net.edge import EdgeOptions, LinkNode, SignalRouter, connect_edge
from kafila.net.endpoint import UdpEndpoint
from kafila.net.link import PathKind
from kafila.net.signaling import SignalingClient
from kafila.proto.codes import new_code
from tests.net.harness import start_rendezvous

pytestmark = pytest.mark.network


async def test_three_member_ring_with_a_relayed_edge_passes_a_message_round() -> None:
    rdv = await start_rendezvous()
    clients = [await SignalingClient.connect(rdv.url) for _ in range(3)]
    opened = await clients[0].open_session("tiny", 3, "m1", {})
    code = new_code(opened.session)
    for i, client in enumerate(clients[1:], start=2):
        await client.join(code.public, f"m{i}", {})
    nodes = []
    for client in clients:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        nodes.append(
            await LinkNode.joined(await UdpEndpoint.open(sock), SignalRouter(client), code, "127.0.0.1")
        )
    pumps = [asyncio.create_task(n.signals.pump()) for n in nodes]
    direct, relayed = EdgeOptions(), EdgeOptions(use_direct=False)
    m1, m2, m3 = nodes
    try:
        # edges 1>2 and 2>3 direct, 3>1 relayed: every member holds two links on its one socket
        l12, l21, l23, l32, l31, l13 = await asyncio.gather(
            connect_edge(m1, 2, True, direct),
            connect_edge(m2, 1, False, direct),
            connect_edge(m2, 3, True, direct),
            connect_edge(m3, 2, False, direct),
            connect_edge(m3, 1, True, relayed),
            connect_edge(m1, 3, False, relayed),
        )
        assert [link.path for link in (l12, l21, l23, l32)] == [PathKind.DIRECT] * 4
        assert l31.path is PathKind.RELAY and l13.path is PathKind.RELAY
        await l12.send(16, b"token 0")  # m1 -> m2 -> m3 -> m1
        await l23.send(16, (await l21.recv(timeout=5))[1] + b" via 2")
        await l31.send(16, (await l32.recv(timeout=5))[1] + b" via 3")
        assert await l13.recv(timeout=5) == (16, b"token 0 via 2 via 3")
        for link in (l12, l21, l23, l32, l31, l13):
            await link.close()
    finally:
        for pump in pumps:
            pump.cancel()
        for client in clients:
            await client.close()
        for node in nodes:
            node.endpoint.close()
        await rdv.stop()
