"""PARTITION (Algorithm 1) against a brute-force optimum over every composition of the blocks."""

from __future__ import annotations

import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.planner.partition import Infeasible, Partition, feasible, partition


def compositions(k: int, m: int):
    """Every way of giving k blocks to m devices in order, at least one each."""
    for cuts in itertools.combinations(range(1, k), m - 1):
        bounds = (0, *cuts, k)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(m))


def brute_force(k, fixed, per, lim):
    best = None
    for counts in compositions(k, len(fixed)):
        if any(n > lim_i for n, lim_i in zip(counts, lim, strict=True)):
            continue
        tau = max(f + n * p for f, p, n in zip(fixed, per, counts, strict=True))
        best = tau if best is None else min(best, tau)
    return best


@st.composite
def instances(draw):
    m = draw(st.integers(1, 5))
    k = draw(st.integers(1, 11))
    cost = st.floats(0.0, 5.0, allow_nan=False, allow_infinity=False)
    fixed = draw(st.lists(cost, min_size=m, max_size=m))
    per = draw(st.lists(st.floats(0.01, 5.0), min_size=m, max_size=m))
    lim = draw(st.lists(st.integers(0, k + 1), min_size=m, max_size=m))
    return k, fixed, per, lim


@settings(max_examples=600, deadline=None)
@given(instances())
def test_partition_equals_brute_force_optimum(inst):
    k, fixed, per, lim = inst
    expected = brute_force(k, fixed, per, lim)
    got = partition(k, fixed, per, lim)
    if expected is None:
        assert isinstance(got, Infeasible)
        return
    assert isinstance(got, Partition)
    assert abs(got.bottleneck - expected) <= 1e-9 * max(1.0, expected)
    assert sum(got.counts) == k
    assert all(1 <= n <= lim_i for n, lim_i in zip(got.counts, lim, strict=True))
    assert max(f + n * p for f, p, n in zip(fixed, per, got.counts, strict=True)) == got.bottleneck


def test_integer_candidates_do_not_lose_a_block_to_rounding():
    # 0.1 + 3 * 0.1 is 0.30000000000000004 > 0.3: the bound must still give back 3 blocks
    assert feasible(3, 0.1 + 3 * 0.1, [0.1], [0.1], [5]) == (3,)
    got = partition(7, [0.1, 0.2], [0.1, 0.3], [10, 10])
    assert isinstance(got, Partition)
    assert got.counts == (6, 1) and abs(got.bottleneck - 0.7) < 1e-12


def test_faster_device_gets_more_blocks():
    got = partition(12, [0.0, 0.0, 0.0], [1.0, 2.0, 4.0], [12, 12, 12])
    assert isinstance(got, Partition)
    assert got.bottleneck == 8.0  # e.g. (7, 3, 2) or the greedy's front-loaded (8, 3, 1)
    assert got.counts[0] > got.counts[1] >= got.counts[2]


def test_more_devices_than_blocks_is_refused_with_the_numbers():
    got = partition(2, [0.0] * 3, [1.0] * 3, [5] * 3)
    assert isinstance(got, Infeasible)
    assert "3 devices" in got.reason and "2 blocks" in got.reason


def test_limits_that_cannot_hold_the_model_are_refused():
    got = partition(10, [0.0, 0.0], [1.0, 1.0], [4, 5])
    assert isinstance(got, Infeasible)
    assert "9 of 10" in got.reason
