"""Plan epochs in flight (kafila.planner.moves): a second loss during a re-plan, against plan()."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from kafila.models.presets import resolve_manifest
from kafila.planner import DeviceReport, plan
from kafila.planner.moves import Ignored, Move, Start, committed, is_current, newer, on_loss, on_ready
from kafila.planner.replan import End, Keep, Membership, PlanTerms, Replan, fetches

QWEN8 = resolve_manifest("qwen3-8b")
GB = 10**9
TERMS = PlanTerms(context=4096, concurrency=1)


def dev(name: str, mem_gb: float, bw_gb_s: float) -> DeviceReport:
    return DeviceReport(name, int(mem_gb * GB), bw_gb_s * 1e9, overhead_s=1e-4)


def formed(reports: list[DeviceReport], epoch: int = 1) -> Membership:
    p = plan(reports, QWEN8, context=4096, concurrency=1, anchor=0)
    assert p.feasible, p.reason
    return Membership(epoch, p, tuple(reports), frozenset(r.name for r in reports), reports[0].name)


FLEET = [dev("host", 12, 100), dev("b", 12, 200), dev("c", 12, 150), dev("d", 12, 120), dev("e", 12, 110)]


def _first(m: Membership, member: str, now: float = 10.0) -> Move:
    step = on_loss(m, None, member, "closed", now, QWEN8, TERMS)
    assert isinstance(step, Start) and step.abandoned is None
    return step.move


def test_a_loss_during_a_replan_abandons_it_for_a_plan_over_everyone_left() -> None:
    m = formed(FLEET)
    first = _first(m, "c")
    assert first.epoch == 2 and first.gone == {"c"}
    step = on_loss(m, first, "d", "silent for 3.0 s", 11.5, QWEN8, TERMS)
    assert isinstance(step, Start) and step.abandoned == 2
    left = [r for r in FLEET if r.name not in ("c", "d")]
    assert step.move.decision.plan == plan(left, QWEN8, context=4096, anchor=0)
    assert step.move.epoch == 3 and step.move.gone == {"c", "d"}
    assert step.move.lost_at == 10.0  # counted from the first loss: serving stopped then
    assert step.move.decision.cause == "c was lost (closed), then d was lost (silent for 3.0 s)"
    # fetched from what the serving epoch holds: the abandoned division may be half loaded
    assert step.move.decision.fetches == fetches(m.plan, step.move.decision.plan, QWEN8)


def test_a_member_already_planned_around_is_ignored_and_a_spare_is_kept() -> None:
    m = formed(FLEET)
    first = _first(m, "c")
    assert isinstance(on_loss(m, first, "c", "closed", 11.0, QWEN8, TERMS), Ignored)
    assert isinstance(on_loss(m, first, "zz", "closed", 11.0, QWEN8, TERMS), Ignored)
    spare = dev("s", 12, 100)
    with_spare = Membership(1, m.plan, (*m.reports, spare), m.present | {"s"}, "host")
    assert isinstance(on_loss(with_spare, first, "s", "closed", 11.0, QWEN8, TERMS), Keep)


def test_losing_the_host_during_a_replan_ends_the_session() -> None:
    m = formed(FLEET)
    got = on_loss(m, _first(m, "c"), "host", "its process ended", 11.0, QWEN8, TERMS)
    assert isinstance(got, End) and "host host left" in got.reason


def test_two_losses_the_rest_cannot_hold_end_it_with_the_planners_refusal_naming_the_device() -> None:
    tight = [dev("host", 6, 100), dev("b", 6, 100), dev("c", 6, 100), dev("d", 6, 100)]
    m = formed(tight)
    first = _first(m, "b")  # three of 6 GB hold the 8B model's share...
    got = on_loss(m, first, "c", "closed", 11.0, QWEN8, TERMS)  # ...two cannot
    refused = plan([tight[0], tight[3]], QWEN8, context=4096, anchor=0)
    assert not refused.feasible and refused.reason
    assert isinstance(got, End)
    first_two = "b was lost (closed), then c was lost (closed)"
    assert got.reason == f"{first_two}; the members left cannot hold the model: {refused.reason}"
    assert "host 14 (8 with the head), d 14" in got.reason and "GB more memory" in got.reason


def test_only_the_move_in_flight_counts_answers_and_commits_its_plan() -> None:
    m = formed(FLEET)
    first = _first(m, "c")
    second = on_loss(m, first, "d", "closed", 11.0, QWEN8, TERMS)
    assert isinstance(second, Start)
    move = second.move
    assert on_ready(move, "b", 2) is None and not is_current(move, 2)  # the abandoned epoch: stale
    assert on_ready(None, "b", 3) is None
    assert on_ready(move, "d", 3) is None  # planned around
    for n in move.decision.plan.order:
        if n != "host":
            got = on_ready(move, n, 3)
            assert got is not None
            move = got
    assert move.waits_for("host") == frozenset() and is_current(move, 3)
    after = committed(m, move)
    assert after.epoch == 3 and after.plan == move.decision.plan and after.present == m.present - {"c", "d"}


def test_members_move_only_to_a_newer_epoch() -> None:
    assert newer(2, 3) and not newer(3, 3) and not newer(3, 2)


@given(
    mems=st.lists(st.floats(4, 40), min_size=3, max_size=6),
    bws=st.lists(st.floats(20, 800), min_size=6, max_size=6),
    losses=st.lists(st.integers(1, 5), min_size=1, max_size=3, unique=True),
)
def test_any_run_of_losses_is_plan_over_everyone_left_or_its_refusal(
    mems: list[float], bws: list[float], losses: list[int]
) -> None:
    reports = [dev(f"m{i}", mem, bws[i]) for i, mem in enumerate(mems)]
    full = plan(reports, QWEN8, context=4096, anchor=0)
    if not full.feasible:
        return
    m = Membership(1, full, tuple(reports), frozenset(r.name for r in reports), "m0")
    lost = [reports[i].name for i in losses if i < len(reports)]
    moving: Move | None = None
    for k, name in enumerate(lost):
        step = on_loss(m, moving, name, "closed", float(k), QWEN8, TERMS)
        left = [r for r in reports if r.name not in lost[: k + 1]]
        kept = full.head in [r.name for r in left]  # a present serving head keeps the head
        anchor = [r.name for r in left].index(full.head if kept else "m0")
        want = plan(left, QWEN8, context=4096, anchor=anchor, keep_head=kept)  # at the serving head
        if not want.feasible:
            assert isinstance(step, End) and want.reason is not None and want.reason in step.reason
            return
        assert isinstance(step, Start) and step.abandoned == (None if moving is None else moving.epoch)
        assert step.move.decision.plan == want and step.move.epoch == 2 + k
        assert step.move.gone == frozenset(lost[: k + 1]) and step.move.lost_at == 0.0
        assert isinstance(step.move.decision, Replan)
        assert step.move.decision.fetches == fetches(full, want, QWEN8)
        moving = step.move


def test_losing_the_head_moves_it_like_any_other_share_rather_than_ending_the_session() -> None:
    """The head's member lost: the re-plan over the rest, anchored at the host, places the head anew
    (the requests in flight are carried to it), with the new head's tensors among its fetches."""
    reports = [dev("host", 12, 100), dev("b", 12, 400), dev("c", 12, 150), dev("d", 12, 120)]
    m = formed(reports)
    head = m.plan.head
    assert head is not None and head != "host"  # a faster member beats the host as head
    step = on_loss(m, None, head, "silent for 3.0 s", 5.0, QWEN8, TERMS)
    assert isinstance(step, Start) and step.abandoned is None
    new = step.move.decision.plan
    left = [r for r in reports if r.name != head]
    assert new == plan(left, QWEN8, context=4096, anchor=0) and new.head != head
    assert step.move.gone == {head} and step.move.epoch == 2
    moved = [f for f in step.move.decision.fetches if f.member == new.head]
    assert new.head == "host" or (moved and moved[0].head)  # the host loads its own head tensors
    # a second loss while the head moves abandons that move for the next epoch, as any other
    second = next(n for n in new.order if n not in ("host", new.head))
    later = on_loss(m, step.move, second, "closed", 6.0, QWEN8, TERMS)
    assert isinstance(later, Start) and later.abandoned == 2 and later.move.epoch == 3
    assert later.move.gone == {head, second} and later.move.decision.plan.head not in later.move.gone


def test_a_member_planned_around_in_an_earlier_epoch_is_ignored_when_reported_again() -> None:
    m = formed(FLEET)
    after = committed(m, _first(m, "c"))
    assert isinstance(on_loss(after, None, "c", "closed", 20.0, QWEN8, TERMS), Ignored)
