"""A rendezvous that rewrites signaling to swap who is who cannot get a link formed: it fails closed.

The rendezvous is the real one; a hook on its registry's signal forwarding plays the attacker.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from kafila.net.edge import EdgeOptions, LinkNode, SignalRouter, connect_edge
from kafila.net.endpoint import UdpEndpoint
from kafila.net.errors import LinkAuthError
from kafila.net.signaling import SignalingClient
from kafila.proto import signaling as sig
from kafila.proto.codes import new_code
from kafila.rendezvous.registry import Send
from kafila.rendezvous.server import RendezvousServer
from tests.net.harness import start_rendezvous

pytestmark = pytest.mark.network


def make_malicious(rdv: RendezvousServer) -> None:
    """Turn a real rendezvous against members 1 (alice), 2 (bob), 3 (carol): alice's offer to bob
    goes to carol relabelled, carol's answer reaches alice as if from bob, and alice's relay
    channel "to bob" has carol's leg at the other end."""
    assert rdv.registry is not None
    registry = rdv.registry
    honest_signal, honest_relay = registry._signal, registry._relay

    def swap(state, to, payload):  # type: ignore[no-untyped-def]
        _, member = registry._member(state)
        if member.id == 1 and to == 2:
            return honest_signal(state, 3, {**payload, "edge": "1>3"})
        events = honest_signal(state, to, payload)
        if member.id == 3 and to == 1:
            return [Send(e.conn, sig.SignalFrom(2, {**payload, "edge": "1>2"})) for e in events]
        return events

    def splice(state, peer, ref, now):  # type: ignore[no-untyped-def]
        _, member = registry._member(state)
        return honest_relay(state, 3 if (member.id, peer) == (1, 2) else peer, ref, now)

    registry._signal = swap  # type: ignore[method-assign]
    registry._relay = splice  # type: ignore[method-assign]


async def test_identity_swapping_rendezvous_makes_both_ends_fail_closed() -> None:
    rdv = await start_rendezvous()
    make_malicious(rdv)
    clients = [await SignalingClient.connect(rdv.url) for _ in range(3)]
    opened = await clients[0].open_session("tiny", 3, "alice", {})
    code = new_code(opened.session)
    await clients[0].protect(code)
    for client, name in zip(clients[1:], ("bob", "carol"), strict=True):
        await client.join(code, name, {})
    nodes = []
    for client in clients:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.bind(("127.0.0.1", 0))
        assert client.member is not None
        node = LinkNode(
            await UdpEndpoint.open(sock),
            SignalRouter(client),
            code.public,
            client.member,
            code.secret_material(),
            ("127.0.0.1", rdv.udp.port),
        )
        nodes.append(node)
    pumps = [asyncio.create_task(n.signals.pump()) for n in nodes]
    opts = EdgeOptions(punch_timeout=1.0, signal_timeout=5)
    try:
        alice, _, carol = nodes
        results = await asyncio.gather(
            connect_edge(alice, 2, True, opts),  # alice believes she links bob
            connect_edge(carol, 1, False, opts),  # carol is honestly answering alice
            return_exceptions=True,
        )
        # Punch probes already fail (each side keys them with the edge it believes in); the
        # spliced relay carries QUIC between alice and carol, and the SPAKE2 binding refuses it.
        assert all(isinstance(r, LinkAuthError) for r in results), results
        channel = next(iter(rdv.relay.channels.values()))
        assert channel.bytes > 0  # the attacker's relay did carry their QUIC handshake
    finally:
        for pump in pumps:
            pump.cancel()
        for client in clients:
            await client.close()
        for node in nodes:
            node.endpoint.close()
        await rdv.stop()
