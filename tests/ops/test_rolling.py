"""The order of a rolling upgrade (ops.rolling, pure): who is replaced, in which order (the member
that coordinates the session last, by hand-over), who stays and why, and when nothing may stop."""

from __future__ import annotations

from kafila.proto.session import SESSION_VERSION
from kafila.proto.speaks import SPEAKS, Build
from ops.rolling import Member, plan_rollout

OLD, NEW = "sha256:" + "a" * 64, "sha256:" + "b" * 64
OLD_BUILD, NEW_BUILD = Build("0.1.0", SPEAKS), Build("0.1.1", SPEAKS)


def docker(device: str, running: str = OLD, wanted: str = NEW, build: Build | None = NEW_BUILD) -> Member:
    return Member(device, f"site-{device}", "docker", running, wanted, build)


def native(device: str, running: str = "0.1.0", wanted: str = "0.1.1") -> Member:
    return Member(device, f"site-{device}", "native", running, wanted, Build(wanted, SPEAKS))


FEASIBLE = {n: None for n in ("h1", "h2", "h3", "h4")}


def test_members_go_one_at_a_time_spares_first_then_the_ring_from_its_tail_the_host_last_by_hand_over() -> (
    None
):
    members = [docker("h1"), docker("h2"), native("h3"), docker("h4")]
    plan = plan_rollout(members, "h1", ["h1", "h3", "h2"], OLD_BUILD, FEASIBLE, ["h3", "h2"])
    assert not plan.refused and plan.kept == ()
    # h4 a spare; then h2 (tail), h3; the host h1 last, handing its role over to h3 (or h2)
    assert [(s.device, s.hand_over) for s in plan.steps] == [
        ("h4", None), ("h2", None), ("h3", None), ("h1", ("h3", "h2"))
    ]  # fmt: skip
    lines = plan.describe().splitlines()
    assert lines[0] == (
        "1. h4 (site site-h4, docker): leaves, starts on image sha256:bbbbbbbbbbbb "
        "(now sha256:aaaaaaaaaaaa), joins again; the session serves again before the next"
    )
    assert "3. h3 (site site-h3, native): leaves, starts on kafila 0.1.1 (now 0.1.0)" in lines[2]
    assert lines[3] == (
        "4. h1 (site site-h1, docker): the session's host: hands its role over to the first present of "
        "h3, h2 and leaves, starts on image sha256:bbbbbbbbbbbb (now sha256:aaaaaaaaaaaa), joins again "
        "with the session's code; the session serves under its successor throughout"
    )


def test_the_member_that_took_the_hosts_role_over_is_the_one_replaced_last() -> None:
    """After one rolling upgrade the fleet's session host h1 is a member and h3 coordinates: h3 goes
    last, by hand-over, and h1 is replaced as any member."""
    members = [docker("h1"), docker("h2"), native("h3")]
    plan = plan_rollout(members, "h3", ["h3", "h2", "h1"], OLD_BUILD, FEASIBLE, ["h2", "h1"])
    assert [(s.device, s.hand_over) for s in plan.steps] == [("h1", None), ("h2", None), ("h3", ("h2", "h1"))]


def test_a_host_whose_build_cannot_hand_over_is_kept_and_the_others_roll() -> None:
    members = [docker("h1"), docker("h2"), native("h3")]
    plan = plan_rollout(members, "h1", ["h1", "h2", "h3"], OLD_BUILD, FEASIBLE, hands_over=False)
    assert [s.device for s in plan.steps] == ["h3", "h2"] and not plan.refused
    assert plan.kept == (
        (
            "h1",
            "the session host keeps sha256:aaaaaaaaaaaa (its build cannot hand its role over: "
            "`fleet down` then `fleet up` replaces it, a new session)",
        ),
    )


def test_a_host_that_must_go_with_nobody_to_hand_over_to_stops_nothing() -> None:
    members = [docker("h1"), docker("h2")]
    plan = plan_rollout(members, "h1", ["h1", "h2"], OLD_BUILD, FEASIBLE, succession=())
    assert plan.steps == ()
    assert plan.refused == ("h1: the session host has no succession order to hand its role over to",)
    alone = plan_rollout([docker("h1")], "h1", ["h1"], OLD_BUILD, {"h1": "it is the only member"}, ["h2"])
    assert alone.refused == ("h1: the session cannot serve while it is away: it is the only member",)


def test_members_that_run_what_the_fleet_names_are_left_alone() -> None:
    members = [docker("h1", NEW), docker("h2", NEW), native("h3", "0.1.1")]
    plan = plan_rollout(members, "h1", ["h1", "h2", "h3"], OLD_BUILD, FEASIBLE, ["h2", "h3"])
    assert plan.steps == () and not plan.refused
    assert [d for d, _ in plan.kept] == ["h1", "h2", "h3"]
    assert plan.describe().startswith("nothing to replace")


def test_a_new_build_that_cannot_join_the_running_session_stops_nothing_and_names_both_versions() -> None:
    v = SESSION_VERSION
    newer = Build("0.2.0", {**SPEAKS, "session": (v + 1, v + 1)})
    members = [docker("h1", build=newer), docker("h2", build=newer), native("h3")]
    plan = plan_rollout(members, "h1", ["h1", "h2", "h3"], OLD_BUILD, FEASIBLE, ["h2", "h3"])
    assert plan.steps == ()
    # neither could join the running session again: refused before anything stops
    assert plan.refused == (
        f"h1: session messages: the session (kafila 0.1.0) runs v{v}, kafila 0.2.0 speaks v{v + 1}",
        f"h2: session messages: the session (kafila 0.1.0) runs v{v}, kafila 0.2.0 speaks v{v + 1}",
    )
    assert plan.describe().startswith("refused; nothing was stopped:\n  h1: session messages")


def test_a_build_that_still_speaks_the_running_version_rolls() -> None:
    v = SESSION_VERSION
    both = Build("0.2.0", {**SPEAKS, "session": (v, v + 1)})
    plan = plan_rollout(
        [docker("h1", build=both), docker("h2", build=both)], "h1", ["h1", "h2"], OLD_BUILD, FEASIBLE, ["h2"]
    )
    assert [s.device for s in plan.steps] == ["h2", "h1"] and not plan.refused


def test_a_member_the_session_cannot_serve_without_or_an_unknown_build_is_refused() -> None:
    members = [docker("h1", NEW), docker("h2"), docker("h3", build=None)]
    why = "h1 (2.0 GB) cannot hold 30 blocks + head (2.3 GB)"
    plan = plan_rollout(members, "h1", ["h1", "h2", "h3"], OLD_BUILD, {"h2": why, "h3": None})
    assert plan.steps == ()
    assert plan.refused == (
        "h3: its new build's wire versions are unknown",
        f"h2: the session cannot serve while it is away: {why}",
    )
