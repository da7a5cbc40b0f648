"""Head placement equals brute force over rotations, with the anchor kept within mu."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.planner.cost import DeviceCost
from kafila.planner.head import MU, HeadChoice, place_head
from kafila.planner.partition import Infeasible
from tests.planner.test_partition import brute_force


def rotation_optimum(k, costs, r):
    m = len(costs)
    chain = [costs[(r + j) % m] for j in range(m)]
    return brute_force(
        k,
        [c.fixed(j == 0) for j, c in enumerate(chain)],
        [c.per_block_s for c in chain],
        [c.lim(j == 0) for j, c in enumerate(chain)],
    )


def expected_head(k, costs, anchor, mu):
    taus = [rotation_optimum(k, costs, r) for r in range(len(costs))]
    feasible = [(t, r) for r, t in enumerate(taus) if t is not None]
    if not feasible:
        return None
    best_tau, best_r = min(feasible)
    if taus[anchor] is not None and not best_tau < taus[anchor] * (1 - mu):
        return anchor, taus[anchor]
    return best_r, best_tau


@st.composite
def fleets(draw, max_m: int = 4, max_k: int = 9):
    """k blocks and m devices with random costs and (head) block limits, infeasible ones included."""
    m = draw(st.integers(1, max_m))
    k = draw(st.integers(m, max_k))
    costs = []
    for i in range(m):
        limit = draw(st.integers(0, k))
        costs.append(
            DeviceCost(
                name=f"d{i}",
                overhead_s=draw(st.floats(0.0, 1.0)),
                per_block_s=draw(st.floats(0.05, 3.0)),
                head_s=draw(st.floats(0.0, 3.0)),
                limit=limit,
                limit_head=draw(st.integers(0, limit)),
            )
        )
    return k, costs


@st.composite
def fleets_with_anchor(draw):
    k, costs = draw(fleets())
    return k, costs, draw(st.integers(0, len(costs) - 1))


@settings(max_examples=200, deadline=None)
@given(fleets_with_anchor())
def test_head_placement_equals_brute_force_over_rotations(case):
    k, costs, anchor = case
    expected = expected_head(k, costs, anchor, MU)
    got = place_head(k, costs, anchor=anchor)
    if expected is None:
        assert isinstance(got, Infeasible)
        return
    assert isinstance(got, HeadChoice)
    assert abs(got.bottleneck - expected[1]) <= 1e-9 * max(1.0, expected[1])
    if got.head != expected[0]:  # only an equal-cost rotation may differ
        assert abs(rotation_optimum(k, costs, got.head) - expected[1]) <= 1e-9 * max(1.0, expected[1])
    head_cost = costs[got.head]
    assert got.counts[got.head] <= head_cost.limit_head


def dev(name, per, head_s=0.1, limit=10, limit_head=10, overhead=0.0):
    return DeviceCost(name, overhead, per, head_s, limit, limit_head)


def test_anchor_kept_when_another_head_is_better_by_less_than_mu():
    # identical devices except a slightly cheaper head read on d1: under 5% better, anchor stays
    costs = [dev("d0", 1.0, head_s=0.30), dev("d1", 1.0, head_s=0.29)]
    got = place_head(10, costs, anchor=0)
    assert isinstance(got, HeadChoice) and got.head == 0


def test_head_moves_when_the_anchor_cannot_hold_it():
    costs = [dev("d0", 1.0, limit=10, limit_head=0), dev("d1", 1.0)]
    got = place_head(6, costs, anchor=0)
    assert isinstance(got, HeadChoice) and got.head == 1
    assert got.counts[0] >= 1 and sum(got.counts) == 6


def test_head_moves_when_another_rotation_is_much_better():
    costs = [dev("slow", 1.0, head_s=5.0), dev("fast", 1.0, head_s=0.5)]
    got = place_head(4, costs, anchor=0)
    assert isinstance(got, HeadChoice) and got.head == 1
