"""Ring order (Section V-B).

Every member's NAT class predicts each pair direct or relayed through a pair rule (a parameter).
- Counting rule (some member lacks a rendezvous RTT): a closed-form alternation. Members that relay
  with their own kind ("needy": restrictive, and ordinary under the paper rule) are interleaved with
  members predicted direct to them ("helpers"); spare helpers close the ring. For rules where every
  helper is direct with every needy member (both shipped rules) this minimises relayed edges; the
  tests check it against brute force.
- RTT pricing (every member measured r to the rendezvous): relayed edge A-B costs r_A + r_B (the
  literal path), direct |r_A - r_B| (triangle-inequality lower bound) or a measured pair RTT.
  Orderings are searched exhaustively with the anchor fixed (and mirror images skipped) up to
  EXHAUSTIVE_MAX members; ties break on ring separation (sum of |r_A - r_B| around the ring).
  Above that: cheapest insertion then 2-opt. Stated bound: when every edge is priced alike (all
  predicted direct, or all relayed) the prices are a metric and cheapest insertion is within 2x of
  the cheapest ring (Rosenkrantz, Stearns and Lewis, 1977); 2-opt only lowers it. Mixed direct and
  relayed prices are not a metric (A-C relayed can cost more than A-B-C direct), so every heuristic
  ring also carries a certified ratio to a lower bound on any ring: the best 1-tree (minimum
  spanning tree of all members but one, plus that member's two cheapest edges):
  `RingOrder.bound_ratio`.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

from kafila.planner.devices import DeviceReport
from kafila.planner.reachability import DEFAULT_RULE, Nat, PairRule

EXHAUSTIVE_MAX = 9
_NS = 1e9  # prices are compared as integer nanoseconds so equal sums tie exactly


@dataclass(frozen=True)
class RingOrder:
    order: tuple[int, ...]  # device indices; order[0] is the anchor
    method: str  # "single" | "counting" | "rtt-exhaustive" | "rtt-heuristic"
    relayed: int  # edges predicted relayed
    cost_s: float | None  # sum of edge prices (RTT) when every member has an rtt
    separation_s: float | None
    bound_ratio: float | None = None  # heuristic only: cost / (lower bound on any ring's cost)


def nat_of(d: DeviceReport) -> Nat:
    return Nat.of(d.nat)


def predicted_direct(a: DeviceReport, b: DeviceReport, rule: PairRule) -> bool:
    """A measured failure to punch means relayed; a measured pair RTT means the two already reached
    each other directly; otherwise the NAT classes decide."""
    if b.name in a.relayed_with or a.name in b.relayed_with:
        return False
    if b.name in a.pair_rtt_s or a.name in b.pair_rtt_s:
        return True
    return rule(nat_of(a), nat_of(b))


def edge_price_s(a: DeviceReport, b: DeviceReport, direct: bool) -> float | None:
    """Round-trip price of an edge, or None when an rtt is missing."""
    measured = a.pair_rtt_s.get(b.name, b.pair_rtt_s.get(a.name))
    if measured is not None:
        return measured
    if a.rtt_s is None or b.rtt_s is None:
        return None
    return abs(a.rtt_s - b.rtt_s) if direct else a.rtt_s + b.rtt_s


def ring_edges(order: Sequence[int]) -> list[tuple[int, int]]:
    m = len(order)
    return [] if m < 2 else [(order[i], order[(i + 1) % m]) for i in range(m)]


class RingPrices:
    """Integer-ns price and separation matrices for the RTT search."""

    def __init__(self, devices: Sequence[DeviceReport], rule: PairRule) -> None:
        m = len(devices)
        self.key = [[0] * m for _ in range(m)]
        self.big = 1 << 48  # separation sums stay far below this, so key orders (price, sep)
        for i, j in itertools.permutations(range(m), 2):
            a, b = devices[i], devices[j]
            price = edge_price_s(a, b, predicted_direct(a, b, rule))
            assert price is not None and a.rtt_s is not None and b.rtt_s is not None
            sep = round(abs(a.rtt_s - b.rtt_s) * _NS)
            self.key[i][j] = round(price * _NS) * self.big + sep

    def ring(self, order: Sequence[int]) -> int:
        return sum(self.key[a][b] for a, b in ring_edges(order))


def order_ring(devices: Sequence[DeviceReport], rule: PairRule = DEFAULT_RULE, anchor: int = 0) -> RingOrder:
    """The ring order, anchor first, by RTT pricing if every member has an rtt, else by counting."""
    m = len(devices)
    if m == 1:
        return RingOrder((0,), "single", 0, None, None)
    if all(d.rtt_s is not None for d in devices):
        prices = RingPrices(devices, rule)
        if m <= EXHAUSTIVE_MAX:
            order, method = exhaustive(prices, m, anchor), "rtt-exhaustive"
        else:
            order = two_opt(prices, cheapest_insertion(prices, m, anchor))
            found = describe(devices, order, "rtt-heuristic", rule)
            bound = one_tree_bound(prices, m)
            ratio = (prices.ring(order) // prices.big) / bound if bound else 1.0
            return replace(found, bound_ratio=ratio)
    else:
        order, method = alternate(devices, rule, anchor), "counting"
    return describe(devices, order, method, rule)


def one_tree_bound(prices: RingPrices, m: int) -> int:
    """A lower bound (integer ns) on any ring's price, the best 1-tree over the left-out member: a
    ring is a path through the others (at least their minimum spanning tree) plus two edges at it."""
    price = [[prices.key[i][j] // prices.big for j in range(m)] for i in range(m)]
    best = 0
    for v in range(m):
        rest = [i for i in range(m) if i != v]
        two = sorted(price[v][j] for j in rest)[:2]
        best = max(best, _mst(price, rest) + sum(two))
    return best


def _mst(price: list[list[int]], nodes: list[int]) -> int:
    """Prim's algorithm over `nodes` (O(n^2))."""
    if len(nodes) < 2:
        return 0
    dist = {n: price[nodes[0]][n] for n in nodes[1:]}
    total = 0
    while dist:
        n = min(dist, key=dist.__getitem__)
        total += dist.pop(n)
        for o in dist:
            dist[o] = min(dist[o], price[n][o])
    return total


