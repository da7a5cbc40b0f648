"""A role's own stall past the ring's bound (pure StallWatch, then a role that uses it), and a
member lost by another signal than the ring's links (`RoleBase.lose`)."""

from __future__ import annotations

import asyncio

import pytest

from kafila.api.service import GenerationError, Sampling
from kafila.models.checkpoint import Checkpoint
from kafila.proto.ring import Cause, RingBroken, departure_cause
from kafila.session.ring.liveness import RECENT_S, TICK_S, StallWatch, cut_off
from tests.session.ringkit import build_ring

PROMPT = [1, 2, 3, 4, 5]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))


def test_ticks_on_time_are_no_stall() -> None:
    watch = StallWatch(3.0, last=100.0)
    for i in range(1, 40):
        assert watch.tick(100.0 + i * TICK_S) is None
    assert watch.stall(100.0 + 40 * TICK_S) is None


def test_a_gap_past_the_bound_is_a_stall_seen_before_and_after_the_watch_runs_again() -> None:
    watch = StallWatch(3.0, last=100.0)
    assert watch.stall(100.0 + 3.0) is None  # within the bound (and a tick): the others still hear it
    assert watch.stall(108.0) == pytest.approx(8.0)  # woken, the watch has not run yet
    assert watch.tick(108.1) == pytest.approx(8.1)
    assert watch.stall(109.0) == pytest.approx(8.1)  # what it notices just after waking is its stall
    now = 108.1
    while now < 108.1 + RECENT_S:
        now += TICK_S
        assert watch.tick(now) is None
    assert watch.stall(now + 0.01) is None  # a break later than RECENT_S is about something else


def test_a_gap_just_past_the_bound_but_within_a_tick_is_no_stall() -> None:
    """The gap between ticks overstates the stall by up to a tick: only past bound + tick is it sure."""
    watch = StallWatch(3.0, last=0.0)
    assert watch.tick(3.0 + TICK_S) is None


def test_every_link_quiet_is_this_members_own_network_going() -> None:
    assert cut_off({"alpha": 10.0, "beta": 9.0}, now=12.0, quiet_s=1.5) == ("alpha", "beta")
    assert cut_off({"beta": None, "alpha": 10.0}, now=12.0, quiet_s=1.5) == ("alpha", "beta")


def test_one_link_still_heard_is_a_neighbour_gone_not_this_member() -> None:
    """The host (or any other peer) still heard: the silent neighbour is the one lost."""
    assert cut_off({"alpha": 11.9, "beta": 9.0}, now=12.0, quiet_s=1.5) is None
    assert cut_off({"alpha": 10.6, "beta": 9.0, "delta": 9.0}, now=12.0, quiet_s=1.5) is None


def test_a_member_with_one_link_cannot_tell_its_network_from_the_host_going() -> None:
    assert cut_off({"alpha": 1.0}, now=12.0, quiet_s=1.5) is None
    assert cut_off({}, now=12.0, quiet_s=1.5) is None


@pytest.mark.parametrize(
    ("reason", "cause"),
    [
        ("left", Cause.LEFT),
        ("removed", Cause.LEFT),
        ("disconnected", Cause.DISCONNECTED),
        ("timed_out", Cause.DISCONNECTED),
    ],
)
def test_the_rendezvous_reason_gives_the_cause(reason: str, cause: Cause) -> None:
    assert departure_cause(reason) is cause


async def test_a_member_lost_by_another_signal_breaks_the_ring_at_once_by_name(ckpt: Checkpoint) -> None:
    """The runtime calls `lose` when the rendezvous says a member left: the head answers the next
    request with member_lost (503) naming it at once, and the notice goes round to the others."""
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)])
    try:
        ring.head.lose("nobody", Cause.LEFT, "not in this ring")  # another ring's member: ignored
        ring.head.lose("m0", Cause.LEFT, "itself")  # this member itself: ignored
        assert ring.head.broken is None
        ring.head.lose("m1", Cause.DISCONNECTED, "member m1 lost its connection (disconnected)")
        with pytest.raises(GenerationError, match=r"member m1 lost its connection \(disconnected\)") as err:
            await ring.head.submit(PROMPT, Sampling(max_tokens=3))
        assert err.value.code == "member_lost"
        doc = ring.head.describe()
        assert doc["state"] == "broken"
        assert doc["broken"] == {
            "member": "m1",
            "cause": "disconnected",
            "detail": "member m1 lost its connection (disconnected)",
            "this_member": False,
        }
        for _ in range(200):  # the head's "broken" reaches m1 (gone, but in-process it reads) and m2
            if ring.members[1].broken is not None:
                break
            await asyncio.sleep(0.01)
        assert ring.members[1].broken == RingBroken("m1", Cause.DISCONNECTED, doc["broken"]["detail"])
    finally:
        await ring.stop()


async def test_simulated_stall_past_the_bound_blames_this_member_not_the_neighbour_it_notices(
    ckpt: Checkpoint,
) -> None:
    """A member woken from a long stall finds a link closed by its peer meanwhile (the peer's idle
    timeout): that used to break its ring as "link to gamma closed by the peer". The stall is
    simulated by setting its watch's last run 10 s back (an in-process ring shares one loop, so a
    real freeze would stop every member); the break it gets is what the real code decides."""
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)])
    m1 = ring.members[0]
    try:
        m1._stall.last -= 10.0
        m1._break(RingBroken("m2", Cause.CLOSED, "link to m2 closed by the peer: Idle timeout"))
        assert m1.broken is not None and (m1.broken.member, m1.broken.cause) == ("m1", Cause.SILENT)
        assert m1.broken.detail.startswith("this member (m1) did not run for 10.")
        assert "longer than the ring's bound of 5 s, so the other members counted it lost" in m1.broken.detail
        assert m1.describe()["broken"]["this_member"] is True
    finally:
        await ring.stop()


async def test_simulated_stall_past_the_bound_is_noticed_by_the_watch_alone(ckpt: Checkpoint) -> None:
    """Nothing else reports it (links intact, no notice): the watch's next run breaks the ring."""
    ring = build_ring(ckpt, [(0, 2), (2, 5)])
    m1 = ring.members[0]
    try:
        await asyncio.sleep(TICK_S / 2)  # the watch runs
        m1._stall.last -= 10.0  # as if the process had not run for 10 s
        for _ in range(100):
            if m1.broken is not None:
                break
            await asyncio.sleep(TICK_S / 5)
        assert m1.broken is not None and m1.broken.member == "m1", m1.broken
    finally:
        await ring.stop()
