"""The coordinator hand-off (kafila.planner.succession): every member names the host's successor
in advance, survivors agree on it whatever order they hear of losses in, a silent successor is
passed over after its wait (one that says it is at work is waited for), a replaced host learns it
truthfully, and survivors that cannot obtain every block are told what is missing."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.models.manifest import Manifest
from kafila.planner.plan import Plan
from kafila.planner.succession import (
    Ended,
    Follow,
    HandOff,
    Holding,
    Ignored,
    Replaced,
    TakeOver,
    Waiting,
    block_ranges,
    shortfall,
    succession_order,
)

MANIFEST = Manifest("llama", 6, (10, 10, 20, 20, 30, 30), 100, 100, 1, "fp32")


def ring(*order: str) -> Plan:
    return Plan("kafila", True, None, "full", "given", order, order[0], (), (), 6, 512, 1)


def views(order: tuple[str, ...], host: str, epoch: int = 1) -> dict[str, HandOff]:
    succession = succession_order(ring(*order), host)
    return {m: HandOff(m, host, succession, frozenset(order), epoch) for m in order}


def test_the_order_is_the_ring_from_the_hosts_next_member_on() -> None:
    assert succession_order(ring("h", "a", "b", "c"), "h") == ("a", "b", "c")
    assert succession_order(ring("a", "b", "h", "c"), "h") == ("c", "a", "b")
    assert succession_order(ring("a", "b"), "x") == ("a", "b")  # a host outside the plan


def test_the_first_of_the_order_takes_over_and_the_others_follow_it() -> None:
    members = views(("a", "h", "b", "c"), "h")
    assert members["b"].coordinator == "h" and members["h"].state == "coordinating"
    assert members["b"].lost("h", 10.0) == TakeOver(("h",), ("b", "c", "a"), 1)
    assert members["c"].lost("h", 10.0) == Follow("b", ("h",), 10.0 + members["c"].wait_s)
    assert members["a"].lost("h", 11.0) == Follow("b", ("h",), 11.0 + members["a"].wait_s)
    assert isinstance(members["c"].heard("b", 2, 12.0), Ignored) and members["c"].state == "following"
    assert members["c"].tick(100.0) == Ignored("nothing is due")  # it came: no deadline any more


def test_a_successor_that_sends_no_epoch_is_passed_over_after_its_wait() -> None:
    """A successor frozen too (or cut off) never sends its epoch: the next takes over."""
    members = views(("h", "a", "b", "c"), "h")
    follow = members["b"].lost("h", 0.0)
    assert follow == Follow("a", ("h",), members["b"].wait_s)
    assert members["b"].tick(follow.deadline - 0.1) == Ignored("nothing is due")
    assert members["b"].tick(follow.deadline) == TakeOver(("h", "a"), ("b", "c"), 1)
    follow_c = members["c"].lost("h", 0.0)
    assert isinstance(follow_c, Follow)
    assert members["c"].tick(follow_c.deadline) == Follow(
        "b", ("h", "a"), follow_c.deadline + members["c"].wait_s
    )
    assert isinstance(members["c"].heard("a", 2, 1.0), Ignored)  # a counted lost: its epoch is not followed
    assert members["c"].coordinator == "b"


def test_a_successor_at_work_is_waited_for_past_the_first_wait_and_passed_over_once_silent() -> None:
    """The successor fetches the host's blocks for longer than the wait: its notices (and its range
    requests to this member) each start the wait again; once silent for the wait it is passed over."""
    view = views(("h", "a", "b", "c"), "h")["b"]
    assert view.lost("h", 0.0) == Follow("a", ("h",), view.wait_s)
    assert view.working("a", 15.0, 1, "fetching the host's blocks") == Waiting(
        "a", 15.0 + view.wait_s, "fetching the host's blocks"
    )
    assert view.tick(view.wait_s) == Ignored("nothing is due")  # the first deadline passed: still waiting
    assert view.working("a", 30.0) == Waiting("a", 30.0 + view.wait_s, "at work")  # a range request
    assert view.tick(30.0 + view.wait_s - 0.1) == Ignored("nothing is due")
    assert view.tick(30.0 + view.wait_s) == TakeOver(("h", "a"), ("b", "c"), 1)
    assert isinstance(view.working("a", 60.0, 1), Ignored)  # counted lost: a late notice changes nothing


def test_a_notice_that_is_not_the_awaited_successors_is_ignored() -> None:
    members = views(("h", "a", "b", "c"), "h")
    following = members["c"]
    assert following.working("a", 1.0, 1) == Ignored(
        "a is at work, but this member awaits no successor (following)"
    )
    assert following.deadline is None
    view = members["b"]
    view.lost("h", 0.0)
    assert view.working("a", 1.0, 2) == Ignored("a takes over from epoch 2; this member holds epoch 1")
    assert view.working("c", 1.0, 1) == Ignored("c is not the member awaited (a)")
    assert view.deadline == view.wait_s
    assert isinstance(view.heard("a", 2, 2.0), Ignored) and view.state == "following"
    assert isinstance(view.working("a", 3.0, 1), Ignored) and view.deadline is None  # its epoch came


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(0.0, 19.9), max_size=12),
    st.lists(st.floats(0.0, 1.0), min_size=12, max_size=12),
)
def test_a_successor_is_passed_over_exactly_when_silent_for_the_wait(
    gaps: list[float], at: list[float]
) -> None:
    """Notices at any gaps shorter than the wait: every tick between them finds nothing due,
    whatever the time; the first tick a full wait after the last notice passes it over."""
    view = views(("h", "a", "b"), "h")["b"]
    view.lost("h", 0.0)
    last = 0.0
    for gap, frac in zip(gaps, at, strict=False):
        assert view.tick(last + gap * frac) == Ignored("nothing is due")
        last += gap
        assert isinstance(view.working("a", last, 1), Waiting)
    assert view.tick(last + view.wait_s - 0.01) == Ignored("nothing is due")
    assert view.tick(last + view.wait_s) == TakeOver(("h", "a"), ("b",), 1)


def test_a_member_outside_the_order_ends_when_nobody_of_it_is_left() -> None:
    spare = HandOff("s", "h", ("a",), frozenset({"h", "a"}))
    assert isinstance(spare.lost("a", 0.0), Ignored)
    ended = spare.lost("h", 1.0)
    assert isinstance(ended, Ended)
    assert "the session's host h was lost and so was every member of its succession order (a)" in ended.reason
    assert isinstance(spare.lost("h", 2.0), Ignored)  # over: nothing more happens


def test_a_new_epoch_brings_its_order_and_a_stale_one_is_ignored() -> None:
    view = views(("h", "a", "b"), "h")["b"]
    assert isinstance(view.lost("h", 0.0), Follow)
    view.heard("a", 2, 1.0)
    view.published("a", ("b",), ("a", "b"), 2)
    assert (view.host, view.coordinator, view.succession, view.epoch) == ("a", "a", ("b",), 2)
    assert view.published("h", ("a", "b"), ("h", "a", "b"), 2) == Ignored(
        "epoch 2 from h is not newer than epoch 2"
    )
    assert view.lost("a", 3.0) == TakeOver(("a",), ("b",), 2)


def test_a_host_that_wakes_learns_it_was_replaced_and_says_so() -> None:
    host = views(("h", "a", "b"), "h", epoch=3)["h"]
    assert host.told_replaced("a", 3) == Ignored("epoch 3 of a is not newer than this member's epoch 3")
    replaced = host.told_replaced("a", 4)
    assert isinstance(replaced, Replaced) and (replaced.by, replaced.epoch) == ("a", 4)
    assert replaced.line.startswith("this member (h) was the session's host until epoch 3, was counted lost")
    assert "a took over as the session's host in epoch 4" in replaced.line
    assert isinstance(host.lost("a", 0.0), Ignored)  # its part is over
    member = views(("h", "a", "b"), "h")["b"]
    assert member.told_replaced("a", 4) == Ignored("this member does not coordinate (h does)")


ORDERS = st.lists(st.sampled_from("abcdefgh"), min_size=2, max_size=8, unique=True).map(tuple)


@settings(max_examples=200, deadline=None)
@given(ORDERS, st.data())
def test_survivors_agree_on_the_coordinator_whatever_order_they_hear_of_losses_in(
    order: tuple[str, ...], data: st.DataObject
) -> None:
    """Each survivor hears of the same losses in its own order: all end up naming the same
    coordinator, the first survivor of the order, and it alone takes over."""
    host = data.draw(st.sampled_from(order))
    others = [m for m in order if m != host]
    lost = data.draw(st.lists(st.sampled_from(others), max_size=len(others) - 1, unique=True))
    gone = [host, *lost]
    members = views(order, host)
    took = []
    for name, view in members.items():
        if name in gone:
            continue
        for i, member in enumerate(data.draw(st.permutations(gone))):
            if isinstance(view.lost(member, float(i)), TakeOver):
                took.append(name)
    expected = next(m for m in succession_order(ring(*order), host) if m not in gone)
    assert {v.coordinator for n, v in members.items() if n not in gone} == {expected}
    assert took == [expected]
    assert members[expected].state == "coordinating"


def test_blocks_no_survivor_holds_are_named_with_their_bytes() -> None:
    holdings = {"a": Holding(frozenset({0, 1}), True), "b": Holding(frozenset({2, 5}), False)}
    missing = shortfall(MANIFEST, holdings, ["a", "b"])
    assert missing is not None and missing.blocks == (3, 4) and not missing.head and missing.bytes == 50
    assert missing.text() == "blocks 3-4 (0.0 MB)"
    without_head = shortfall(MANIFEST, holdings, ["b"])
    assert without_head is not None and without_head.head and without_head.bytes == 10 + 10 + 20 + 30 + 100
    assert without_head.text().startswith("blocks 0-1, 3-4 and the head's tensors")
    assert shortfall(MANIFEST, holdings | {"c": Holding.everything(6)}, ["b", "c"]) is None
    assert shortfall(MANIFEST, holdings | {"c": Holding.everything(6)}, ["a", "b"]) is not None  # c is lost


def test_block_ranges_read_as_runs() -> None:
    assert block_ranges([7, 0, 1, 2, 5, 8]) == "0-2, 5, 7-8"
    assert block_ranges([]) == ""
