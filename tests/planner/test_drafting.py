"""What a circuit yields with speculative decoding, in the plan's figures (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, Plan, plan
from kafila.planner.decide import measured, with_yield
from kafila.planner.drafting import MIN_CIRCUITS, MIN_TIMED, CircuitCounts, CircuitYield, figures

GB = 10**9
PAIR_RTT_S = 0.040  # three homes 20 ms apart one way


def test_plain_decoding_is_one_token_per_circuit_of_one_row_steps() -> None:
    f = figures([0.010, 0.012, 0.008], [0.020, 0.020, 0.020], 1, CircuitYield())
    assert f.circuit_s == pytest.approx(0.090) and f.bottleneck_s == pytest.approx(0.012)
    assert f.tokens_s == pytest.approx(1 / 0.090) and f.per_token_s == pytest.approx(0.090)


def test_a_wan_rings_token_time_falls_by_nearly_the_tokens_per_circuit() -> None:
    """20 ms edges, 10 ms stages, 2.5 tokens from 5 rows per circuit, each extra row 5% of a step:
    a step of 12 ms, a circuit of 96 ms, 38.4 ms a token against 90 plain."""
    y = CircuitYield(tokens=2.5, rows=5.0, row_share=0.05)
    f = figures([0.010] * 3, [0.020] * 3, 1, y)
    assert f.bottleneck_s == pytest.approx(0.012) and f.circuit_s == pytest.approx(0.096)
    assert f.per_token_s == pytest.approx(0.0384) and f.tokens_s == pytest.approx(2.5 / 0.096)


def test_many_users_are_bound_by_the_slowest_stages_rows() -> None:
    y = CircuitYield(tokens=2.0, rows=4.0, row_share=0.5)  # each row half a step: 2.5 steps a circuit
    f = figures([0.010, 0.020], [0.001, 0.001], 8, y)
    assert f.per_token_s == pytest.approx(0.050 / 2)  # the 20 ms stage's 50 ms step, over 2 tokens


@settings(deadline=None)  # a loaded machine may take over 200 ms for one example
@given(
    st.floats(1.0, 9.0),
    st.floats(0.0, 8.0),
    st.floats(0.0, 1.0),
    st.lists(st.floats(1e-4, 0.1), min_size=1, max_size=6),
    st.floats(0.0, 0.1),
    st.integers(1, 8),
)
def test_more_tokens_from_the_same_rows_never_predict_a_slower_token(
    tokens: float, more: float, share: float, stage_s: list[float], latency: float, users: int
) -> None:
    rows = tokens + more
    edges = [latency] * len(stage_s)
    base = figures(stage_s, edges, users, CircuitYield(tokens, rows, share))
    better = figures(stage_s, edges, users, CircuitYield(min(tokens + 0.5, rows), rows, share))
    assert better.per_token_s <= base.per_token_s * (1 + 1e-12)
    assert base.circuit_s >= sum(stage_s) + sum(edges) - 1e-12  # extra rows never shorten a circuit


def test_a_heads_counts_give_the_yield() -> None:
    y = CircuitYield.measured(circuits=20, drafted=60, accepted=30, row_share=0.04)
    assert (y.tokens, y.rows, y.row_share) == (2.5, 4.0, 0.04)
    assert CircuitYield.measured(0, 0, 0, 0.04) == CircuitYield()  # nothing decoded yet: plain
    with pytest.raises(ValueError, match="accepted 5 of 4 drafted tokens"):
        CircuitYield.measured(3, 4, 5, 0.0)


@pytest.mark.parametrize(
    ("tokens", "rows", "share"),
    [(0.5, 1.0, 0.0), (3.0, 2.0, 0.0), (1.0, 1.0, -0.1), (float("nan"), 2.0, 0.0)],
)
def test_a_yield_that_cannot_be_is_refused_by_its_numbers(tokens: float, rows: float, share: float) -> None:
    with pytest.raises(ValueError, match=f"1 <= tokens {tokens} <= rows {rows}"):
        CircuitYield(tokens, rows, share)


def test_a_plans_token_time_reflects_what_its_circuits_yield() -> None:
    """A three-home ring planned as usual, then priced for a drafting head: the division stays,
    the circuit grows by the extra rows, the token time falls by the tokens per circuit; the
    figures survive the plan's JSON round trip."""
    names = ("a", "b", "c")
    fleet = [
        DeviceReport(n, 16 * GB, 50e9, pair_rtt_s={m: PAIR_RTT_S for m in names if m != n}) for n in names
    ]
    p = plan(fleet, resolve_manifest("qwen3-8b"), context=2048)
    assert p.feasible and p.network_priced and p.tokens_per_circuit == 1.0
    assert p.circuit_s is not None and p.per_token_s == pytest.approx(p.circuit_s)  # one user: the circuit
    y = CircuitYield(tokens=2.4, rows=6.0, row_share=0.02)
    d = with_yield(p, y)
    assert d.blocks() == p.blocks() and d.order == p.order
    stages = sum(s.cost_s for s in p.stages if s.cost_s is not None)
    assert d.circuit_s == pytest.approx(p.circuit_s + stages * 5 * 0.02)
    assert d.per_token_s == pytest.approx(d.circuit_s / 2.4) and d.tokens_s == pytest.approx(
        2.4 / d.circuit_s
    )
    assert d.per_token_s < p.per_token_s / 2
    assert Plan.from_json(d.to_json()) == d and d.circuit_yield == y
    assert d.summary()["tokens_per_circuit"] == 2.4
    assert with_yield(d, CircuitYield()) == p  # back to plain: the plain figures