def describe(devices: Sequence[DeviceReport], order: Sequence[int], method: str, rule: PairRule) -> RingOrder:
    relayed, cost, sep = 0, 0.0, 0.0
    priced = all(d.rtt_s is not None for d in devices) or len(order) < 2
    for i, j in ring_edges(order):
        direct = predicted_direct(devices[i], devices[j], rule)
        relayed += not direct
        if priced:
            cost += edge_price_s(devices[i], devices[j], direct) or 0.0
            sep += abs((devices[i].rtt_s or 0.0) - (devices[j].rtt_s or 0.0))
    return RingOrder(tuple(order), method, relayed, cost if priced else None, sep if priced else None)


def exhaustive(prices: RingPrices, m: int, anchor: int) -> tuple[int, ...]:
    """Every ordering with the anchor first; a ring and its mirror image cost the same, so only
    orderings whose second member precedes their last (by index) are priced."""
    others = [i for i in range(m) if i != anchor]
    best, best_key = (anchor, *others), None
    for perm in itertools.permutations(others):
        if len(perm) > 1 and perm[0] > perm[-1]:
            continue
        order = (anchor, *perm)
        key = prices.ring(order)
        if best_key is None or key < best_key:
            best, best_key = order, key
    return best


def cheapest_insertion(prices: RingPrices, m: int, anchor: int) -> list[int]:
    key = prices.key
    tour = [anchor]
    rest = [i for i in range(m) if i != anchor]
    while rest:
        best = None
        for c in rest:
            for p in range(len(tour)):
                a, b = tour[p], tour[(p + 1) % len(tour)]
                delta = key[a][c] + key[c][b] - (key[a][b] if len(tour) > 1 else 0)
                if best is None or delta < best[0]:
                    best = (delta, c, p + 1)
        assert best is not None
        tour.insert(best[2], best[1])
        rest.remove(best[1])
    return tour


def two_opt(prices: RingPrices, tour: list[int]) -> tuple[int, ...]:
    """Reverse segments (never moving position 0) while that lowers the ring's key."""
    best = prices.ring(tour)
    improved = True
    while improved:
        improved = False
        for i in range(1, len(tour) - 1):
            for j in range(i + 1, len(tour)):
                cand = tour[:i] + tour[i : j + 1][::-1] + tour[j + 1 :]
                key = prices.ring(cand)
                if key < best:
                    tour, best, improved = cand, key, True
    return tuple(tour)


def alternate(devices: Sequence[DeviceReport], rule: PairRule, anchor: int = 0) -> tuple[int, ...]:
    """The counting rule: needy members each followed by a helper, then the rest with a spare helper
    last (it closes the ring to the first needy member), then needy members left without a helper."""
    m = len(devices)
    direct = [[predicted_direct(devices[i], devices[j], rule) for j in range(m)] for i in range(m)]
    needy = [i for i in range(m) if not rule(nat_of(devices[i]), nat_of(devices[i]))]
    helpers = [i for i in range(m) if i not in needy]
    # most constrained first: needy members with the fewest helpers, helpers serving the fewest
    needy.sort(key=lambda n: sum(direct[n][h] for h in helpers))
    helpers.sort(key=lambda h: sum(direct[h][n] for n in needy))
    seq, unpaired = [], []
    for n in needy:
        h = next((h for h in helpers if direct[n][h]), None)
        if h is None:
            unpaired.append(n)
            continue
        helpers.remove(h)
        seq += [n, h]
    if seq and helpers:  # a spare helper direct to the first needy member closes the ring
        closer = next((h for h in helpers if direct[h][seq[0]]), None)
        if closer is not None:
            helpers.remove(closer)
            helpers.append(closer)
    ring = seq + helpers + unpaired
    start = ring.index(anchor)
    return tuple(ring[start:] + ring[:start])
