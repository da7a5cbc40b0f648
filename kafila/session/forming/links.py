"""A member's UDP node and the authenticated links of its ring."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Awaitable, Mapping

from kafila.net.edge import EdgeOptions, LinkNode, SignalRouter, link_edges
from kafila.net.endpoint import UdpEndpoint
from kafila.net.errors import LinkError, NatProbeError
from kafila.net.link import Link, LinkConfig, PathKind
from kafila.net.signaling import SignalingClient
from kafila.net.waits import wait_at_most
from kafila.planner.plan import Plan
from kafila.proto.codes import SessionCode
from kafila.session.channel import LINK_DIRECT_SILENT_S, LINK_KEEPALIVE_S
from kafila.session.errors import SessionError
from kafila.session.progress import say

# A session's links notice a silent direct path well inside the ring's bound (--lost-after, 3 s by
# default, at least 2) and go on over the relay before the ring counts the peer lost: silence for
# 1 s, checked with a PING every 0.25 s to tell silence from an idle link, so the move takes at most
# 1.25 s (kafila.session.channel, RELAY_MOVE_S; docs/links.md has the runs).
SESSION_LINKS = LinkConfig(keepalive=LINK_KEEPALIVE_S, dead_after=LINK_DIRECT_SILENT_S)


async def connect_node(client: SignalingClient, code: SessionCode, url: str) -> LinkNode:
    """This member's UDP node, joined to the rendezvous's UDP side and its NAT classified. Its
    socket is closed on any way out but success, a cancelled join's included."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        sock.bind(("0.0.0.0", 0))
        endpoint = await UdpEndpoint.open(sock)
    except BaseException:
        sock.close()
        raise
    try:
        return await _joined_node(client, code, url, endpoint)
    except BaseException:
        endpoint.close()
        raise


async def _joined_node(
    client: SignalingClient, code: SessionCode, url: str, endpoint: UdpEndpoint
) -> LinkNode:
    host = url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    try:
        node = await LinkNode.joined(endpoint, SignalRouter(client), code, host)
    except NatProbeError as exc:  # the rendezvous's UDP address: not a firewall's fault
        raise SessionError(f"cannot use the rendezvous's UDP ports: {exc}") from exc
    node.config = SESSION_LINKS
    try:
        await node.classify_nat()
    except NatProbeError as exc:
        raise SessionError(
            f"cannot classify this member's NAT: {exc} (the rendezvous's UDP ports must be reachable "
            "from here: a firewall in between, or a container without its UDP ports published?)"
        ) from exc
    return node


async def link_ring(
    node: LinkNode,
    plan: Plan,
    me: str,
    ids: dict[str, int],
    host: str,
    formed: dict[int, Link] | None = None,
) -> dict[str, Link]:
    """One authenticated link per pair of members that talk: ring neighbours, and the host with
    every member (the weight fetch). Returns this member's links by peer name. A link carries both
    directions, so a ring of two and the host's control links reuse the ring edges, and a link in
    `formed` (by peer id: the control links, formed before the plan) is used as it is."""
    pairs: dict[frozenset[str], tuple[str, str]] = {}  # pair -> (client, server)
    for m in plan.order:
        n = plan.successor(m)
        if m != n:
            pairs.setdefault(frozenset((m, n)), (m, n))
    for m in plan.order:
        if m != host:
            pairs.setdefault(frozenset((m, host)), (m, host))
    direct = {frozenset((e.src, e.dst)): e.direct for e in plan.edges}
    edges: dict[int, tuple[bool, EdgeOptions]] = {}
    for pair, (client, server) in pairs.items():
        if me in pair:
            peer = server if client == me else client
            edges[ids[peer]] = (client == me, EdgeOptions(predicted_direct=direct.get(pair, True)))
    names = {i: n for n, i in ids.items()}
    # every member proved the session's code to the host before the plan (admission.py), so a ring
    # edge that does not authenticate means tampering: its error says so. One that fails closes the
    # others this member opened, so those peers hear it at once.
    linked = await link_edges(node, edges, formed, label=lambda peer: f"link {me} <-> {names[peer]}")
    links = {names[peer]: link for peer, link in linked.items()}
    for peer, link in links.items():
        say(f"link {me} <-> {peer}: {link.path}")
    return links


async def named(me: str, peer: str, link: Awaitable[Link]) -> Link:
    """`link`, its failure naming the two members (the link layer knows only their ids: "edge 2->3")."""
    try:
        return await link
    except LinkError as exc:
        exc.args = (f"link {me} <-> {peer}: {exc}", *exc.args[1:])
        raise


async def measured_paths(
    me: str, links: Mapping[str, Link], within: float = EdgeOptions().punch_timeout
) -> dict[tuple[str, str], bool]:
    """(me, peer) -> whether that link runs direct, for each open link whose first round of
    punching is over: a link still punching (for at most `within` seconds more) may yet move to the
    direct path, so its relay is not a measurement until then."""
    pending = [link.punch_over.wait() for link in links.values() if not link.punch_over.is_set()]
    if pending:
        with contextlib.suppress(TimeoutError):
            await wait_at_most(asyncio.gather(*pending), within)
    return {
        (me, peer): link.path is PathKind.DIRECT
        for peer, link in links.items()
        if link.punch_over.is_set() and not link.closed
    }
