"""The division for the declared load equals brute force, reduces to PARTITION when the pipeline is
full, and moves blocks onto fast devices when one request cannot keep the stages busy."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, plan
from kafila.planner.cost import DeviceCost
from kafila.planner.head import place_head
from kafila.planner.load import LoadChoice, divide_for_load, shortest_circuit
from kafila.planner.partition import Infeasible
from tests.planner.test_head import fleets
from tests.planner.test_partition import compositions


def brute_force(k, costs, u, latency):
    """Smallest max(bottleneck, circuit / u) over every head and every division."""
    m, best = len(costs), math.inf
    for head in range(m):
        chain = [costs[(head + j) % m] for j in range(m)]
        for counts in compositions(k, m):
            if any(n > c.lim(j == 0) for j, (c, n) in enumerate(zip(chain, counts, strict=True))):
                continue
            stages = [c.stage_s(n, j == 0) for j, (c, n) in enumerate(zip(chain, counts, strict=True))]
            best = min(best, max(max(stages), (sum(stages) + latency) / u))
    return None if best == math.inf else best


@settings(max_examples=300, deadline=None)
@given(fleets(), st.integers(1, 6), st.floats(0.0, 3.0))
def test_divide_for_load_equals_brute_force(fleet, u, latency):
    k, costs = fleet
    got = divide_for_load(k, costs, concurrency=u, latency_s=latency, heads=range(len(costs)), anchor=0, mu=0)
    want = brute_force(k, costs, u, latency)
    if want is None:
        assert isinstance(got, Infeasible)
        return
    assert isinstance(got, LoadChoice)
    assert got.per_token_s == pytest.approx(want, rel=1e-9)
    assert sum(got.counts) == k and min(got.counts) >= 1
    chain = [(got.head + j) % len(costs) for j in range(len(costs))]
    stages = [costs[i].stage_s(got.counts[i], i == got.head) for i in chain]
    assert got.bottleneck_s == pytest.approx(max(stages))
    assert got.circuit_s == pytest.approx(sum(stages) + latency)
    assert all(got.counts[i] <= costs[i].lim(i == got.head) for i in chain)


@settings(max_examples=200, deadline=None)
@given(fleets())
def test_with_the_pipeline_full_the_division_has_partitions_bottleneck(fleet):
    k, costs = fleet
    heads = range(len(costs))
    full = divide_for_load(k, costs, concurrency=10**9, latency_s=0.0, heads=heads, anchor=0, mu=0)
    paper = place_head(k, costs, anchor=0, mu=0)
    assert isinstance(full, Infeasible) == isinstance(paper, Infeasible)
    if isinstance(full, LoadChoice):
        assert full.bottleneck_s == pytest.approx(paper.bottleneck)  # type: ignore[union-attr]
        assert not full.circuit_bound


def shares_fleet(k: int = 30) -> list[DeviceCost]:
    """Costs shaped like the benchmarks' CPU shares 1 : 0.5 : 0.25 (1.2 ms a block at share 1, the
    head about eight blocks): a stage costs (fixed + n * per) / share."""
    return [
        DeviceCost(name, 1e-3 / s, 1.2e-3 / s, 7.4e-3 / s, k, k)
        for name, s in (("alpha", 1.0), ("beta", 0.5), ("gamma", 0.25))
    ]


def test_one_request_moves_blocks_onto_the_fast_member_and_four_balance_the_stages():
    costs = shares_fleet()
    kw = {"latency_s": 0.009, "heads": range(3), "anchor": 0}
    fastest = divide_for_load(30, costs, concurrency=1, mu=0, **kw)
    one = divide_for_load(30, costs, concurrency=1, mu=0.05, **kw)
    four = divide_for_load(30, costs, concurrency=4, mu=0.05, **kw)
    assert isinstance(fastest, LoadChoice) and isinstance(one, LoadChoice) and isinstance(four, LoadChoice)
    assert fastest.counts == (28, 1, 1)  # each slow member keeps the one block every member holds
    # within mu (5%) of the shortest circuit, the most even division: beta takes two more blocks
    assert one.counts == (26, 3, 1) and one.bottleneck_s < fastest.bottleneck_s
    assert fastest.circuit_s < one.circuit_s <= fastest.circuit_s * 1.05
    assert one.head == four.head == 0
    assert one.circuit_bound and not four.circuit_bound
    assert four.bottleneck_s == pytest.approx(four.tau_star_s)
    assert one.circuit_s < 0.8 * four.circuit_s  # what one user waits for per token
    assert four.bottleneck_s < 0.7 * one.bottleneck_s  # what four users queue behind
    assert max(four.counts) - min(four.counts) > 5  # balanced stages, not balanced blocks


def test_equal_members_stay_even_for_one_request_despite_probe_noise():
    """Per-block costs 1% apart: piling blocks on the cheapest would shorten the circuit by well under
    1%, inside the probe's noise, so the division stays even."""
    per = {"a": 1.2e-3, "b": 1.19e-3, "c": 1.21e-3}
    costs = [DeviceCost(n, 1e-3, p, 7.4e-3, 30, 30) for n, p in per.items()]
    got = divide_for_load(30, costs, concurrency=1, latency_s=0.009, heads=range(3), anchor=0, mu=0.05)
    assert isinstance(got, LoadChoice) and not got.circuit_bound
    assert got.bottleneck_s == pytest.approx(got.tau_star_s)


