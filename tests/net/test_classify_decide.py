"""The pure classification decision (RFC 4787 behaviours -> Kafila classes)."""

from __future__ import annotations

import pytest

from kafila.net.classify import AD, APD, EI, decide
from kafila.planner.reachability import NatClass

M1, M1_OTHER_PORT, M1_THIRD = ("198.18.0.11", 5000), ("198.18.0.11", 40001), ("198.18.0.11", 40002)


@pytest.mark.parametrize(
    ("m2", "m3", "other_addr", "other_port", "expected"),
    [
        (M1, M1, True, True, (NatClass.PERMISSIVE, EI, EI)),  # full cone
        (M1, M1, False, True, (NatClass.ORDINARY, EI, AD)),  # restricted cone
        (M1, M1, False, False, (NatClass.ORDINARY, EI, APD)),  # port-restricted cone
        (M1_OTHER_PORT, M1_OTHER_PORT, False, False, (NatClass.RESTRICTIVE, AD, APD)),
        (M1_OTHER_PORT, M1_THIRD, False, False, (NatClass.RESTRICTIVE, APD, APD)),  # symmetric
        (M1_OTHER_PORT, None, True, True, (NatClass.RESTRICTIVE, APD, EI)),  # no (A',P') answer
        (None, None, False, True, (NatClass.ORDINARY, EI, AD)),  # no alternate endpoint at all
    ],
)
def test_decide(m2, m3, other_addr: bool, other_port: bool, expected) -> None:
    nat = decide(M1, m2, m3, other_addr, other_port)
    assert (nat.cls, nat.mapping, nat.filtering) == expected


@pytest.mark.parametrize(
    ("m3", "other_addr", "other_port", "open_input"),
    [
        (M1_THIRD, False, False, True),  # port-restricted; the unsolicited reply moved (A',P')'s mapping
        (M1_THIRD, False, True, True),  # address-restricted, the same
        (M1, False, False, False),  # the router dropped the reply: (A',P') keeps the mapping
        (M1_THIRD, True, True, False),  # full cone: the reply reached the member, nothing to claim
        (None, False, False, False),  # (A',P') unanswered: nothing measured
    ],
)
def test_decide_marks_a_router_whose_own_stack_took_the_unsolicited_reply(
    m3, other_addr: bool, other_port: bool, open_input: bool
) -> None:
    """(A',P) keeps the mapping of (A,P) but (A',P'), the sender of the unsolicited filtering reply,
    gets another port: the router's conntrack kept that reply's flow (docs/links.md)."""
    nat = decide(M1, M1, m3, other_addr, other_port)
    assert nat.mapping is EI and nat.open_input is open_input
    assert nat.cls is (NatClass.PERMISSIVE if other_addr else NatClass.ORDINARY)


def test_candidate_addresses_round_trip_through_signaling_text() -> None:
    from kafila.net.edge import format_address, parse_address

    for addr in (("198.18.0.11", 5000), ("2001:db8::7", 443)):
        assert parse_address(format_address(addr)) == addr
    assert format_address(("2001:db8::7", 443)) == "[2001:db8::7]:443"


@pytest.mark.network
@pytest.mark.parametrize("alt_host", [None, "127.0.0.2"])
async def test_a_second_rendezvous_address_that_does_not_answer_is_not_read_as_the_same_mapping(
    alt_host: str | None,
) -> None:
    """A firewalled second address made a symmetric NAT read as "ordinary", with no note. On
    loopback (no NAT) the real classifier asks a real rendezvous; 127.0.0.2 has nobody listening."""
    from kafila.net.classify import classify
    from kafila.net.endpoint import UdpEndpoint
    from tests.net.harness import start_rendezvous

    rdv = await start_rendezvous()
    endpoint = await UdpEndpoint.open(local=("127.0.0.1", 0))
    try:
        server = ("127.0.0.1", rdv.udp.port)
        report = await classify(endpoint, server, rdv.udp.alt_port, alt_host, timeout=0.1, attempts=1)
    finally:
        endpoint.close()
        await rdv.stop()
    if alt_host is None:  # one address: nothing to misread, as before
        assert report.nat.cls is NatClass.ORDINARY and not any("did not answer" in n for n in report.notes)
    else:
        assert (report.nat.cls, report.nat.mapping) == (NatClass.RESTRICTIVE, APD)
        assert any(n.startswith("the rendezvous's second address 127.0.0.2:") for n in report.notes)


@pytest.mark.parametrize(
    ("probe_first", "expected"),
    [(None, 0.0), (0.004, 0.2 + 0.002 + 0.004), (0, 0.202), (True, 0.0), ("0.1", 0.0), (-1, 0.0), (1e9, 0.0)],
)
def test_a_peer_behind_an_open_router_is_given_the_first_probe_and_a_bad_offer_stalls_nothing(
    probe_first: object, expected: float
) -> None:
    from kafila.net.edge import probe_delay

    assert probe_delay(probe_first, 0.002, 0.2) == pytest.approx(expected)
