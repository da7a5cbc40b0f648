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


def test_candidate_addresses_round_trip_through_signaling_text() -> None:
    from kafila.net.edge import format_address, parse_address

    for addr in (("198.18.0.11", 5000), ("2001:db8::7", 443)):
        assert parse_address(format_address(addr)) == addr
    assert format_address(("2001:db8::7", 443)) == "[2001:db8::7]:443"
