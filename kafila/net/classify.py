"""NAT classification against the rendezvous's probe endpoints (RFC 4787 terms, RFC 5780 tests).

The decision is pure (`decide`); `classify` is the asyncio shell that sends a constant number of
binding requests (each retried) from the member's one socket:
1. three requests to the primary address and port (A, P): the mapped address, median round trip;
2. filtering, before this socket has sent anything to A' or P' (so no filter has opened for them):
   a reply from the other address and port (flags 0x03) arriving means endpoint-independent
   filtering; else a reply from the other port (0x01) arriving means address-dependent; else
   address-and-port-dependent;
3. mapping: the mapped address seen by (A', P) equals the one seen by (A, P): endpoint-independent;
   else the one seen by (A', P') equals that of (A', P): address-dependent; else address-and-port-
   dependent. Without a second rendezvous address (A' absent) only the port can change, so
   address-dependent behaviour reads as endpoint-independent (noted in the report).
Classes: endpoint-independent mapping and filtering -> permissive; endpoint-independent mapping ->
ordinary; any other mapping -> restrictive.
4. open input: with endpoint-independent mapping and a filter that dropped the replies of step 2,
   (A', P') mapped to another port than (A, P) and (A', P) did means the router's own stack took
   the unsolicited reply from (A', P') (no WAN input firewall): conntrack kept that flow, and this
   socket's own flow to (A', P') had to leave from another port. A peer's punch probe that arrives
   first does the same to the punch (docs/links.md), so the NAT is marked `open_input`.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from kafila.net.endpoint import Address, Binding, UdpEndpoint
from kafila.net.errors import NatProbeError
from kafila.obs.log import get_logger
from kafila.planner.reachability import Behaviour, Nat, NatClass
from kafila.proto import udp

log = get_logger("kafila.net.classify")
EI, AD, APD = (
    Behaviour.ENDPOINT_INDEPENDENT,
    Behaviour.ADDRESS_DEPENDENT,
    Behaviour.ADDRESS_AND_PORT_DEPENDENT,
)


@dataclass(frozen=True)
class NatReport:
    nat: Nat
    mapped: Address  # this socket's server-reflexive address
    rtt_median: float  # seconds to the rendezvous
    probes: int  # binding requests sent, retries included
    notes: tuple[str, ...] = field(default=())
    # open input (decide, step 4): the mapping (A', P') was moved to, which this socket's later
    # flows reuse (Linux maps a new flow as the latest one from the same source): a second
    # server-reflexive candidate
    moved: Address | None = None

    def to_json(self) -> dict[str, Any]:
        """The object members publish as their `nat` in signaling."""
        return {
            **self.nat.to_dict(),
            "mapped": f"{self.mapped[0]}:{self.mapped[1]}",
            "rtt_ms": round(self.rtt_median * 1000, 2),
        }


def decide(
    m1: Address, m2: Address | None, m3: Address | None, other_addr_reply: bool, other_port_reply: bool
) -> Nat:
    """Mapping from the mapped addresses seen by (A,P), (A',P), (A',P'); filtering from the replies;
    open input from (A',P') alone moving an otherwise endpoint-independent mapping (step 4)."""
    if m2 is None or m2 == m1:
        mapping = EI
    elif m3 is not None and m3 == m2:
        mapping = AD
    else:
        mapping = APD
    filtering = EI if other_addr_reply else AD if other_port_reply else APD
    if mapping is not EI:
        cls = NatClass.RESTRICTIVE
    elif filtering is EI:
        cls = NatClass.PERMISSIVE
    else:
        cls = NatClass.ORDINARY
    open_input = cls is NatClass.ORDINARY and m2 is not None and m3 is not None and m3 != m1
    return Nat(cls, mapping, filtering, open_input)


class _Prober:
    def __init__(self, endpoint: UdpEndpoint, timeout: float, attempts: int) -> None:
        self.endpoint, self.timeout, self.attempts = endpoint, timeout, attempts
        self.sent = 0

    async def ask(self, server: Address, flags: int = 0) -> Binding | None:
        before = self.endpoint.counters.datagrams_out
        got = await self.endpoint.binding(server, flags, self.timeout, self.attempts)
        self.sent += self.endpoint.counters.datagrams_out - before
        return got

    async def mapped(self, server: Address) -> Address | None:
        got = await self.ask(server)
        return got.response.observed if got and isinstance(got.response, udp.BindingResponse) else None


async def classify(
    endpoint: UdpEndpoint,
    server: Address,
    alt_port: int | None = None,
    alt_host: str | None = None,
    timeout: float = 0.3,
    attempts: int = 3,
    rtt_samples: int = 3,
) -> NatReport:
    """Classify the NAT in front of `endpoint`'s socket against the rendezvous at `server`."""
    p = _Prober(endpoint, timeout, attempts)
    firsts = [b for b in [await p.ask(server) for _ in range(rtt_samples)] if b is not None]
    answers = [b for b in firsts if isinstance(b.response, udp.BindingResponse)]
    if not answers:
        raise NatProbeError(
            f"rendezvous probe endpoint {server[0]}:{server[1]} did not answer "
            f"{rtt_samples * attempts} binding requests ({timeout} s each)"
        )
    first = answers[0].response
    assert isinstance(first, udp.BindingResponse)
    notes: list[str] = []
    other = first.other
    both = await p.ask(server, udp.FLAG_CHANGE_ADDRESS | udp.FLAG_CHANGE_PORT)
    if both is not None and isinstance(both.response, udp.BindingError):
        notes.append(f"rendezvous cannot reply from another address: {both.response.reason}")
    port_only = await p.ask(server, udp.FLAG_CHANGE_PORT)
    other_addr_reply = both is not None and isinstance(both.response, udp.BindingResponse)
    other_port_reply = port_only is not None and isinstance(port_only.response, udp.BindingResponse)
    alt_host = alt_host or (other[0] if other and other[0] != server[0] else None)
    alt_port = alt_port or (other[1] if other else None)
    m2 = m3 = None
    if alt_host:
        m2 = await p.mapped((alt_host, server[1]))
        m3 = await p.mapped((alt_host, alt_port)) if alt_port else None
    elif alt_port:
        notes.append("one rendezvous address: address-dependent mapping reads as endpoint-independent")
        m2 = await p.mapped((server[0], alt_port))
    nat = decide(first.observed, m2, m3, other_addr_reply, other_port_reply)
    if alt_host and m2 is None:  # unanswered is not "the same mapping": assume the worst
        notes.append(
            f"the rendezvous's second address {alt_host}:{server[1]} did not answer: mapping unknown, "
            "taken as address- and port-dependent (the link still tries the direct path)"
        )
        nat = Nat(NatClass.RESTRICTIVE, APD, nat.filtering)
    rtt = statistics.median(b.rtt for b in answers)
    moved = m3 if nat.open_input else None
    report = NatReport(nat, first.observed, rtt, p.sent, tuple(notes), moved)
    log.info(
        "nat_classified",
        **nat.to_dict(),
        mapped=report.to_json()["mapped"],
        rtt_ms=report.to_json()["rtt_ms"],
        probes=p.sent,
        notes=list(notes),
    )
    return report
