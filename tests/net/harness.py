"""Two members of one session on a real rendezvous (loopback or inside the NAT lab).

`open_pair` connects two signaling clients (each optionally from a network namespace), opens a
session on the first and joins it from the second with the code, adopts each member's UDP socket
and classifies each NAT against the rendezvous. Used by tests/net, tests/natlab, benchmarks.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

from kafila.net.edge import EdgeOptions, LinkNode, SignalRouter, connect_edge
from kafila.net.endpoint import UdpEndpoint
from kafila.net.link import Link, LinkConfig
from kafila.net.signaling import SignalingClient
from kafila.proto.codes import new_code
from kafila.rendezvous.limits import Limits
from kafila.rendezvous.server import RendezvousServer, ServerConfig

InNs = Callable[[], AbstractContextManager[None]]

# The lab opens many sessions from few addresses: join and open rates well above any test's need,
# and the members of a test share 127.0.0.1, so one member's wrong code holds the next back briefly.
LAB_LIMITS = Limits(
    join_rate_per_address=100.0,
    join_burst_per_address=1000,
    failed_proof_rate_per_session=100.0,
    failed_proof_burst_per_session=1000,
    failed_proof_backoff_s=0.01,
    open_rate_per_address=100.0,
    open_burst_per_address=1000,
)


@contextlib.contextmanager
def _nowhere() -> Iterator[None]:
    yield


async def start_rendezvous(
    host: str = "127.0.0.1", alt_host: str | None = None, limits: Limits = LAB_LIMITS
) -> RendezvousServer:
    server = RendezvousServer(
        ServerConfig(host=host, port=0, udp_port=0, udp_alt_port=0, udp_alt_host=alt_host, limits=limits)
    )
    await server.start()
    return server


@dataclass
class Pair:
    a: LinkNode
    b: LinkNode
    clients: list[SignalingClient]
    pumps: list[asyncio.Task[None]] = field(default_factory=list)

    async def both_ends(
        self, opts: EdgeOptions, within: float = 15.0
    ) -> tuple[Link | BaseException, Link | BaseException]:
        """connect_edge from both members at once (a the client): each end's link or its error."""
        return await asyncio.wait_for(
            asyncio.gather(
                connect_edge(self.a, self.b.member, True, opts),
                connect_edge(self.b, self.a.member, False, opts),
                return_exceptions=True,
            ),
            timeout=within,
        )

    async def close(self) -> None:
        for pump in self.pumps:
            pump.cancel()
        for client in self.clients:
            with contextlib.suppress(Exception):
                await client.close()
        self.a.endpoint.close()
        self.b.endpoint.close()


@dataclass(frozen=True)
class RendezvousAt:
    """Where members reach a rendezvous (one running in another process, e.g. the CLI)."""

    url: str
    udp_host: str


def _where(rdv: RendezvousServer | RendezvousAt) -> RendezvousAt:
    if isinstance(rdv, RendezvousAt):
        return rdv
    return RendezvousAt(rdv.url, rdv.config.udp_host or rdv.config.host)


@dataclass
class Session:
    """N members of one session, in joining order (nodes[0] opened it)."""

    nodes: list[LinkNode]
    clients: list[SignalingClient]
    pumps: list[asyncio.Task[None]] = field(default_factory=list)

    async def close(self) -> None:
        for pump in self.pumps:
            pump.cancel()
        for client in self.clients:
            with contextlib.suppress(Exception):
                await client.close()
        for node in self.nodes:
            node.endpoint.close()


async def open_session(
    rdv: RendezvousServer | RendezvousAt,
    socks: list[socket.socket],
    in_ns: list[InNs] | None = None,
    config: LinkConfig | None = None,
    classify_nat: bool = True,
    probe_timeout: float = 0.3,
) -> Session:
    """One member per socket: the first opens a session, the rest join it with the code."""
    where = _where(rdv)
    clients = []
    for enter in in_ns or [_nowhere] * len(socks):
        with enter():
            clients.append(await SignalingClient.connect(where.url))
    opened = await clients[0].open_session("tiny", len(socks), "m1", {})
    code = new_code(opened.session)
    await clients[0].protect(code)
    for i, client in enumerate(clients[1:], start=2):
        await client.join(code, f"m{i}", {})
    nodes = []
    for sock, client in zip(socks, clients, strict=True):
        node = await LinkNode.joined(await UdpEndpoint.open(sock), SignalRouter(client), code, where.udp_host)
        node.config = config or LinkConfig()
        if classify_nat:
            await node.classify_nat(timeout=probe_timeout)
        nodes.append(node)
    return Session(nodes, clients, [asyncio.create_task(n.signals.pump()) for n in nodes])


async def open_pair(
    rdv: RendezvousServer | RendezvousAt,
    sock_a: socket.socket,
    sock_b: socket.socket,
    in_a: InNs = _nowhere,
    in_b: InNs = _nowhere,
    config: LinkConfig | None = None,
    classify_nat: bool = True,
    probe_timeout: float = 0.3,
) -> Pair:
    session = await open_session(rdv, [sock_a, sock_b], [in_a, in_b], config, classify_nat, probe_timeout)
    return Pair(session.nodes[0], session.nodes[1], session.clients, session.pumps)
