"""A ring of three members on loopback: each member's one socket carries two links (one of them
relayed), and a message travels all the way round."""

from __future__ import annotations

import asyncio
import socket

import pytest

from kafila.net.edge import EdgeOptions, connect_edge
from kafila.net.link import PathKind
from tests.net.harness import open_pair, open_session, start_rendezvous

pytestmark = pytest.mark.network


async def test_three_member_ring_with_a_relayed_edge_passes_a_message_round() -> None:
    rdv = await start_rendezvous()
    session = await open_session(rdv, [_bound() for _ in range(3)], classify_nat=False)
    nodes = session.nodes
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
        await session.close()
        await rdv.stop()


async def test_connect_ring_links_every_member_to_its_neighbours() -> None:
    from kafila.net.edge import connect_ring

    rdv = await start_rendezvous()
    session = await open_session(rdv, [_bound() for _ in range(4)], classify_nat=False)
    nodes = session.nodes
    ring = [3, 1, 4, 2]
    try:
        per_member = await asyncio.gather(*(connect_ring(n, ring) for n in nodes))
        links = {n.member: m for n, m in zip(nodes, per_member, strict=True)}
        assert {m: sorted(v) for m, v in links.items()} == {1: [3, 4], 2: [3, 4], 3: [1, 2], 4: [1, 2]}
        await links[3][1].send(16, b"round")  # 3 -> 1 -> 4 -> 2 -> 3
        for here, there, nxt in ((1, 3, 4), (4, 1, 2), (2, 4, 3)):
            kind, payload = await links[here][there].recv(timeout=5)
            await links[here][nxt].send(kind, payload + f" {here}".encode())
        assert await links[3][2].recv(timeout=5) == (16, b"round 1 4 2")
        for per_peer in per_member:
            for link in per_peer.values():
                await link.close()
        with pytest.raises(ValueError, match="not in the ring"):
            await connect_ring(nodes[0], [2, 3])
    finally:
        await session.close()
        await rdv.stop()


async def test_two_member_ring_is_one_link_used_both_ways() -> None:
    from kafila.net.edge import connect_ring

    rdv = await start_rendezvous()
    pair = await open_pair(rdv, _bound(), _bound(), classify_nat=False)
    try:
        ring = [pair.b.member, pair.a.member]
        la, lb = await asyncio.gather(connect_ring(pair.a, ring), connect_ring(pair.b, ring))
        assert list(la) == [pair.b.member] and list(lb) == [pair.a.member]
        link_a, link_b = la[pair.b.member], lb[pair.a.member]
        assert link_b.is_client and not link_a.is_client  # ring[0] opens the connection
        await link_a.send(16, b"a->b")
        await link_b.send(16, b"b->a")
        assert await link_b.recv(timeout=5) == (16, b"a->b")
        assert await link_a.recv(timeout=5) == (16, b"b->a")
        await link_a.close()
    finally:
        await pair.close()
        await rdv.stop()


async def test_a_failed_edge_closes_the_links_that_formed_and_their_peers_hear_it_at_once() -> None:
    """m1 links with m2 (fine) and m3, which never answers (simulated: m3 does not take part), in
    one call. The edge to m3 fails, so m1 closes its link with m2: m2 learns at once that the link
    closed, well inside the link's idle timeout (30 s), not when that runs out."""
    import time

    from kafila.net.edge import link_edges
    from kafila.net.errors import LinkClosed, LinkError

    rdv = await start_rendezvous()
    session = await open_session(rdv, [_bound() for _ in range(3)], classify_nat=False)
    m1, m2, m3 = session.nodes
    try:
        silent = EdgeOptions(signal_timeout=1.0, use_relay=False)
        edges = {m2.member: (True, EdgeOptions()), m3.member: (True, silent)}
        named = {m2.member: "m2", m3.member: "m3"}
        peer_side = asyncio.ensure_future(connect_edge(m2, m1.member, False))
        with pytest.raises(LinkError, match="link m1 <-> m3"):
            await link_edges(m1, edges, label=lambda peer: f"link m1 <-> {named[peer]}")
        failed_at = time.monotonic()
        link = await peer_side
        with pytest.raises(LinkClosed, match="another link of member"):
            await link.recv(timeout=10)
        assert time.monotonic() - failed_at < 3.0, "m2 learned of it by a timeout"
        assert link.closed and m1.links[m2.member].closed
    finally:
        await session.close()
        await rdv.stop()


def _bound() -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    return sock