def test_the_fast_member_fills_only_to_its_block_limit():
    costs = [DeviceCost("alpha", 1e-3, 1.2e-3, 7.4e-3, 12, 10), *shares_fleet()[1:]]
    got = divide_for_load(30, costs, concurrency=1, latency_s=0.0, heads=[0], anchor=0, mu=0)
    assert isinstance(got, LoadChoice)
    assert got.counts[0] == 10  # its head limit; the rest goes to beta, the next cheapest per block
    assert got.counts == (10, 19, 1)


def test_shortest_circuit_keeps_every_stage_within_the_bound():
    fixed, per, lim = [1.0, 0.0, 0.0], [1.0, 2.0, 4.0], [10, 10, 10]
    assert shortest_circuit(12, 9.0, fixed, per, lim) == (8, 3, 1)  # 9 / 6 / 4
    assert shortest_circuit(12, 7.0, fixed, per, lim) is None  # 6 + 3 + 1 = 10 < 12 blocks fit
    assert shortest_circuit(3, 0.5, fixed, per, lim) is None  # alpha's fixed cost alone exceeds it


def test_the_plan_names_the_trade_when_one_request_cannot_fill_the_ring():
    qwen = resolve_manifest("qwen3-8b")
    fleet = [
        DeviceReport("fast", 40 * 10**9, 400e9, overhead_s=1e-4),
        DeviceReport("mid", 40 * 10**9, 200e9, overhead_s=1e-4),
        DeviceReport("slow", 40 * 10**9, 100e9, overhead_s=1e-4),
    ]
    one = plan(fleet, qwen, context=4096, concurrency=1)
    many = plan(fleet, qwen, context=4096, concurrency=3)
    paper = plan(fleet, qwen, context=4096, concurrency=1, objective="bottleneck")
    assert one.blocks()["slow"] == 1 and one.blocks()["mid"] <= 3 and one.blocks()["fast"] >= 32
    assert one.circuit_s < paper.circuit_s and one.bottleneck_s > paper.bottleneck_s
    assert one.per_token_s == pytest.approx(one.circuit_s)
    assert any("1 request in flight cannot keep 3 stages busy" in n for n in one.notes)
    assert many.bottleneck_s == pytest.approx(paper.bottleneck_s)
    assert not any("in flight" in n for n in many.notes)
    with pytest.raises(ValueError, match="unknown objective 'fastest'"):
        plan(fleet, qwen, context=4096, objective="fastest")
