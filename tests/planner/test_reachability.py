"""Pair rules: the paper's and the one measured on Linux NATs (the NAT lab)."""

from __future__ import annotations

import itertools

from kafila.planner.reachability import LINUX_RULE, PAPER_RULE, UNKNOWN, Behaviour, Nat, NatClass

P = Nat(NatClass.PERMISSIVE)
OA = Nat(NatClass.ORDINARY, Behaviour.ENDPOINT_INDEPENDENT, Behaviour.ADDRESS_DEPENDENT)
OP = Nat(NatClass.ORDINARY, Behaviour.ENDPOINT_INDEPENDENT, Behaviour.ADDRESS_AND_PORT_DEPENDENT)
ORD = Nat(NatClass.ORDINARY)
R = Nat(NatClass.RESTRICTIVE)
OPEN = Nat(NatClass.ORDINARY, Behaviour.ENDPOINT_INDEPENDENT, Behaviour.ADDRESS_AND_PORT_DEPENDENT, True)
OA_OPEN = Nat(NatClass.ORDINARY, Behaviour.ENDPOINT_INDEPENDENT, Behaviour.ADDRESS_DEPENDENT, True)
ALL = [P, OA, OP, ORD, R, OPEN, OA_OPEN]


def test_paper_rule_direct_iff_one_endpoint_permissive():
    for a, b in itertools.product(ALL, ALL):
        assert PAPER_RULE(a, b) == (NatClass.PERMISSIVE in (a.cls, b.cls))


def test_linux_rule_matches_the_measured_punching_outcomes():
    assert all(LINUX_RULE(P, x) and LINUX_RULE(x, P) for x in ALL)
    assert LINUX_RULE(OA, OP) and LINUX_RULE(ORD, ORD) and LINUX_RULE(OP, OP)
    assert LINUX_RULE(OA, R) and LINUX_RULE(R, OA)
    assert not LINUX_RULE(OP, R) and not LINUX_RULE(R, OP)
    assert not LINUX_RULE(ORD, R)  # unknown filtering counts as port-dependent (plain MASQUERADE)
    assert not LINUX_RULE(R, R)


def test_a_router_with_open_input_punches_as_measured_in_the_nat_lab():
    """It probes first and publishes its moved port (kafila.net.edge), so permissive, address- and
    port-restricted peers punch; another open router or a restrictive peer relay."""
    for n in (OPEN, OA_OPEN):
        assert LINUX_RULE(n, P) and LINUX_RULE(n, OA) and LINUX_RULE(OA, n)
        assert not any(LINUX_RULE(n, x) or LINUX_RULE(x, n) for x in (R, OPEN, OA_OPEN))
    assert LINUX_RULE(OPEN, OP) and LINUX_RULE(ORD, OPEN)
    assert not LINUX_RULE(OA_OPEN, OP)  # not built in the lab: predicted relayed
    assert Nat.from_dict(OPEN.to_dict()) == OPEN
    assert Nat.from_dict({"cls": "ordinary", "mapping": None, "filtering": None}).open_input is False


def test_rules_are_symmetric_and_unknown_is_restrictive():
    for rule in (PAPER_RULE, LINUX_RULE):
        for a, b in itertools.product(ALL, ALL):
            assert rule(a, b) == rule(b, a)
    assert Nat.of(None) == UNKNOWN and UNKNOWN.cls is NatClass.RESTRICTIVE
    assert Nat.from_dict(OA.to_dict()) == OA
