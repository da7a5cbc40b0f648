"""Forming one ring edge: candidates through signaling, punching, relay channel, then the QUIC link.

    node = LinkNode(endpoint, signals, identity, session, member, secret, relay=(rv_host, probe_port))
    node.nat = await classify(endpoint, ...)              # once per member (gives the mapped address)
    link = await connect_edge(node, peer=3, is_client=True)  # both ends call it, one as client

Both ends send an `offer` signal (random punch nonce, candidate addresses) and wait for the
other's. The client asks the rendezvous for a relay channel for the edge (both ends receive their
leg tokens) and both bind their leg from the member socket, so the relay is ready as a fallback.
Punching starts at once; QUIC starts as soon as a punch succeeds or, when it has not after
`punch_wait` seconds (0 when the pair is predicted relayed), on the relay, and moves to the direct
path if the punch succeeds later (it continues for `punch_timeout`). The rendezvous sees offers,
tokens and, on a relayed edge, ciphertext; the link authenticates with the secret it never sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kafila.net.auth import EdgeContext
from kafila.net.certs import Identity, make_identity
from kafila.net.classify import NatReport, classify
from kafila.net.endpoint import Address, UdpEndpoint
from kafila.net.errors import LinkError, LinkTimeout, NatProbeError
from kafila.net.link import Link, LinkConfig, PathKind, RelayLeg
from kafila.net.punch import Puncher, punch_key
from kafila.net.signaling import SignalingClient, SignalingError
from kafila.net.waits import wait_at_most
from kafila.obs.log import get_logger
from kafila.proto import signaling as sig
from kafila.proto.codes import SessionCode
from kafila.proto.udp import format_address, parse_address

log = get_logger("kafila.net.edge")
SIGNAL_KEY = "kafila_link"  # marks a signal payload as ours
SIGNAL_VERSION = 1


def edge_name(client: int, server: int) -> str:
    return f"{client}>{server}"


class SignalRouter:
    """Takes this module's signals and relay grants out of the signaling event stream.

    Call `handle(event)` for each `SignalingClient.next_event()` (True: it was ours), or run
    `pump()`, which puts every other event on `others` for the session layer.
    """

    def __init__(self, client: SignalingClient) -> None:
        self.client = client
        self.others: asyncio.Queue[sig.ServerMessage] = asyncio.Queue()
        self._offers: dict[tuple[int, str], asyncio.Future[dict[str, Any]]] = {}
        self._relays: dict[int, asyncio.Future[sig.RelayAllocated]] = {}

    def _future(self, table: dict[Any, asyncio.Future[Any]], key: Any) -> asyncio.Future[Any]:
        if key not in table or table[key].cancelled():
            table[key] = asyncio.get_running_loop().create_future()
        return table[key]

    def handle(self, event: sig.ServerMessage) -> bool:
        if isinstance(event, sig.SignalFrom) and event.payload.get(SIGNAL_KEY) == SIGNAL_VERSION:
            edge = str(event.payload.get("edge", ""))
            fut = self._future(self._offers, (event.sender, edge))
            if not fut.done():
                fut.set_result(event.payload)
            return True
        if isinstance(event, sig.RelayAllocated):
            fut = self._future(self._relays, event.peer)
            if not fut.done():
                fut.set_result(event)
            return True
        return False

    async def pump(self) -> None:
        while True:
            event = await self.client.next_event()
            if not self.handle(event):
                self.others.put_nowait(event)

    async def offer(self, peer: int, edge: str, timeout: float) -> dict[str, Any]:
        fut = self._future(self._offers, (peer, edge))
        try:
            return await wait_at_most(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise LinkTimeout(f"edge {edge}: no offer from member {peer} within {timeout} s") from None
        finally:
            if fut.done():
                self._offers.pop((peer, edge), None)

    async def relay_grant(self, peer: int, timeout: float) -> sig.RelayAllocated:
        fut = self._future(self._relays, peer)
        try:
            return await wait_at_most(asyncio.shield(fut), timeout)
        except TimeoutError:
            raise LinkTimeout(
                f"no relay channel for the edge with member {peer} within {timeout} s"
            ) from None
        finally:
            if fut.done():
                self._relays.pop(peer, None)


@dataclass
class LinkNode:
    """What one member brings to all its edges."""

    endpoint: UdpEndpoint
    signals: SignalRouter
    session: str  # public part of the session code
    member: int
    secret: bytes  # SessionCode.secret_material()
    relay: Address  # the rendezvous's UDP address (probes and relay)
    identity: Identity = field(default_factory=make_identity)
    nat: NatReport | None = None
    config: LinkConfig = field(default_factory=LinkConfig)
    links: dict[int, Link] = field(default_factory=dict)  # open links by peer member id

    @classmethod
    async def joined(
        cls, endpoint: UdpEndpoint, signals: SignalRouter, code: SessionCode, rendezvous_host: str
    ) -> LinkNode:
        """The node of a member that has opened or joined the session on `signals.client`;
        `rendezvous_host` is the host it reached the rendezvous at (probes and relay live there)."""
        client = signals.client
        port = client.probe[0]
        if client.member is None or port is None:
            raise ValueError("open or join the session first: the rendezvous announces its probe port then")
        relay = (await _rendezvous_address(rendezvous_host, endpoint.sock.family), port)
        return cls(endpoint, signals, code.public, client.member, code.secret_material(), relay)

    async def classify_nat(self, timeout: float = 0.3, attempts: int = 3) -> NatReport:
        """Classify this member's NAT against the rendezvous's probe endpoints (once per member)."""
        _, alt_port, alt_host = self.signals.client.probe
        self.nat = await classify(self.endpoint, self.relay, alt_port, alt_host, timeout, attempts)
        return self.nat

    def candidates(self) -> list[Address]:
        local = self.endpoint.local_address
        if local[0] in ("0.0.0.0", ""):
            local = (_route_source(self.relay[0]), local[1])
        found = [local]
        if self.nat is not None:
            found += [a for a in (self.nat.mapped, self.nat.moved) if a is not None and a not in found]
        return found


async def _rendezvous_address(host: str, family: int) -> str:
    """`host`'s first address of the member socket's `family` (the socket is IPv4: an IPv6 address
    first in the host's list could not be sent to, and every probe would be lost without a word)."""
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, None, family=family, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        try:
            other = await loop.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
        except socket.gaierror:
            raise NatProbeError(f"rendezvous host {host} does not resolve: {exc.strerror}") from None
        found = ", ".join(dict.fromkeys(str(info[4][0]) for info in other))
        raise NatProbeError(
            f"rendezvous host {host} has no IPv4 address (only {found}): this member's UDP socket is "
            "IPv4, and an IPv6-only rendezvous is not supported yet"
        ) from None
    return str(infos[0][4][0])


def _route_source(dest: str) -> str:
    """The local address this host would use toward `dest` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect((dest, 9))
        return str(probe.getsockname()[0])


@dataclass(frozen=True)
class EdgeOptions:
    predicted_direct: bool = True  # from the pair rule; False starts on the relay right away
    punch_wait: float = 0.4  # seconds to wait for a punch before starting on the relay
    punch_timeout: float = 5.0  # total punching time (continues on the relay, upgrading on success)
    # a peer behind a router with open input probes first: wait this long, plus both rendezvous rtts
    open_first_wait: float = 0.2
    repunch_interval: float = 10.0  # while on the relay, try the direct path again this often (0: never)
    use_relay: bool = True
    use_direct: bool = True
    signal_timeout: float = 10.0


async def connect_edge(
    node: LinkNode, peer: int, is_client: bool, options: EdgeOptions | None = None
) -> Link:
    """Form the edge with `peer` (both call it; exactly one with is_client=True); authenticated."""
    opts = options or EdgeOptions()
    if peer in node.links and not node.links[peer].closed:
        raise ValueError(
            f"member {node.member} already has a link with member {peer}: one link per pair carries "
            "both directions (a two-member ring uses it both ways)"
        )
    client, server = (node.member, peer) if is_client else (peer, node.member)
    edge = edge_name(client, server)
    nonce = os.urandom(16)
    mine = [format_address(a) for a in node.candidates()] if opts.use_direct else []
    offer: dict[str, Any] = {
        SIGNAL_KEY: SIGNAL_VERSION,
        "edge": edge,
        "nonce": nonce.hex(),
        "candidates": mine,
    }
    open_input = opts.use_direct and node.nat is not None and node.nat.nat.open_input
    own_rtt = node.nat.rtt_median if node.nat is not None else 0.0
    if open_input:  # the peer waits for our first probe (see _punch), our signaling's time included
        offer["probe_first"] = round(own_rtt, 4)
    await node.signals.client.signal(peer, offer)
    theirs = await node.signals.offer(peer, edge, opts.signal_timeout)
    delay = 0.0 if open_input else probe_delay(theirs.get("probe_first"), own_rtt, opts.open_first_wait)
    peer_nonce = bytes.fromhex(str(theirs["nonce"]))
    ctx = EdgeContext(node.session, str(client), str(server), node.secret)
    link = Link(node.endpoint, ctx, node.identity, is_client, node.config)
    key = punch_key(*((nonce, peer_nonce) if is_client else (peer_nonce, nonce)), edge)
    peer_candidates = [parse_address(c) for c in theirs.get("candidates", [])] if opts.use_direct else []
    puncher = Puncher(
        node.endpoint, key, "client" if is_client else "server", peer_candidates, link.accept_from
    )
    link.on_close.append(puncher.stop)
    timeout = opts.punch_timeout if peer_candidates else 0
    punched = link.punch_over  # the first round of punching is over (succeeded or timed out)
    punch = asyncio.create_task(
        _punch(link, puncher, timeout, opts.repunch_interval if peer_candidates else 0, punched, delay)
    )
    relay = asyncio.create_task(_relay(node, link, peer, is_client, opts)) if opts.use_relay else None
    link.tasks += [punch] + ([relay] if relay else [])
    if not opts.use_direct:
        unpunched = "the direct path is not used"
    elif not peer_candidates:
        unpunched = f"member {peer} sent no candidate address"
    else:
        unpunched = f"no answer within {timeout:g} s"
    try:
        await _wait_for_a_path(
            link, punched, relay, opts.punch_wait + delay if opts.predicted_direct else 0.0, unpunched
        )
        link.start()
        await link.wait_ready()
    except BaseException:
        await link.close("edge setup failed")
        raise
    node.links[peer] = link
    log.info("edge_connected", edge=edge, path=link.path, probes=puncher.probes_sent)
    return link


def probe_delay(probe_first: Any, own_rtt: float, wait: float) -> float:
    """How long to hold our first probe for a peer whose offer says `probe_first` (its rendezvous
    round trip, seconds): `wait` plus both round trips. 0 for an offer without it (or with a value
    that is not a round trip: a peer's bad offer must not stall the link)."""
    if isinstance(probe_first, bool) or not isinstance(probe_first, int | float):
        return 0.0
    if not 0 <= probe_first < 10:
        return 0.0
    return wait + own_rtt + float(probe_first)


async def _punch(
    link: Link,
    puncher: Puncher,
    timeout: float,
    repunch_interval: float,
    punched: asyncio.Event,
    delay: float = 0.0,
) -> None:
    """Punch after `delay` (then set `punched`); later, whenever the link is on the relay, try the
    direct path again.

    `delay`: the peer's router takes unsolicited input (its offer says `probe_first`; docs/links.md):
    a probe of ours that reached it before the peer's own flow to us existed would be taken by the
    router's stack and move that flow to yet another port, so the peer, which probes as soon as it
    has our offer, goes first."""
    try:
        await asyncio.sleep(delay)
        addr = await puncher.run(timeout)
    finally:
        punched.set()
    if addr is not None and not link.closed:
        link.add_direct(addr)
    while repunch_interval > 0 and not link.closed:
        await asyncio.sleep(repunch_interval)
        if link.path is PathKind.RELAY:
            puncher.reset()
            addr = await puncher.run(min(timeout, 1.0))
            if addr is not None and not link.closed:
                link.add_direct(addr, "punch succeeded again")


async def _relay(node: LinkNode, link: Link, peer: int, is_client: bool, opts: EdgeOptions) -> None:
    try:
        if is_client:
            grant = await node.signals.client.request_relay(peer, timeout=opts.signal_timeout)
        else:
            grant = await node.signals.relay_grant(peer, opts.signal_timeout)
        token = bytes.fromhex(grant.token)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + opts.signal_timeout
        while True:  # bind until the other leg is bound too, so the first QUIC flight is not dropped
            ack = await node.endpoint.bind_relay(node.relay, grant.channel, token)
            if ack.peer_bound or loop.time() > deadline:
                break
            await asyncio.sleep(0.05)
    except (SignalingError, NatProbeError, LinkTimeout, TimeoutError, ConnectionError) as exc:
        link.relay_error = f"relay unavailable: {exc}"
        log.warning("relay_unavailable", peer=peer, error=str(exc))
        return
    if not link.closed:
        link.set_relay(RelayLeg(node.relay, grant.channel, token))


async def _wait_for_a_path(
    link: Link,
    punched: asyncio.Event,
    relay: asyncio.Task[None] | None,
    punch_wait: float,
    unpunched: str,
) -> None:
    """Until a punch succeeded, or `punch_wait` passed with the relay ready, or both gave up: the
    first round of punching is over without a direct path and the relay could not be set up (the
    punch task lives on to re-punch, so its end is not what is waited for). `unpunched`: why
    punching found no path, for the error."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    while True:
        if link.direct_address is not None:
            return
        if link.path is not None and loop.time() - start >= punch_wait:
            return
        relay_over = relay is None or relay.done()
        if punched.is_set() and relay_over:
            if link.path is not None:
                return
            raise LinkError(_no_path(link, relay, unpunched))
        if relay is not None and not relay_over:
            await asyncio.wait([relay], timeout=0.02)
        else:
            await asyncio.sleep(0.02)


def _no_path(link: Link, relay: asyncio.Task[None] | None, unpunched: str) -> str:
    """One line: why punching failed and why there is no relay."""
    if relay is None:
        why_relay = "the relay is not used"
    elif relay.cancelled():
        why_relay = "relay setup cancelled"
    elif relay.exception() is not None:
        why_relay = f"relay setup failed: {relay.exception()!r}"
    else:
        why_relay = link.relay_error or "relay unavailable"
    return (
        f"link to member {link.peer_id}: punching failed ({unpunched}) and no relay is available "
        f"({why_relay})"
    )


async def connect_ring(
    node: LinkNode,
    ring: list[int],
    predicted_direct: dict[int, bool] | None = None,
    options: EdgeOptions | None = None,
) -> dict[int, Link]:
    """Links from this member to its ring neighbours, by peer id (every member calls it with the
    same ring order). The edge ring[i] -> ring[i+1] has ring[i] as QUIC client; a two-member ring
    is one link used both ways. `predicted_direct[peer]` (from the pair rule) sets each edge's
    `EdgeOptions.predicted_direct`."""
    if node.member not in ring:
        raise ValueError(f"member {node.member} is not in the ring {ring}")
    i = ring.index(node.member)
    n = len(ring)
    succ, pred = ring[(i + 1) % n], ring[(i - 1) % n]
    clients: dict[int, bool] = {}  # peer -> this member is the QUIC client of the edge
    if n == 2:
        clients = {succ: i == 0}
    elif n > 2:
        clients = {succ: True, pred: False}
    base = options or EdgeOptions()
    guesses = predicted_direct or {}
    edges = {p: (c, replace(base, predicted_direct=guesses.get(p, True))) for p, c in clients.items()}
    return await link_edges(node, edges)


async def link_edges(
    node: LinkNode,
    edges: Mapping[int, tuple[bool, EdgeOptions]],
    formed: Mapping[int, Link] | None = None,
    label: Callable[[int], str] | None = None,
) -> dict[int, Link]:
    """This member's links on `edges` (peer id -> (this member is the QUIC client, options)), all
    formed at once; a peer in `formed` keeps the link it has. All or nothing: when one edge fails
    (or the caller is cancelled), the edges still forming stop and every link this call opened
    closes, so its peer hears it at once instead of at its liveness timeout, and the first error is
    raised, prefixed with `label(peer)` when given. The links in `formed` stay open: their owner
    closes them."""
    formed = formed or {}
    jobs = {
        peer: asyncio.ensure_future(connect_edge(node, peer, is_client, opts))
        for peer, (is_client, opts) in edges.items()
        if peer not in formed
    }
    complete = False
    try:
        if jobs:
            await asyncio.wait(jobs.values(), return_when=asyncio.FIRST_EXCEPTION)
        for peer, job in jobs.items():
            if job.done() and (error := job.exception()) is not None:
                if label is not None and isinstance(error, LinkError):
                    error.args = (f"{label(peer)}: {error}", *error.args[1:])
                raise error
        complete = True
        return {peer: formed[peer] if peer in formed else jobs[peer].result() for peer in edges}
    finally:
        if not complete:
            await _abandon(list(jobs.values()), f"another link of member {node.member} failed")


async def _abandon(jobs: Sequence[asyncio.Future[Link]], why: str) -> None:
    """Stop the links still forming and close those that formed, telling their peers `why`."""
    for job in jobs:
        job.cancel()  # a done job ignores it
    for job in jobs:
        if not job.done():
            await asyncio.wait([job])  # its cancellation has run (a link it had formed is closed by it)
        if job.cancelled() or job.exception() is not None:
            continue
        with contextlib.suppress(Exception):
            await job.result().close(why)
