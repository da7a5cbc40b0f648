"""Links through real Linux NATs (network namespaces + netfilter; root): classification, every
class pair, prediction against outcome, a relay that sees no plaintext, fallback to the relay."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import replace

import pytest

from kafila.net.classify import classify
from kafila.net.edge import EdgeOptions, connect_edge, connect_ring
from kafila.net.endpoint import UdpEndpoint
from kafila.net.errors import LinkAuthError, LinkError
from kafila.net.link import Link, LinkConfig, PathKind
from kafila.planner.devices import DeviceReport
from kafila.planner.order import order_ring
from kafila.planner.reachability import DEFAULT_RULE, Behaviour
from kafila.proto import tensor
from kafila.rendezvous.server import RendezvousServer
from kafila.session.ring.build import follow_paths
from tests.natlab.lab import EXPECTED_CLASS, KINDS, OPEN_KIND, RDV_ADDRS, Lab, Site, netns, sh
from tests.net.harness import LAB_LIMITS, Pair, open_pair, open_session, start_rendezvous
from tests.net.test_link_loopback import packet_size
from tests.net.test_malicious_rendezvous import make_malicious

pytestmark = [pytest.mark.root, pytest.mark.slow]
EI, AD = Behaviour.ENDPOINT_INDEPENDENT, Behaviour.ADDRESS_DEPENDENT
APD = Behaviour.ADDRESS_AND_PORT_DEPENDENT
EXPECTED_BEHAVIOUR = {
    "permissive": (EI, EI),
    "ordinary": (EI, APD),
    "ordinary-address": (EI, AD),
    "restrictive": (APD, APD),
    OPEN_KIND: (EI, APD),
}
PROBE_TIMEOUT = 0.1  # lab round trips are well under a millisecond


@pytest.fixture(scope="module")
def sites(natlab: Lab) -> dict[str, list[Site]]:
    """Two member sites behind each router kind (a pair of one kind needs two routers)."""
    return {kind: [natlab.add_site(kind), natlab.add_site(kind)] for kind in (*KINDS, OPEN_KIND)}


@pytest.fixture
async def rdv(natlab: Lab) -> AsyncIterator[RendezvousServer]:
    with netns(natlab.rdv):
        server = await start_rendezvous(RDV_ADDRS[0], RDV_ADDRS[1])
    yield server
    await server.stop()


async def lab_pair(
    lab: Lab, rdv: RendezvousServer, a: Site, b: Site, config: LinkConfig | None = None
) -> Pair:
    return await open_pair(
        rdv,
        lab.udp_socket(a.host, a.lan),
        lab.udp_socket(b.host, b.lan),
        lambda: netns(a.host),
        lambda: netns(b.host),
        config=config,
        probe_timeout=PROBE_TIMEOUT,
    )


async def link_pair(pair: Pair, predicted_direct: bool = True, repunch: float = 10.0) -> tuple[Link, Link]:
    opts = EdgeOptions(predicted_direct=predicted_direct, repunch_interval=repunch)
    client, server = await asyncio.gather(
        connect_edge(pair.a, pair.b.member, True, opts), connect_edge(pair.b, pair.a.member, False, opts)
    )
    return client, server


@contextlib.asynccontextmanager
async def lab_links(
    lab: Lab,
    rdv: RendezvousServer,
    a: Site,
    b: Site,
    config: LinkConfig | None = None,
    predicted_direct: bool = True,
    repunch: float = 10.0,
) -> AsyncIterator[tuple[Link, Link]]:
    """A linked (client, server) between sites a and b; links and members closed afterwards."""
    pair = await lab_pair(lab, rdv, a, b, config)
    try:
        client, server = await link_pair(pair, predicted_direct, repunch)
        try:
            yield client, server
        finally:
            await client.close()
            await server.close()
    finally:
        await pair.close()


async def sized_and_carrying(client: Link, server: Link, size: int) -> None:
    """Both ends send packets of `size` bytes, and 300 KB messages cross both ways whole."""
    await packet_size(client, size)
    await packet_size(server, size)
    payload = os.urandom(300_000)
    await client.send(16, payload)
    assert await server.recv(timeout=10) == (16, payload)
    await server.send(17, payload)
    assert await client.recv(timeout=10) == (17, payload)


@pytest.mark.parametrize("kind", (*KINDS, OPEN_KIND))
async def test_classifier_names_each_router_kind(natlab: Lab, sites, rdv, kind: str) -> None:
    site = sites[kind][0]
    endpoint = await UdpEndpoint.open(natlab.udp_socket(site.host, site.lan))
    try:
        report = await classify(
            endpoint, (RDV_ADDRS[0], rdv.udp.port), rdv.udp.alt_port, RDV_ADDRS[1], timeout=PROBE_TIMEOUT
        )
    finally:
        endpoint.close()
    assert report.nat.cls.value == EXPECTED_CLASS[kind]
    assert (report.nat.mapping, report.nat.filtering) == EXPECTED_BEHAVIOUR[kind]
    assert report.nat.open_input is (kind == OPEN_KIND)  # its own stack took the unsolicited replies
    assert report.mapped[0] == site.wan  # seen from outside: the router's public address
    assert report.probes <= 3 + 2 * 3 + 2 * 3  # a constant number of probes, retries included
    assert 0 < report.rtt_median < 0.1


PAIRS = [(a, b) for a, b in itertools.product(KINDS, KINDS) if "ordinary-address" not in (a, b) or a != b]


@pytest.mark.parametrize(("client_kind", "server_kind"), PAIRS)
async def test_class_pair_links_moves_data_and_prediction_errs_only_toward_relay(
    natlab: Lab, sites, rdv, client_kind: str, server_kind: str
) -> None:
    a, b = sites[client_kind][0], sites[server_kind][1]
    pair = await lab_pair(natlab, rdv, a, b)
    assert pair.a.nat is not None and pair.b.nat is not None
    predicted = DEFAULT_RULE(pair.a.nat.nat, pair.b.nat.nat)
    start = time.perf_counter()
    client, server = await link_pair(pair, predicted)
    elapsed = time.perf_counter() - start
    try:
        frame = os.urandom(1 << 20)
        await client.send(16, frame)
        await server.send(17, b"back")
        assert await server.recv(timeout=20) == (16, frame)
        assert await client.recv(timeout=20) == (17, b"back")
        achieved_direct = client.path is PathKind.DIRECT
        if predicted:  # the prediction may only err toward the relay
            assert achieved_direct, f"{client_kind}->{server_kind} predicted direct, linked {client.path}"
        assert elapsed < (0.5 if achieved_direct and predicted else 2.0) * 4  # generous: shared CPUs
    finally:
        await client.close()
        await server.close()
        await pair.close()


def _mapped_ports_to(site: Site, peer: Site) -> set[int]:
    """The public ports `site`'s router gave its member's flows to `peer` (conntrack reply tuples)."""
    listing = sh(
        "ip", "netns", "exec", site.router, "conntrack", "-L", "-p", "udp", "-s", site.lan, "-d", peer.wan
    )
    return {int([f for f in line.split() if f.startswith("dport=")][1][6:]) for line in listing.splitlines()}


@pytest.mark.parametrize("other", (*KINDS, OPEN_KIND))
async def test_a_router_with_open_input_links_as_predicted(natlab: Lab, sites, rdv, other: str) -> None:
    """A port-restricted router whose own stack takes unsolicited input on its WAN address: the
    classifier's filtering replies made conntrack entries there, and the member's later flows leave
    from the port its last probe was moved to, not the one it published first. It publishes that
    port too and probes before its peer (kafila.net.edge), so it punches with every peer but
    another such router and a restrictive one; before, a port-restricted peer relayed 6 of 6."""
    a, b = sites[OPEN_KIND][0], sites[other][1]
    pair = await lab_pair(natlab, rdv, a, b)
    assert pair.a.nat is not None and pair.b.nat is not None and pair.a.nat.nat.open_input
    assert pair.a.nat.moved is not None and pair.a.nat.moved != pair.a.nat.mapped
    predicted = DEFAULT_RULE(pair.a.nat.nat, pair.b.nat.nat)
    client, server = await link_pair(pair, predicted_direct=True)  # always try the punch in full
    try:
        await client.send(16, b"across")
        assert await server.recv(timeout=10) == (16, b"across")
        assert (client.path is PathKind.DIRECT) == predicted == (other not in ("restrictive", OPEN_KIND))
        ports = _mapped_ports_to(a, b)
        assert pair.a.nat.mapped[1] not in ports  # the cause: its flows left from another port
        if predicted:
            assert pair.a.nat.moved[1] in ports  # the one it also published
    finally:
        await client.close()
        await server.close()
        await pair.close()


async def test_relayed_edge_shows_only_ciphertext_on_the_wire(natlab: Lab, sites, rdv) -> None:
    a, b = sites["restrictive"]
    capture = natlab.capture()
    async with lab_links(natlab, rdv, a, b, predicted_direct=False) as (client, server):
        marker = b"KAFILA-MARKER-" + os.urandom(6).hex().encode()
        try:
            assert client.path is PathKind.RELAY
            rows = 16 * 576 * 4  # hidden states of 16 tokens of SmolLM2, f32
            data = os.urandom(rows // 2) + marker + os.urandom(rows - rows // 2 - len(marker))
            frame = tensor.Hidden(7, tensor.DType.F32, (16, 576), (tensor.Entry(1, 0, 16),), data)
            record = tensor.encode(frame, 1)
            await client.send(32, record)
            kind, got = await server.recv(timeout=20)
            assert kind == 32 and tensor.decode(got) == frame
            frames = []
            while True:
                try:
                    frames.append(capture.recv(65535))
                except BlockingIOError:
                    break
            wire = b"".join(frames)
            assert wire.count(bytes(map(int, RDV_ADDRS[0].split(".")))) > 40  # relayed datagrams were seen
            assert len(wire) > 2 * len(record)  # to the relay and out again
            assert marker not in wire and marker[:12] not in wire
        finally:
            capture.close()


async def test_a_pair_that_cannot_punch_and_gets_no_relay_fails_in_one_error_instead_of_hanging(
    natlab: Lab, sites
) -> None:
    # restrictive <-> ordinary never punches; with a rendezvous that does not relay, connect_edge
    # hung (its re-punch loop never ends while the link is open) instead of raising.
    with netns(natlab.rdv):
        server = await start_rendezvous(RDV_ADDRS[0], RDV_ADDRS[1], replace(LAB_LIMITS, relay_channels=0))
    try:
        pair = await lab_pair(natlab, server, sites["restrictive"][0], sites["ordinary"][1])
        opts = EdgeOptions(punch_timeout=1.0, signal_timeout=3)
        try:
            results = await pair.both_ends(opts, within=20)
        finally:
            await pair.close()
        assert all(isinstance(r, LinkError) for r in results), results
        for r in results:
            assert "punching failed (no answer within 1 s) and no relay is available" in str(r)
    finally:
        await server.stop()


async def test_direct_path_that_stops_answering_falls_back_to_relay_without_loss_and_comes_back(
    natlab: Lab, sites, rdv
) -> None:
    a, b = sites["ordinary"]
    config = LinkConfig(keepalive=0.25, dead_after=1.0)
    async with lab_links(natlab, rdv, a, b, config, repunch=0.5) as (client, server):
        shown: dict[str, str] = {}
        follow_paths(shown, {"a->b": client})  # what a member's /session shows for its link
        try:
            assert client.path is PathKind.DIRECT and server.path is PathKind.DIRECT
            assert shown == {"a->b": "direct"}
            await packet_size(client, 1452)  # the lab's 1500-byte MTU: 16000 and 8952 refused locally
            count = 120

            async def produce() -> None:
                for i in range(count):
                    await client.send(16, i.to_bytes(4, "big") + os.urandom(4096))
                    if i == 30:
                        natlab.block_direct(a, b)  # both routers now drop the direct path
                    await asyncio.sleep(0.02)

            producer = asyncio.create_task(produce())
            got = [int.from_bytes((await server.recv(timeout=15))[1][:4], "big") for _ in range(count)]
            await producer
            assert got == list(range(count))  # nothing lost, nothing reordered
            assert client.path is PathKind.RELAY and server.path is PathKind.RELAY
            assert client.path_changes[-1].reason.startswith("direct path silent")
            # the relay path probed: 1452-byte datagrams, its header inside
            await packet_size(client, 1452 - 6)
            assert shown == {"a->b": "relay"}
            await server.send(18, b"still there")
            assert await client.recv(timeout=10) == (18, b"still there")
            natlab.unblock_all()  # the direct path answers again: both ends move back to it
            for _ in range(100):
                if client.path is PathKind.DIRECT and server.path is PathKind.DIRECT:
                    break
                await asyncio.sleep(0.05)
            assert client.path is PathKind.DIRECT and server.path is PathKind.DIRECT
            back = {link.path_changes[-1].reason for link in (client, server)}  # one punched, or both
            assert "punch succeeded again" in back
            assert back <= {"punch succeeded again", "the peer is back on the direct path"}
            await packet_size(client, 1452)  # probed again
            assert shown == {"a->b": "direct"}
            direct_before = client.stats().datagrams_direct
            await client.send(16, b"direct again")
            assert await server.recv(timeout=10) == (16, b"direct again")
            assert client.stats().datagrams_direct > direct_before
        finally:
            natlab.unblock_all()


async def test_a_path_through_a_smaller_mtu_carries_the_largest_size_that_fits(natlab: Lab, rdv) -> None:
    # One router's public link has a 1420-byte MTU (as a WireGuard tunnel): a 1452-byte probe
    # leaves the member whole and is dropped at that router (don't-fragment), 1392 gets through.
    a, b = natlab.add_site("permissive"), natlab.add_site("permissive")
    natlab.set_wan_mtu(a, 1420)
    async with lab_links(natlab, rdv, a, b) as (client, server):
        assert client.path is PathKind.DIRECT and server.path is PathKind.DIRECT
        await sized_and_carrying(client, server, 1392)


async def test_a_path_whose_mtu_shrinks_is_noticed_and_probed_again(natlab: Lab, rdv) -> None:
    # A route change after probing: the 1452-byte packets now die on the way, while PINGs and ACKs
    # (small) still get through, so the path looks alive. The keepalives' probes of the size in
    # use go unanswered; after three the link drops to 1200 and probes again: 1392.
    a, b = natlab.add_site("permissive"), natlab.add_site("permissive")
    config = LinkConfig(keepalive=0.25, probe_timeout=0.1)  # lab RTT < 1 ms
    async with lab_links(natlab, rdv, a, b, config) as (client, server):
        await packet_size(client, 1452)
        natlab.set_wan_mtu(a, 1420)
        await sized_and_carrying(client, server, 1392)
        assert client.path is PathKind.DIRECT  # found without leaving the direct path


async def test_a_path_whose_mtu_grows_gets_the_larger_packets_back_at_the_next_raise_probe(
    natlab: Lab, rdv
) -> None:
    # The 1420-byte tunnel is gone after probing: the link at 1392 probes the sizes above it every
    # `probe_raise` seconds and finds 1452 (RFC 8899's raise timer; default 600 s, 1 s here).
    a, b = natlab.add_site("permissive"), natlab.add_site("permissive")
    natlab.set_wan_mtu(a, 1420)
    config = LinkConfig(keepalive=0.25, probe_timeout=0.1, probe_raise=1.0)
    async with lab_links(natlab, rdv, a, b, config) as (client, server):
        await packet_size(client, 1392)
        await packet_size(server, 1392)
        natlab.set_wan_mtu(a, 1500)
        await sized_and_carrying(client, server, 1452)
        assert client.path is PathKind.DIRECT and not client.path_changes[1:]


async def test_a_relayed_link_whose_nat_mapping_changes_rebinds_its_relay_leg_and_lives(
    natlab: Lab, rdv
) -> None:
    # The restrictive router forgets its flows just after the link's periodic relay refresh: its
    # member's packets leave from a new random port, which the relay drops (not a bound leg) until
    # a RelayBind from it moves the leg. Re-binding only every relay_refresh (20 s) let peer_timeout
    # end the link first; a relay path silent for two keepalives now re-binds at once.
    if shutil.which("conntrack") is None:
        pytest.skip("needs `conntrack` (apt-get install conntrack)")
    a, b = natlab.add_site("restrictive"), natlab.add_site("ordinary")
    config = LinkConfig(keepalive=0.5, dead_after=1.5, peer_timeout=4.0)  # relay_refresh stays 20 s
    async with lab_links(natlab, rdv, a, b, config, predicted_direct=False, repunch=0) as (client, server):
        assert client.path is PathKind.RELAY and server.path is PathKind.RELAY
        await client.send(16, b"before")
        assert await server.recv(timeout=5) == (16, b"before")
        natlab.flush_conntrack(a)
        await asyncio.sleep(3 * config.peer_timeout)  # 12 s: well past peer_timeout, before a refresh
        assert not client.closed and not server.closed
        await client.send(16, b"after the mapping changed")
        assert await server.recv(timeout=5) == (16, b"after the mapping changed")
        await server.send(16, b"and back")
        assert await client.recv(timeout=5) == (16, b"and back")
        assert client.path is PathKind.RELAY and server.path is PathKind.RELAY


async def test_keepalives_hold_nat_mappings_past_the_conntrack_timeout(natlab: Lab, rdv) -> None:
    # Routers that forget a UDP flow after 2 s (3 s once replied) instead of Linux's 30 s / 120 s:
    # an idle link survives only if its keepalives refresh both mappings.
    a, b = natlab.add_site("ordinary"), natlab.add_site("ordinary")
    for site in (a, b):
        natlab.conntrack_udp_timeouts(site, unreplied=2, stream=3)
    config = LinkConfig(keepalive=0.5, dead_after=1.5)
    async with lab_links(natlab, rdv, a, b, config, repunch=0) as (client, server):
        assert client.path is PathKind.DIRECT and server.path is PathKind.DIRECT
        changes = len(client.path_changes), len(server.path_changes)
        await asyncio.sleep(7)  # idle: no message, only keepalives
        await client.send(16, b"after a long silence")
        assert await server.recv(timeout=5) == (16, b"after a long silence")
        await server.send(16, b"and back")
        assert await client.recv(timeout=5) == (16, b"and back")
        assert (len(client.path_changes), len(server.path_changes)) == changes  # never left direct
        assert client.path is PathKind.DIRECT and server.path is PathKind.DIRECT


async def test_a_planned_ring_across_every_nat_kind_forms_and_carries_a_token(
    natlab: Lab, sites, rdv
) -> None:
    # The paper's flow: classify each member once, order the ring from the classes alone (the
    # planner), then link only the ring's edges; each edge may only err toward the relay.
    members = [sites["permissive"][0], sites["ordinary"][0], sites["ordinary-address"][0]]
    members += [sites["restrictive"][0], sites["restrictive"][1]]
    session = await open_session(
        rdv,
        [natlab.udp_socket(s.host, s.lan) for s in members],
        [lambda s=s: netns(s.host) for s in members],
        probe_timeout=PROBE_TIMEOUT,
    )
    nodes = session.nodes
    nat = {n.member: n.nat.nat for n in nodes if n.nat is not None}
    devices = [DeviceReport(str(n.member), 1 << 30, nat=nat[n.member]) for n in nodes]
    order = order_ring(devices, DEFAULT_RULE)
    ring = [nodes[i].member for i in order.order]
    links: dict[int, dict[int, Link]] = {}
    try:
        per_member = await asyncio.gather(
            *(connect_ring(n, ring, {p: DEFAULT_RULE(nat[n.member], nat[p]) for p in nat}) for n in nodes)
        )
        links = {n.member: m for n, m in zip(nodes, per_member, strict=True)}
        relayed = 0
        for a, b in zip(ring, ring[1:] + ring[:1], strict=True):
            predicted = DEFAULT_RULE(nat[a], nat[b])
            achieved = links[a][b].path
            assert achieved is PathKind.DIRECT or not predicted, f"edge {a}>{b} predicted direct, {achieved}"
            relayed += achieved is PathKind.RELAY
        # restrictive members have two helpers (permissive, address-restricted): the port-restricted
        # member must sit next to one of them, so one edge relays; the lab's NATs match the rule
        assert order.relayed == relayed == 1
        await links[ring[0]][ring[1]].send(16, b"token")
        for i, here in enumerate(ring[1:], start=1):
            kind, payload = await links[here][ring[i - 1]].recv(timeout=10)
            await links[here][ring[(i + 1) % len(ring)]].send(kind, payload + b".")
        assert await links[ring[0]][ring[-1]].recv(timeout=10) == (16, b"token" + b"." * (len(ring) - 1))
    finally:
        for per_peer in links.values():
            for link in per_peer.values():
                await link.close()
        await session.close()


async def test_identity_swapping_rendezvous_across_nats_fails_closed(natlab: Lab, sites, rdv) -> None:
    make_malicious(rdv)  # alice's edge to bob is steered to carol, signaling and relay alike
    alice, bob, carol = sites["ordinary"][0], sites["permissive"][0], sites["restrictive"][0]
    session = await open_session(
        rdv,
        [natlab.udp_socket(s.host, s.lan) for s in (alice, bob, carol)],
        [lambda s=s: netns(s.host) for s in (alice, bob, carol)],
        probe_timeout=PROBE_TIMEOUT,
    )
    a, _, c = session.nodes
    opts = EdgeOptions(punch_timeout=1.0, signal_timeout=5)
    try:
        results = await asyncio.gather(
            connect_edge(a, 2, True, opts), connect_edge(c, 1, False, opts), return_exceptions=True
        )
        assert all(isinstance(r, LinkAuthError) for r in results), results
    finally:
        await session.close()
