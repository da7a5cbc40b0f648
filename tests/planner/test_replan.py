"""The pure re-plan core: losses, arrivals and contradicted paths, against plan() itself."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, plan
from kafila.planner.decide import reprice, with_yield
from kafila.planner.drafting import CircuitYield
from kafila.planner.reachability import Behaviour, Nat, NatClass
from kafila.planner.replan import (
    End,
    Keep,
    Membership,
    PlanTerms,
    Replan,
    anchor_of,
    contradicted,
    fetches,
    measured_reports,
    on_arrived,
    on_lost,
    on_measured,
    on_paths,
    with_path,
)

QWEN8 = resolve_manifest("qwen3-8b")
GB = 10**9
TERMS = PlanTerms(context=4096, concurrency=1)


def dev(name: str, mem_gb: float, bw_gb_s: float, **kw: object) -> DeviceReport:
    return DeviceReport(name, int(mem_gb * GB), bw_gb_s * 1e9, overhead_s=1e-4, **kw)  # type: ignore[arg-type]


def formed(reports: list[DeviceReport], terms: PlanTerms = TERMS) -> Membership:
    p = plan(reports, QWEN8, context=terms.context, concurrency=terms.concurrency, anchor=0)
    assert p.feasible, p.reason
    return Membership(0, p, tuple(reports), frozenset(r.name for r in reports), reports[0].name)


FLEET = [dev("host", 12, 100), dev("b", 12, 200), dev("c", 12, 150), dev("d", 12, 120)]


def test_losing_a_member_replans_over_the_survivors_with_the_planner_itself() -> None:
    m = formed(FLEET)
    got = on_lost(m, "c", "silent for 3.0 s", QWEN8, TERMS)
    assert isinstance(got, Replan)
    survivors = [r for r in FLEET if r.name != "c"]
    assert got.plan == plan(survivors, QWEN8, context=4096, concurrency=1, anchor=0, keep_head=True)
    assert got.epoch == 1 and got.cause == "c was lost (silent for 3.0 s)"
    assert "c" not in got.plan.order


def test_a_replan_prices_its_plans_for_what_the_serving_plans_circuits_yield() -> None:
    """A host that priced its plan for a drafting head's measured yield weighs every candidate at
    that yield: the survivors' plan is the planner's own, priced so; an arrival is compared like
    with like."""
    m = formed(FLEET)
    y = CircuitYield(tokens=2.5, rows=4.0, row_share=0.05)
    drafting = replace(m, plan=with_yield(m.plan, y))
    got = on_lost(drafting, "c", "closed", QWEN8, TERMS)
    plain = on_lost(m, "c", "closed", QWEN8, TERMS)
    assert isinstance(got, Replan) and isinstance(plain, Replan)
    assert got.plan == with_yield(plain.plan, y) and got.plan.circuit_yield == y
    assert got.plan.per_token_s is not None and plain.plan.per_token_s is not None
    assert got.plan.per_token_s < plain.plan.per_token_s
    fast = dev("e", 12, 400)
    for serving in (m, drafting):  # the same decision at either yield: the gain is of like with like
        decided = on_arrived(serving, fast, QWEN8, TERMS)
        assert isinstance(decided, Replan) and decided.plan.circuit_yield == serving.plan.circuit_yield


def test_fetches_are_exactly_the_blocks_each_member_did_not_hold() -> None:
    m = formed(FLEET)
    got = on_lost(m, "c", "closed", QWEN8, TERMS)
    assert isinstance(got, Replan)
    for f in got.fetches:
        old = set(range(*m.plan.block_range(f.member)))
        new = set(range(*got.plan.block_range(f.member)))
        assert set(f.blocks) == new - old
        assert f.head == (got.plan.stage(f.member).head and not m.plan.stage(f.member).head)
        assert f.bytes == sum(QWEN8.block_bytes[i] for i in f.blocks) + f.head * QWEN8.head_resident_bytes
    lacking = {
        s.name
        for s in got.plan.stages
        if set(range(s.start, s.stop)) - set(range(*m.plan.block_range(s.name)))
    }
    assert {f.member for f in got.fetches} >= lacking
    # what the lost member held is fetched by someone: nothing of the model is missing
    assert set(range(*m.plan.block_range("c"))) <= {i for f in got.fetches for i in f.blocks}


def test_losing_the_host_ends_the_session_naming_it() -> None:
    got = on_lost(formed(FLEET), "host", "its process ended", QWEN8, TERMS)
    assert got == End("the session host host left (its process ended)")


def test_survivors_that_cannot_hold_the_model_end_it_with_the_planners_reason() -> None:
    tight = [dev("host", 6, 100), dev("b", 6, 100), dev("c", 6, 100)]
    m = formed(tight)
    got = on_lost(m, "b", "closed", QWEN8, TERMS)
    assert isinstance(got, End)
    refused = plan([tight[0], tight[2]], QWEN8, context=4096, anchor=0, keep_head=True)
    assert not refused.feasible and refused.reason
    assert got.reason == f"b was lost (closed); the members left cannot hold the model: {refused.reason}"
    assert "GB" in got.reason


def test_a_fast_arrival_is_planned_in_and_a_slow_one_waits_as_a_spare() -> None:
    m = formed(FLEET[:3])
    fast = on_arrived(m, dev("e", 24, 800), QWEN8, TERMS)
    assert isinstance(fast, Replan) and "e" in fast.plan.order and fast.epoch == 1
    assert fast.plan == plan([*FLEET[:3], dev("e", 24, 800)], QWEN8, context=4096, anchor=0, keep_head=True)
    slow = on_arrived(m, dev("e", 24, 5), QWEN8, TERMS)
    assert isinstance(slow, Keep) and slow.plan == m.plan
    assert slow.reason.startswith("e waits as a spare: time per token")


def test_a_spare_is_used_when_someone_is_lost() -> None:
    m = formed(FLEET[:3])
    spare = dev("e", 24, 5)
    kept = on_arrived(m, spare, QWEN8, TERMS)
    assert isinstance(kept, Keep)
    m = replace(m, reports=(*m.reports, spare), present=m.present | {"e"})
    assert m.spares == ("e",)
    got = on_lost(m, "b", "closed", QWEN8, TERMS)
    assert isinstance(got, Replan) and "e" in got.plan.order
    assert on_lost(m, "e", "closed", QWEN8, TERMS) == Keep("spare e left (closed)", m.plan)


def test_an_arrival_that_is_planned_in_takes_the_waiting_spares_in_too_and_says_so() -> None:
    m = formed(FLEET[:3])
    spare = dev("e", 24, 20)  # alone, not worth a re-plan
    assert isinstance(on_arrived(m, spare, QWEN8, TERMS), Keep)
    m = replace(m, reports=(*m.reports, spare), present=m.present | {"e"})
    got = on_arrived(m, dev("f", 24, 800), QWEN8, TERMS)
    assert isinstance(got, Replan) and {"e", "f"} <= set(got.plan.order)
    assert got.cause.startswith("f joined: time per token ") and got.cause.endswith("better, with spare e")
    assert {f.member for f in got.fetches} >= {"e", "f"}


def test_a_member_that_comes_back_is_planned_in_again() -> None:
    fleet = [*FLEET[:3], dev("d", 24, 800)]  # the fastest member: the ring is worse without it
    m = formed(fleet)
    lost = on_lost(m, "d", "closed", QWEN8, TERMS)
    assert isinstance(lost, Replan)
    after = Membership(lost.epoch, lost.plan, m.reports, m.present - {"d"}, "host")
    back = on_arrived(after, fleet[3], QWEN8, TERMS)
    assert isinstance(back, Replan) and back.epoch == 2
    serving = [r.name for r in fleet].index(lost.plan.head or "host")
    # the same members and probes: the forming plan, but with the head where it now serves
    assert back.plan == plan(fleet, QWEN8, context=4096, anchor=serving, keep_head=True)
    assert {f.member for f in back.fetches} >= {"d"}


def _far_fleet() -> list[DeviceReport]:
    """Four fast members far from the rendezvous (100 ms) but 2 ms from each other, measured."""
    names = ["host", "b", "c", "d"]
    return [dev(n, 24, 1000, rtt_s=0.1, pair_rtt_s={o: 0.002 for o in names if o != n}) for n in names]


def test_a_contradicted_path_that_a_new_order_avoids_replans() -> None:
    m = formed(_far_fleet())
    edge = next(e for e in m.plan.edges if m.host not in (e.src, e.dst))
    assert edge.direct
    got = on_paths(m, [(edge.src, edge.dst)], QWEN8, TERMS)
    assert isinstance(got, Replan), got
    used = {frozenset((e.src, e.dst)) for e in got.plan.edges}
    assert frozenset((edge.src, edge.dst)) not in used
    assert all(e.direct for e in got.plan.edges)


def test_a_path_that_settles_on_the_relay_while_serving_is_priced_so_and_direct_again_restores_it() -> None:
    """with_path folds one settled path into the reports: a link predicted direct that relays is
    marked relayed (what on_measured re-prices with); direct again, it gets back the round trip
    its members measured when they joined; anything the reports already say changes nothing."""
    probed = _far_fleet()
    m = formed(probed)
    edge = next(e for e in m.plan.edges if m.host not in (e.src, e.dst))
    pair = (edge.src, edge.dst)
    assert with_path(m.reports, probed, pair, True) is None  # direct as predicted: nothing new
    relayed = with_path(m.reports, probed, pair, False)
    assert relayed is not None and relayed == measured_reports(m.reports, {pair: False})
    assert with_path(relayed, probed, pair, False) is None  # already known
    again = with_path(relayed, probed, pair, True)
    assert again == tuple(probed)  # the round trips the members measured when they joined
    assert with_path(m.reports, probed, ("host", "nobody"), False) is None
    decision = on_measured(m, relayed, QWEN8, TERMS, f"{edge.src}->{edge.dst} runs through the relay")
    forming = on_paths(m, [pair], QWEN8, TERMS)  # the same measurement made at forming
    assert isinstance(decision, Replan) and isinstance(forming, Replan) and decision.plan == forming.plan
    assert decision.cause.startswith(f"{edge.src}->{edge.dst} runs through the relay: re-planned")
    back = on_measured(replace(m, reports=relayed), again, QWEN8, TERMS, "direct again")
    assert isinstance(back, Keep) and back.plan == reprice(m.plan, again)


def test_a_contradicted_path_not_worth_a_replan_only_corrects_the_edges() -> None:
    # close to the rendezvous: relaying the edge costs little next to the stages
    near = [replace(r, rtt_s=0.002) for r in _far_fleet()]
    slow = [replace(r, bandwidth_bytes_s=50e9) for r in near]
    m = formed(slow)
    edge = next(e for e in m.plan.edges if m.host not in (e.src, e.dst))
    got = on_paths(m, [(edge.src, edge.dst)], QWEN8, TERMS)
    assert isinstance(got, Keep), got
    fixed = {(e.src, e.dst): e.direct for e in got.plan.edges}
    assert fixed[(edge.src, edge.dst)] is False
    assert got.plan.order == m.plan.order and got.plan.stages == m.plan.stages
    assert got.plan.per_token_s is not None and m.plan.per_token_s is not None
    assert got.plan.per_token_s >= m.plan.per_token_s


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mems=st.lists(st.floats(4, 40), min_size=3, max_size=5),
    bws=st.lists(st.floats(20, 800), min_size=5, max_size=5),
    lost_at=st.integers(1, 4),
)
def test_any_loss_is_plan_over_the_survivors_or_its_refusal(
    mems: list[float], bws: list[float], lost_at: int
) -> None:
    reports = [dev(f"m{i}", mem, bws[i]) for i, mem in enumerate(mems)]
    full = plan(reports, QWEN8, context=4096, anchor=0)
    if not full.feasible:
        return
    m = Membership(3, full, tuple(reports), frozenset(r.name for r in reports), "m0")
    lost = reports[lost_at % len(reports)] if lost_at % len(reports) else reports[1]
    got = on_lost(m, lost.name, "closed", QWEN8, TERMS)
    survivors = [r for r in reports if r is not lost]
    anchor = next(
        i for i, r in enumerate(survivors) if r.name == (full.head if full.head != lost.name else "m0")
    )
    want = plan(survivors, QWEN8, context=4096, anchor=anchor, keep_head=full.head != lost.name)
    if want.feasible:
        assert isinstance(got, Replan) and got.plan == want and got.epoch == 4
        assert got.fetches == fetches(full, want, QWEN8)
        held = {i for s in full.stages if s.name != lost.name for i in range(s.start, s.stop)}
        assert {i for f in got.fetches for i in f.blocks} | held >= set(range(QWEN8.n_blocks))
    else:
        assert isinstance(got, End) and want.reason is not None and want.reason in got.reason


def test_a_replan_keeps_the_head_where_it_serves() -> None:
    m = formed(FLEET)
    moved = replace(m, plan=plan(FLEET, QWEN8, context=4096, anchor=2))  # "c" heads the ring
    assert moved.plan.head == "c"
    lost = next(n for n in moved.plan.order if n not in ("c", "host"))
    got = on_lost(moved, lost, "silent", QWEN8, TERMS)
    survivors = [r for r in FLEET if r.name != lost]
    want = plan(survivors, QWEN8, context=4096, anchor=[r.name for r in survivors].index("c"), keep_head=True)
    assert isinstance(got, Replan) and got.plan == want and got.plan.head == "c"


def test_a_replan_keeps_the_head_even_where_another_member_would_beat_it_by_more_than_the_margin() -> None:
    """A serving head's samplers and caches cannot move, so a loss never moves the head for a
    faster survivor (a noisy bandwidth probe once made one, and the session ended for it)."""
    slow_host = [dev("host", 16, 20), dev("b", 16, 200), dev("c", 16, 300)]
    m = replace(formed(slow_host), plan=plan(slow_host, QWEN8, context=4096, anchor=0, keep_head=True))
    assert m.plan.head == "host"
    free = plan(slow_host[:2], QWEN8, context=4096, anchor=0)  # the head margin alone would move it
    assert free.head == "b"
    got = on_lost(m, "c", "closed", QWEN8, TERMS)
    assert isinstance(got, Replan) and got.plan.head == "host"
    assert got.plan == plan(slow_host[:2], QWEN8, context=4096, anchor=0, keep_head=True)


def test_membership_checks_its_inputs() -> None:
    m = formed(FLEET)
    with pytest.raises(ValueError, match="unique"):
        replace(m, reports=(*m.reports, FLEET[0]))
    with pytest.raises(ValueError, match="the host 'zz' has no report"):
        replace(m, host="zz")


def test_contradicted_names_only_pairs_predicted_direct_that_run_through_the_relay() -> None:
    nat = Nat(NatClass.ORDINARY, Behaviour.ENDPOINT_INDEPENDENT, Behaviour.ADDRESS_AND_PORT_DEPENDENT)
    reports = [dev("host", 12, 100, nat=nat), dev("b", 12, 100, nat=nat), dev("c", 12, 100)]  # c: unknown
    measured = {("host", "b"): False, ("host", "c"): False, ("b", "c"): True, ("host", "zz"): False}
    # host-c was predicted relayed (an unknown NAT counts as restrictive): no contradiction; zz has no report
    assert contradicted(reports, measured) == (("host", "b"),)
    assert contradicted(reports, {("host", "b"): True}) == ()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bws=st.lists(st.floats(50, 1000), min_size=4, max_size=4),
    rtts=st.lists(st.floats(0.001, 0.15), min_size=4, max_size=4),
    near=st.floats(0.05, 1.0),
    cut=st.sets(st.integers(0, 3), min_size=1, max_size=2),
)
def test_measured_relays_keep_the_ring_or_replan_exactly_as_the_margin_says(
    bws: list[float], rtts: list[float], near: float, cut: set[int]
) -> None:
    """Against plan() itself: a contradicted edge either keeps the ring (same order and division,
    the edge now relayed and priced so, no faster than before) or re-plans to plan() over the
    measured reports, only when that beats the re-priced ring by more than the margin."""
    names = ["host", "b", "c", "d"]
    pair_rtt = near * min(rtts)  # members nearer each other than the relay: a relay never costs less
    reports = [
        dev(n, 24, bws[i], rtt_s=rtts[i], pair_rtt_s={o: pair_rtt for o in names if o != n})
        for i, n in enumerate(names)
    ]
    m = formed(reports)
    relayed = [(m.plan.edges[i].src, m.plan.edges[i].dst) for i in sorted(cut)]
    got = on_paths(m, relayed, QWEN8, TERMS)
    pairs = {frozenset(p) for p in relayed}

    def peers(name: str) -> frozenset[str]:
        return frozenset(o for p in pairs if name in p for o in p if o != name)

    measured = [  # a relayed pair has no direct round trip any more
        replace(
            r,
            relayed_with=peers(r.name),
            pair_rtt_s={o: t for o, t in r.pair_rtt_s.items() if o not in peers(r.name)},
        )
        for r in reports
    ]
    repriced = reprice(m.plan, measured)
    head = anchor_of(m)  # a re-plan is anchored at the serving head
    best = plan(
        measured, QWEN8, context=TERMS.context, anchor=[r.name for r in measured].index(head), keep_head=True
    )
    assert repriced.per_token_s is not None and m.plan.per_token_s is not None
    assert repriced.per_token_s >= m.plan.per_token_s
    gain = (repriced.per_token_s - (best.per_token_s or 0)) / repriced.per_token_s
    event(type(got).__name__)
    if isinstance(got, Keep):
        assert gain <= TERMS.mu
        assert got.plan == repriced and got.plan.order == m.plan.order and got.plan.stages == m.plan.stages
        assert all(not e.direct for e in got.plan.edges if frozenset((e.src, e.dst)) in pairs)
    else:
        assert isinstance(got, Replan) and gain > TERMS.mu
        assert got.plan == best and got.epoch == 1
        assert all(not e.direct for e in got.plan.edges if frozenset((e.src, e.dst)) in pairs)


def test_a_keep_says_how_the_alternative_compares_in_plain_words() -> None:
    near = [replace(r, rtt_s=0.002, bandwidth_bytes_s=50e9) for r in _far_fleet()]
    m = formed(near)
    edge = next(e for e in m.plan.edges if m.host in (e.src, e.dst))
    got = on_paths(m, [(edge.src, edge.dst)], QWEN8, TERMS)
    assert isinstance(got, Keep)
    assert got.reason.startswith(f"{edge.src}->{edge.dst} run through the relay; ")
    assert "-" not in got.reason.split("; ", 1)[1]  # never "-0.8% better"


def test_the_host_keeps_measured_relays_in_its_reports_for_later_replans() -> None:
    """A pair predicted direct that ran through the relay is recorded (`relayed_with`) on both
    reports, so a re-plan after a loss prices it as it ran; a pair that punched is left alone."""
    nat = Nat(NatClass.ORDINARY, Behaviour.ENDPOINT_INDEPENDENT, Behaviour.ADDRESS_AND_PORT_DEPENDENT)
    reports = (dev("host", 12, 100, nat=nat), dev("b", 12, 100, nat=nat), dev("c", 12, 100, nat=nat))
    by = {r.name: r for r in measured_reports(reports, {("host", "b"): False, ("host", "c"): True})}
    assert by["host"].relayed_with == {"b"} and by["b"].relayed_with == {"host"}
    assert not by["c"].relayed_with
    assert measured_reports(reports, {("host", "c"): True}) == reports  # nothing contradicted


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mems=st.lists(st.floats(4, 40), min_size=2, max_size=4),
    bws=st.lists(st.floats(20, 800), min_size=4, max_size=4),
    new=st.tuples(st.floats(1, 40), st.floats(5, 1000)),
)
def test_any_arrival_is_plan_over_everyone_present_or_a_spare_within_the_margin(
    mems: list[float], bws: list[float], new: tuple[float, float]
) -> None:
    """A member that arrives is planned in exactly when plan() over everyone present with it
    (anchored at the serving head, which it keeps) predicts a time per token better by more than
    the margin; the new division is then that plan, and only what each member lacks is fetched."""
    reports = [dev(f"m{i}", mem, bws[i]) for i, mem in enumerate(mems)]
    full = plan(reports, QWEN8, context=4096, anchor=0)
    if not full.feasible:
        return
    m = Membership(2, full, tuple(reports), frozenset(r.name for r in reports), "m0")
    comer = dev("new", *new)
    got = on_arrived(m, comer, QWEN8, TERMS)
    grown = [*reports, comer]
    head = full.head or "m0"  # the serving head, kept where it is (keep_head)
    want = plan(grown, QWEN8, context=4096, anchor=[r.name for r in grown].index(head), keep_head=True)
    assert full.per_token_s is not None
    gain = None if want.per_token_s is None else (full.per_token_s - want.per_token_s) / full.per_token_s
    if want.feasible and gain is not None and gain > TERMS.mu:
        event("planned in")
        assert isinstance(got, Replan) and got.plan == want and got.epoch == 3
        assert got.fetches == fetches(full, want, QWEN8)
        assert "new joined" in got.cause
    else:
        event("spare")
        assert isinstance(got, Keep) and got.plan == full and got.reason.startswith("new waits as a spare")
