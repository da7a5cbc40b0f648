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

from kafila.net.edge import LinkNode, SignalRouter
from kafila.net.endpoint import UdpEndpoint
from kafila.net.link import LinkConfig
from kafila.net.signaling import SignalingClient
from kafila.proto.codes import new_code
from kafila.rendezvous.limits import Limits
from kafila.rendezvous.server import RendezvousServer, ServerConfig

InNs = Callable[[], AbstractContextManager[None]]

# The lab opens many sessions from few addresses: join and open rates well above any test's need.
LAB_LIMITS = Limits(
    join_rate_per_address=100.0,
    join_burst_per_address=1000,
    join_rate_per_session=100.0,
    join_burst_per_session=1000,
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
    url = _where(rdv).url
    with in_a():
        ca = await SignalingClient.connect(url)
    with in_b():
        cb = await SignalingClient.connect(url)
    opened = await ca.open_session("tiny", 2, "a", {})
    code = new_code(opened.session)
    await cb.join(code.public, "b", {})
    nodes = []
    for sock, client in ((sock_a, ca), (sock_b, cb)):
        endpoint = await UdpEndpoint.open(sock)
        node = await LinkNode.joined(endpoint, SignalRouter(client), code, _where(rdv).udp_host)
        node.config = config or LinkConfig()
        if classify_nat:
            await node.classify_nat(timeout=probe_timeout)
        nodes.append(node)
    pair = Pair(nodes[0], nodes[1], [ca, cb])
    pair.pumps = [asyncio.create_task(n.signals.pump()) for n in nodes]
    return pair
