"""Ring order: exhaustive search vs brute force, separation tie-break, counting rule, heuristic bound."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.planner.devices import DeviceReport
from kafila.planner.order import (
    RingPrices,
    alternate,
    cheapest_insertion,
    describe,
    one_tree_bound,
    order_ring,
    ring_edges,
    two_opt,
)
from kafila.planner.reachability import LINUX_RULE, PAPER_RULE, Behaviour, Nat, NatClass

NATS = [
    Nat(NatClass.PERMISSIVE),
    Nat(NatClass.ORDINARY, filtering=Behaviour.ADDRESS_DEPENDENT),
    Nat(NatClass.ORDINARY, filtering=Behaviour.ADDRESS_AND_PORT_DEPENDENT),
    Nat(NatClass.RESTRICTIVE),
]


def member(i: int, nat: Nat | None, rtt_ms: float | None, pairs=None) -> DeviceReport:
    return DeviceReport(
        f"m{i}", 10**10, nat=nat, rtt_s=None if rtt_ms is None else rtt_ms / 1e3, pair_rtt_s=pairs or {}
    )


@st.composite
def rtt_fleets(draw, max_m=7):
    m = draw(st.integers(2, max_m))
    devices = []
    for i in range(m):
        pairs = {}
        if i and draw(st.booleans()) and draw(st.booleans()):
            pairs[f"m{draw(st.integers(0, i - 1))}"] = draw(st.integers(1, 200)) / 1e3
        rtt = draw(st.integers(5, 120))  # whole ms, so equal rings tie exactly
        devices.append(member(i, draw(st.sampled_from([*NATS, None])), rtt, pairs))
    return devices, draw(st.sampled_from([PAPER_RULE, LINUX_RULE]))


def brute_force_key(prices: RingPrices, m: int) -> int:
    return min(prices.ring(p) for p in itertools.permutations(range(m)))


@settings(max_examples=150, deadline=None)
@given(rtt_fleets())
def test_exhaustive_ordering_equals_brute_force_over_permutations(case):
    devices, rule = case
    ring = order_ring(devices, rule, anchor=0)
    assert ring.method == "rtt-exhaustive" and ring.order[0] == 0
    assert sorted(ring.order) == list(range(len(devices)))
    prices = RingPrices(devices, rule)
    assert prices.ring(ring.order) == brute_force_key(prices, len(devices))


def test_all_relayed_ring_breaks_ties_on_separation():
    # every edge relays, so every ordering prices at 2 * sum(r); separation keeps near members adjacent
    rtts = [10, 100, 11, 101, 12]
    devices = [member(i, Nat(NatClass.RESTRICTIVE), r) for i, r in enumerate(rtts)]
    ring = order_ring(devices, LINUX_RULE)
    assert ring.relayed == 5
    assert abs(ring.cost_s - 2 * sum(rtts) / 1e3) < 1e-9
    assert abs(ring.separation_s - 2 * (101 - 10) / 1e3) < 1e-9  # the minimum: one far hop each way
    neighbours = {frozenset((ring.order[i], ring.order[(i + 1) % 5])) for i in range(5)}
    assert frozenset((1, 3)) in neighbours  # the two far members sit together


def test_relayed_edge_costs_the_sum_and_direct_the_difference():
    a = member(0, Nat(NatClass.RESTRICTIVE), 80)
    b = member(1, Nat(NatClass.RESTRICTIVE), 100)
    c = member(2, Nat(NatClass.PERMISSIVE), 30)
    ring = describe([a, b, c], (0, 1, 2), "test", LINUX_RULE)
    assert ring.relayed == 1
    assert abs(ring.cost_s - (0.180 + 0.070 + 0.050)) < 1e-9


def test_measured_pair_rtt_prices_the_edge_and_counts_as_direct():
    a = member(0, Nat(NatClass.RESTRICTIVE), 80, {"m1": 0.002})
    b = member(1, Nat(NatClass.RESTRICTIVE), 82)
    ring = describe([a, b], (0, 1), "test", LINUX_RULE)
    assert ring.relayed == 0 and abs(ring.cost_s - 0.004) < 1e-12


@st.composite
def nat_fleets(draw):
    m = draw(st.integers(2, 7))
    nats = draw(st.lists(st.sampled_from(NATS), min_size=m, max_size=m))
    return [member(i, n, None) for i, n in enumerate(nats)], draw(st.sampled_from([PAPER_RULE, LINUX_RULE]))


def relays(devices, order, rule) -> int:
    return sum(not rule(devices[a].nat, devices[b].nat) for a, b in ring_edges(order))


@settings(max_examples=120, deadline=None)
@given(nat_fleets(), st.integers(0, 6))
def test_counting_rule_reaches_the_fewest_relayed_edges(case, anchor):
    devices, rule = case
    anchor %= len(devices)
    order = alternate(devices, rule, anchor)
    assert order[0] == anchor and sorted(order) == list(range(len(devices)))
    best = min(relays(devices, p, rule) for p in itertools.permutations(range(len(devices))))
    assert relays(devices, order, rule) == best


def test_counting_rule_all_direct_iff_permissive_alternate_with_restrictive():
    p, r = Nat(NatClass.PERMISSIVE), Nat(NatClass.RESTRICTIVE)
    fleet = [member(i, n, None) for i, n in enumerate([r, r, p, r, p, p])]
    assert order_ring(fleet, PAPER_RULE).relayed == 0
    fleet = [member(i, n, None) for i, n in enumerate([r, r, p, r, p])]
    assert order_ring(fleet, PAPER_RULE).relayed == 1
    assert order_ring(fleet, PAPER_RULE).method == "counting"


@settings(max_examples=10, deadline=None)
@given(
    st.lists(st.integers(5, 150), min_size=7, max_size=7),
    st.lists(st.sampled_from(NATS), min_size=7, max_size=7),
)
def test_heuristic_within_twice_the_optimum_when_prices_are_alike_and_bounded_always(rtts, nats):
    for nat_list in (nats, [NATS[0]] * 7, [NATS[3]] * 7):  # mixed; all direct; all relayed (metrics)
        devices = [member(i, n, r) for i, (n, r) in enumerate(zip(nat_list, rtts, strict=True))]
        prices = RingPrices(devices, LINUX_RULE)
        tour = two_opt(prices, cheapest_insertion(prices, 7, 0))
        assert tour[0] == 0
        cost, best = prices.ring(tour) // prices.big, brute_force_key(prices, 7) // prices.big
        assert one_tree_bound(prices, 7) <= best <= cost
        if nat_list is not nats:
            assert cost <= 2 * best


def test_large_fleet_uses_the_heuristic():
    devices = [member(i, NATS[i % 4], 10 + 7 * i) for i in range(12)]
    ring = order_ring(devices, LINUX_RULE, anchor=3)
    assert ring.method == "rtt-heuristic" and ring.order[0] == 3 and len(set(ring.order)) == 12
    assert ring.bound_ratio is not None and ring.bound_ratio >= 1.0
