"""What a circuit yields with speculative decoding, in the plan's figures (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, Plan, plan
from kafila.planner.decide import with_yield
from kafila.planner.drafting import CircuitYield, figures

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