def three_homes() -> Plan:
    names = ("a", "b", "c")
    fleet = [
        DeviceReport(n, 16 * GB, 50e9, pair_rtt_s={m: PAIR_RTT_S for m in names if m != n}) for n in names
    ]
    p = plan(fleet, resolve_manifest("qwen3-8b"), context=2048)
    assert p.feasible
    return p


def test_a_heads_circuits_count_what_they_carried_and_time_the_rows_they_carried_alone() -> None:
    """One-row circuits of 30 ms of compute, circuits of 4 drafted rows of 36 ms: each drafted row
    added 1.5 ms, 5% of a one-row circuit; circuits shared with other requests are counted, not
    timed."""
    c = CircuitCounts()
    for _ in range(MIN_TIMED):
        c = c.add(0, 0, 0.030).add(4, 2, 0.036).add(4, 4, None)
    assert (c.circuits, c.drafted, c.accepted) == (3 * MIN_TIMED, 8 * MIN_TIMED, 6 * MIN_TIMED)
    assert c.row_share() == pytest.approx(0.05)
    y = c.circuit_yield(assumed_share=0.5)
    assert y == CircuitYield.measured(c.circuits, c.drafted, c.accepted, c.row_share() or 0.0)
    with pytest.raises(ValueError, match="a circuit kept 3 of 2 drafted tokens"):
        c.add(2, 3)


def test_the_row_share_is_assumed_until_both_kinds_of_circuit_were_timed() -> None:
    c = CircuitCounts()
    for _ in range(MIN_TIMED):
        c = c.add(0, 0, 0.030)
    for _ in range(MIN_TIMED - 1):
        c = c.add(3, 3, 0.040)
    assert c.row_share() is None and c.circuit_yield(0.07).row_share == 0.07
    assert c.add(3, 1, 0.040).row_share() == pytest.approx(1 / 9)  # 10 ms over 3 rows of a 30 ms circuit
    assert c.add(3, 1, 0.020).row_share() is not None  # noise below the one-row mean: never below 0
    faster = CircuitCounts()
    for _ in range(MIN_TIMED):
        faster = faster.add(0, 0, 0.030).add(2, 2, 0.010)
    assert faster.row_share() == 0.0


@settings(deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 8), st.integers(0, 8), st.booleans()), max_size=60),
    st.floats(0.001, 0.1),
    st.floats(0.0, 0.5),
)
def test_counted_circuits_give_the_yield_of_their_totals_and_recover_a_true_row_share(
    circuits: list[tuple[int, int, bool]], one_row_s: float, share: float
) -> None:
    """Each circuit of d drafted rows timed at one_row_s x (1 + d x share): the counts give
    CircuitYield.measured of their totals, with that share once both kinds were timed enough."""
    c = CircuitCounts()
    for drafted, kept, timed in circuits:
        kept = min(kept, drafted)
        c = c.add(drafted, kept, one_row_s * (1 + drafted * share) if timed else None)
    if not any(d for d, _, _ in circuits):  # nothing decoded, or no row drafted: plain decoding
        assert c.circuit_yield(0.3) == CircuitYield()
        return
    timed_one = sum(1 for d, _, t in circuits if t and d == 0)
    timed_more = sum(1 for d, _, t in circuits if t and d > 0)
    assert (c.one_row, c.more_rows) == (timed_one, timed_more)
    want = share if timed_one >= MIN_TIMED and timed_more >= MIN_TIMED else 0.3
    assert c.circuit_yield(0.3).row_share == pytest.approx(want, abs=1e-9)
    drafted = sum(d for d, _, _ in circuits)
    accepted = sum(min(k, d) for d, k, _ in circuits)
    assert c.circuit_yield(0.3).tokens == CircuitYield.measured(len(circuits), drafted, accepted, want).tokens


def test_a_plan_is_priced_for_a_heads_counts_once_it_counted_enough_circuits() -> None:
    """Plain figures until MIN_CIRCUITS circuits, then the measured yield's; a plan priced
    before for another yield gets the current one (plain, below the threshold); plain decoding
    counted keeps the plain figures."""
    p = three_homes()
    c = CircuitCounts()
    for _ in range(MIN_CIRCUITS - 1):
        c = c.add(3, 2)
    assert measured(p, c, 0.05) == p
    enough = c.add(3, 2)
    d = measured(p, enough, 0.05)
    assert d == with_yield(p, CircuitYield(3.0, 4.0, 0.05))
    assert d.per_token_s is not None and p.per_token_s is not None and d.per_token_s < p.per_token_s / 2
    assert measured(d, c, 0.05) == p  # priced for a yield before: plain again below the threshold
    plain = CircuitCounts()
    for _ in range(2 * MIN_CIRCUITS):
        plain = plain.add(0, 0, 0.01)
    assert measured(p, plain, 0.05) == p
