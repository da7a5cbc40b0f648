"""The formation cores (kafila/session/formation.py): pure, fed events and `now`, no sockets."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kafila import __version__
from kafila.models.presets import resolve_manifest
from kafila.planner.decide import plan_all
from kafila.planner.devices import DeviceReport
from kafila.planner.held import Held
from kafila.planner.plan import Plan, Stage
from kafila.proto.session import SESSION_VERSION, SessionTerms
from kafila.session.forming import core as fm
from kafila.session.forming.core import HostFormation, MemberFormation, Step

HOST = 1
TERMS = SessionTerms("m", 64, 8, "bf16", 2048, 1, "kafila")


def device(name: str, gb: float = 8.0) -> DeviceReport:
    return DeviceReport(name=name, memory_bytes=int(gb * 1e9), bandwidth_bytes_s=20e9, overhead_s=1e-4)


def report(name: str) -> dict[str, Any]:
    return fm.payload("report", device=device(name).to_dict())


def plan_of(names: list[str]) -> Plan:
    per = 12 // len(names)
    stages = tuple(Stage(n, i * per, (i + 1) * per, i == 0, None, 0, 0) for i, n in enumerate(names))
    return Plan(
        division="kafila",
        feasible=True,
        reason=None,
        tier="full",
        ordering="exact",
        notes=(),
        order=tuple(names),
        head=names[0],
        stages=stages,
        edges=(),
        n_blocks=12,
        context=256,
        concurrency=1,
    )


def kinds(outputs: list[fm.Output]) -> list[str]:
    return [type(o).__name__ for o in outputs]


def only(outputs: list[fm.Output], kind: type) -> Any:
    found = [o for o in outputs if isinstance(o, kind)]
    assert len(found) == 1, outputs
    return found[0]


def host_with(n: int, wait_s: float = 10.0, now: float = 100.0) -> HostFormation:
    core = HostFormation(members=n, wait_s=wait_s, host_id=HOST)
    out = core.start(device("alpha"), now)
    assert only(out, fm.Say).text == f"waiting for {n - 1} member(s) (up to {wait_s:g} s)"
    return core


def gathered(core: HostFormation, names: dict[int, str], now: float = 101.0) -> list[fm.Output]:
    """`names` join, are admitted (their links with the host authenticated), and report."""
    out: list[fm.Output] = []
    for member, name in names.items():
        out += admitted(core, member, name, now)
    for member, name in names.items():
        out += core.handle(fm.Message(member, report(name)), now)
    return out


def admitted(core: HostFormation, member: int, name: str, now: float) -> list[fm.Output]:
    """`member` joins and the host's shell admits it (as it does once their link authenticated)."""
    out = core.handle(fm.Joined(member, name), now)
    admit = only(out, fm.Admit)
    assert (admit.member, admit.name) == (member, name)
    return out + core.admitted(member, now)


# ------------------------------------------------------------------ host: normal flow


def test_host_gathers_plans_sends_and_forms() -> None:
    core = host_with(3)
    out = gathered(core, {2: "beta", 3: "gamma"})
    says = [o.text for o in out if isinstance(o, fm.Say)]
    assert says == [
        "beta connected; linking with it to check its session code",
        "beta holds the session code; waiting for its report",
        "gamma connected; linking with it to check its session code",
        "gamma holds the session code; waiting for its report",
        "beta reported: joined (2/3)",
        "gamma reported: joined (3/3)",
    ]
    plan_now = only(out, fm.PlanNow)
    assert [d.name for d in plan_now.devices] == ["alpha", "beta", "gamma"]
    assert plan_now.ids == {"alpha": 1, "beta": 2, "gamma": 3}
    assert core.step is Step.PLANNING and core.deadline is None
    sent = core.planned(plan_of(["alpha", "beta", "gamma"]), 102.0, TERMS)
    assert [s.to for s in sent] == [2, 3]
    body = sent[0].body
    assert body["op"] == "plan" and body["ids"] == {"alpha": 1, "beta": 2, "gamma": 3}
    assert SessionTerms.from_dict(body["terms"]) == TERMS and body[fm.KEY] == SESSION_VERSION
    assert body["origins"] == {"alpha": 1, "beta": 2, "gamma": 3}  # request origin tags, the host's first
    assert body["succession"] == ["beta", "gamma"]  # who coordinates should the host be lost
    assert sorted(body["probes"]) == ["alpha", "beta", "gamma"]  # which the successor re-plans with
    assert core.step is Step.LINKING
    assert kinds(core.handle(fm.Message(2, fm.payload("ready")), 103.0)) == ["Say"]  # early ready counts
    assert core.started(104.0) == [] and core.deadline == 114.0
    out = core.handle(fm.Message(3, fm.payload("ready")), 105.0)
    assert only(out, fm.Say).text == "gamma ready (2/2)"
    assert only(out, fm.Formed).members == ("alpha", "beta", "gamma")
    assert core.step is Step.FORMED


def test_a_member_that_could_not_link_ends_the_attempt_naming_why() -> None:
    """A member whose links did not authenticate (a wrong secret word) says why before it leaves;
    the host and the others used to read only that it left."""
    core = host_with(3)
    gathered(core, {2: "beta", 3: "gamma"})
    core.planned(plan_of(["alpha", "beta", "gamma"]), 102.0, TERMS)
    why = "could not link: edge 3->2: the peer did not prove the session secret for this edge"
    out = core.handle(fm.Message(3, fm.payload("failed", reason=why)), 103.0)
    reason = f"member gamma {why}"
    assert out == [fm.Send(2, fm.payload("refused", reason=reason)), fm.Failed(reason)]
    early = host_with(3)  # before the plan there is nothing to fail: named and ignored
    assert kinds(early.handle(fm.Message(2, fm.payload("failed", reason=why)), 50.0)) == ["Rejected"]


def test_host_forms_at_start_when_every_ready_came_before() -> None:
    core = host_with(2)
    gathered(core, {2: "beta"})
    core.planned(plan_of(["alpha", "beta"]), 102.0, TERMS)
    core.handle(fm.Message(2, fm.payload("ready")), 103.0)
    assert only(core.started(104.0), fm.Formed).members == ("alpha", "beta")


def test_a_session_of_one_plans_at_once() -> None:
    core = HostFormation(members=1, wait_s=5.0, host_id=HOST)
    out = core.start(device("alpha"), 0.0)
    assert only(out, fm.PlanNow).ids == {"alpha": 1}
    assert only(out, fm.Say).text == "a session of one member: nobody to wait for"  # not "waiting for 0"
    assert core.planned(plan_of(["alpha"]), 0.0, TERMS) == []
    assert kinds(core.started(0.0)) == ["Formed"]


def test_reports_in_any_order_and_joins_interleaved() -> None:
    core = host_with(4)
    out = core.handle(fm.Joined(4, "delta"), 100.5)
    out += core.handle(fm.Message(4, report("delta")), 100.6)  # before its link authenticated
    out += core.handle(fm.Joined(2, "beta"), 100.7)
    out += admitted(core, 3, "gamma", 100.8)
    out += core.handle(fm.Message(3, report("gamma")), 100.9)
    out += core.admitted(2, 101.0)
    out += core.handle(fm.Message(2, report("beta")), 101.0)
    assert not any(isinstance(o, fm.PlanNow) for o in out)  # delta reported, not yet admitted
    assert "delta reported; still linking with it to check its session code" in [
        o.text for o in out if isinstance(o, fm.Say)
    ]
    out = core.admitted(4, 101.1)
    assert only(out, fm.Say).text == "delta joined (4/4)"
    assert only(out, fm.PlanNow).ids == {"alpha": 1, "delta": 4, "gamma": 3, "beta": 2}


def test_members_are_admitted_and_report_while_the_host_measures_itself() -> None:
    """The host links with a member as it joins, also while the host still probes itself: a
    member's code is checked within a second of joining, not after both probes (20 s here)."""
    core = HostFormation(members=3, wait_s=30.0, host_id=HOST, host_name="alpha")
    out = admitted(core, 2, "beta", 5.0)
    out += core.handle(fm.Message(2, report("beta")), 6.0)
    out += admitted(core, 3, "alpha", 7.0)  # named like the host: told apart before its report
    out += core.handle(fm.Message(3, report("alpha")), 8.0)
    assert [o.text for o in out if isinstance(o, fm.Say)] == [
        "beta connected; linking with it to check its session code",
        "beta holds the session code; waiting for its report",
        "beta reported: joined (2/3)",
        "another member named alpha (member 3) connected; linking with it to check its session code",
        "alpha holds the session code; waiting for its report",
        "alpha-3 reported (as alpha is taken): joined (3/3)",
    ]
    assert core.step is Step.NEW and core.deadline is None  # no plan before the host's own report
    out = core.start(device("alpha"), 20.0)
    assert kinds(out) == ["PlanNow"]  # nobody left to wait for
    assert only(out, fm.PlanNow).ids == {"alpha": 1, "beta": 2, "alpha-3": 3}
    # the host's report first, where the planner anchors, though the others reported before it
    assert [d.name for d in only(out, fm.PlanNow).devices] == ["alpha", "beta", "alpha-3"]
    core = HostFormation(members=3, wait_s=30.0, host_id=HOST, host_name="alpha")
    admitted(core, 2, "beta", 5.0)
    core.handle(fm.Message(2, report("beta")), 6.0)
    admitted(core, 3, "gamma", 7.0)  # still measuring itself when the host is done
    out = core.start(device("alpha"), 20.0)
    assert out == [fm.Say("2/3 members joined; waiting for 1 more (up to 30 s)")]
    with pytest.raises(fm.FormationError, match="reported as 'gamma', not as 'alpha'"):
        HostFormation(members=2, host_name="alpha").start(device("gamma"), 0.0)


def test_a_member_beyond_the_declared_count_is_refused_not_linked_with() -> None:
    """The rendezvous refuses it first (session_full); the core does not count on that."""
    core = HostFormation(members=2, wait_s=30.0, host_id=HOST, host_name="alpha")
    admitted(core, 2, "beta", 1.0)
    why = "this session already has its 2 members"
    assert core.handle(fm.Joined(3, "gamma"), 2.0) == [
        fm.Send(3, fm.payload("refused", reason=why)),
        fm.Rejected(3, why),
    ]
    assert 3 not in core.joined


def test_a_member_leaving_while_the_host_measures_itself_frees_its_place() -> None:
    core = HostFormation(members=2, wait_s=30.0, host_id=HOST, host_name="alpha")
    admitted(core, 2, "beta", 1.0)
    core.handle(fm.Message(2, report("beta")), 2.0)
    out = core.handle(fm.Left(2, "disconnected"), 3.0)
    assert out == [fm.Say("beta lost its connection to the rendezvous; 1/2 members joined")]
    assert [o for o in core.start(device("alpha"), 20.0) if isinstance(o, fm.PlanNow)] == []
    assert core.ids == {"alpha": 1}


def test_two_members_of_one_name_are_told_apart_by_id() -> None:
    core = host_with(3)
    out = gathered(core, {2: "laptop", 3: "laptop"})
    assert only(out, fm.PlanNow).ids == {"alpha": 1, "laptop": 2, "laptop-3": 3}


def test_a_member_named_like_another_is_announced_as_another_not_as_it() -> None:
    """Three members on one machine all take its host name: the host, "alpha", said "alpha
    connected" of a member that joined under its own name, and then "alpha-2 reported"."""
    core = host_with(2)
    said = [o.text for o in gathered(core, {2: "alpha"}) if isinstance(o, fm.Say)]
    assert said == [
        "another member named alpha (member 2) connected; linking with it to check its session code",
        "alpha holds the session code; waiting for its report",
        "alpha-2 reported (as alpha is taken): joined (2/2)",
    ]


# ------------------------------------------------------------------ host: admission


def test_a_member_that_does_not_prove_the_code_is_refused_removed_and_replaced() -> None:
    """A mistyped word (or someone who found only the public code) costs only that member its
    place: it is told, removed at the rendezvous, and a right member can still take the place."""
    core = host_with(3)
    gathered(core, {2: "beta"})
    assert kinds(core.handle(fm.Joined(3, "mallory"), 101.0)) == ["Say", "Admit"]
    why = "edge 3->1: the peer did not prove the session secret for this edge"
    out = core.not_admitted(3, why, 101.5)
    told = (
        f"this member could not link with the host ({why}); join again with the exact code the host printed"
    )
    reason = f"mallory was not admitted: {why}"
    assert out == [
        fm.Send(3, fm.payload("refused", reason=told)),
        fm.Remove(3, reason),
        fm.Say(f"{reason}; removed from the session, 2/3 members joined"),
    ]
    assert core.step is Step.GATHERING and core.ids == {"alpha": 1, "beta": 2}
    assert core.name_of(3) == "mallory"  # as the shell logs the rendezvous's member_left for it
    assert core.handle(fm.Left(3, "removed"), 101.6) == []  # the rendezvous carried out the Remove
    assert only(core.handle(fm.Message(3, report("mallory")), 101.7), fm.Rejected)
    out = gathered(core, {4: "gamma"}, now=102.0)
    assert only(out, fm.PlanNow).ids == {"alpha": 1, "beta": 2, "gamma": 4}


def test_admission_of_a_member_that_left_or_was_decided_is_rejected() -> None:
    core = host_with(3)
    core.handle(fm.Joined(2, "beta"), 100.1)
    core.handle(fm.Message(2, report("beta")), 100.2)
    core.handle(fm.Left(2, "disconnected"), 100.3)
    assert only(core.admitted(2, 100.4), fm.Rejected).reason == (
        "admission of member 2 while gathering reports, after it left"
    )
    assert only(core.not_admitted(2, "no path", 100.4), fm.Rejected)
    gathered(core, {3: "gamma"})
    assert (
        only(core.admitted(3, 101.5), fm.Rejected).reason == "admission of member 3 while gathering reports"
    )
    assert core.admitted_ids == {3}


def test_an_admission_at_the_deadline_finds_the_attempt_timed_out_naming_who_was_linking() -> None:
    core = host_with(3, wait_s=30.0, now=100.0)
    gathered(core, {2: "beta"}, now=110.0)
    core.handle(fm.Joined(3, "gamma"), 120.0)
    core.handle(fm.Message(3, report("gamma")), 125.0)
    out = core.admitted(3, 130.0)
    reason = (
        "only 2 of 3 members arrived within 30 s (joined: alpha, beta; still linking with gamma); "
        "ask the others to run `kafila join` with the code"
    )
    assert out[-1] == fm.Failed(reason)
    assert [o.to for o in out if isinstance(o, fm.Send)] == [2, 3]


# ------------------------------------------------------------------ host: what does not fit


def test_duplicate_report_is_rejected_naming_the_member() -> None:
    core = host_with(3)
    gathered(core, {2: "beta"})
    out = core.handle(fm.Message(2, report("beta")), 101.5)
    assert only(out, fm.Rejected).reason == "duplicate report from beta"
    assert len(core.devices) == 2


def test_report_from_an_unknown_member_is_rejected() -> None:
    core = host_with(2)
    out = core.handle(fm.Message(9, report("mallory")), 101.0)
    assert only(out, fm.Rejected).reason == "'report' from member 9, which is not in this session"
    assert core.step is Step.GATHERING and len(core.devices) == 1


def test_unreadable_report_is_rejected_and_the_member_may_report_again() -> None:
    core = host_with(2)
    admitted(core, 2, "beta", 100.5)
    bad = fm.payload("report", device={"name": "beta", "memory_bytes": -5})
    rejected = only(core.handle(fm.Message(2, bad), 101.0), fm.Rejected)
    assert "unreadable report from member 2" in rejected.reason and "-5" in rejected.reason
    assert kinds(core.handle(fm.Message(2, report("beta")), 101.5)) == ["Say", "PlanNow"]


def test_ready_before_the_plan_is_out_of_order() -> None:
    core = host_with(3)
    gathered(core, {2: "beta"})
    out = core.handle(fm.Message(2, fm.payload("ready")), 101.0)
    assert only(out, fm.Rejected).reason == "ready from beta before the plan was sent"


def test_report_after_the_plan_and_unexpected_ops_are_rejected() -> None:
    core = host_with(2)
    gathered(core, {2: "beta"})
    core.handle(fm.Joined(3, "late"), 101.0)
    assert only(core.handle(fm.Message(3, report("late")), 101.1), fm.Rejected).reason == (
        "report from late after the plan was made"
    )
    assert only(core.handle(fm.Message(2, fm.payload("plan")), 101.2), fm.Rejected).reason == (
        "unexpected 'plan' from beta"
    )


def test_duplicate_ready_and_ready_from_outside_the_plan() -> None:
    core = host_with(2)
    gathered(core, {2: "beta"})
    core.handle(fm.Joined(3, "late"), 101.0)
    core.planned(plan_of(["alpha", "beta"]), 102.0, TERMS)
    core.handle(fm.Message(2, fm.payload("ready")), 103.0)
    assert only(core.handle(fm.Message(2, fm.payload("ready")), 103.1), fm.Rejected).reason == (
        "duplicate ready from beta"
    )
    assert only(core.handle(fm.Message(3, fm.payload("ready")), 103.2), fm.Rejected).reason == (
        "ready from late, which is not in the plan"
    )


def test_joined_twice_and_left_without_joining_are_rejected() -> None:
    core = host_with(3)
    core.handle(fm.Joined(2, "beta"), 100.1)
    assert (
        only(core.handle(fm.Joined(2, "beta"), 100.2), fm.Rejected).reason == "member 2 (beta) joined twice"
    )
    assert (
        only(core.handle(fm.Left(7, "left"), 100.3), fm.Rejected).reason == "member 7 left but never joined"
    )


def test_steps_out_of_order_are_a_caller_bug() -> None:
    core = host_with(3)
    with pytest.raises(fm.FormationError, match="while gathering reports; it needs planning"):
        core.planned(plan_of(["alpha"]), 101.0, TERMS)
    with pytest.raises(fm.FormationError, match="it needs new"):
        core.start(device("alpha"), 101.0)


# ------------------------------------------------------------------ host: members leaving


def test_member_leaving_before_the_plan_frees_its_place() -> None:
    core = host_with(3)
    gathered(core, {2: "beta"})
    out = core.handle(fm.Left(2, "disconnected"), 101.0)
    assert only(out, fm.Say).text == "beta lost its connection to the rendezvous; 1/3 members joined"
    assert core.ids == {"alpha": 1}
    out = gathered(core, {3: "gamma", 4: "delta"}, now=102.0)
    assert only(out, fm.PlanNow).ids == {"alpha": 1, "gamma": 3, "delta": 4}


def test_member_leaving_before_it_reported() -> None:
    core = host_with(2)
    core.handle(fm.Joined(2, "beta"), 100.1)
    out = core.handle(fm.Left(2, "timed_out"), 100.2)
    assert only(out, fm.Say).text == "beta went silent at the rendezvous; 1/2 members joined"
    assert only(core.handle(fm.Message(2, report("beta")), 100.3), fm.Rejected)


def test_member_leaving_after_the_plan_ends_the_attempt_and_tells_the_others() -> None:
    core = host_with(3)
    gathered(core, {2: "beta", 3: "gamma"})
    core.planned(plan_of(["alpha", "beta", "gamma"]), 102.0, TERMS)
    out = core.handle(fm.Left(3, "disconnected"), 103.0)
    reason = (
        "member gamma lost its connection to the rendezvous before the session formed; the plan "
        "counted on it, so a new session is needed (the host runs `kafila host` again, everyone "
        "joins its new code)"
    )
    assert kinds(out) == ["Send", "Failed"]
    assert out[0] == fm.Send(2, fm.payload("refused", reason=reason))
    assert out[1] == fm.Failed(reason)
    assert core.step is Step.FAILED
    late = core.handle(fm.Message(2, fm.payload("ready")), 104.0)
    assert only(late, fm.Rejected).reason == "message after the session was failed"


# ------------------------------------------------------------------ host: refusal and timeouts


def test_refusal_is_sent_to_every_member_and_names_the_device() -> None:
    core = host_with(3)
    gathered(core, {2: "beta", 3: "gamma"})
    reason = (
        "the session cannot be formed with the kafila division: "
        "member beta: 14 blocks need 15.1 GB, has 12.0 GB"
    )
    out = core.refuse(reason, 102.0)
    assert out == [
        fm.Send(2, fm.payload("refused", reason=reason)),
        fm.Send(3, fm.payload("refused", reason=reason)),
        fm.Failed(reason),
    ]


def test_gathering_times_out_exactly_at_the_deadline() -> None:
    core = host_with(3, wait_s=30.0, now=100.0)
    gathered(core, {2: "beta"}, now=110.0)
    assert core.tick(129.999) == [] and core.step is Step.GATHERING
    admitted(core, 3, "gamma", 120.0)  # admitted, still measuring itself
    out = core.tick(130.0)
    reason = (
        "only 2 of 3 members arrived within 30 s (joined: alpha, beta; still measuring itself: "
        "gamma); ask the others to run `kafila join` with the code"
    )
    refused = fm.payload("refused", reason=reason)
    assert out == [fm.Send(2, refused), fm.Send(3, refused), fm.Failed(reason)]
    assert core.tick(131.0) == []  # failed once


def test_a_report_at_the_deadline_finds_the_attempt_timed_out() -> None:
    core = host_with(2, wait_s=30.0, now=100.0)
    core.handle(fm.Joined(2, "beta"), 129.0)
    out = core.handle(fm.Message(2, report("beta")), 130.0)
    assert kinds(out) == ["Send", "Failed"] and "only 1 of 2 members arrived within 30 s" in out[1].reason


def test_a_report_just_before_the_deadline_counts() -> None:
    core = host_with(2, wait_s=30.0, now=100.0)
    admitted(core, 2, "beta", 129.0)
    assert kinds(core.handle(fm.Message(2, report("beta")), 129.999)) == ["Say", "PlanNow"]
    assert core.tick(1e9) == []  # no deadline while the shell plans


def test_waiting_for_ready_times_out_naming_who_is_missing() -> None:
    core = host_with(3, wait_s=20.0)
    gathered(core, {2: "beta", 3: "gamma"})
    core.planned(plan_of(["alpha", "beta", "gamma"]), 102.0, TERMS)
    assert core.tick(1e6) == []  # linking and serving weights have no deadline of their own here
    core.started(200.0)
    core.handle(fm.Message(3, fm.payload("ready")), 210.0)
    assert core.tick(219.999) == []
    assert core.tick(220.0) == [fm.Failed("only 1 of 2 members became ready within 20 s (not ready: beta)")]


# ------------------------------------------------------------------ member


def member(wait_s: float = 10.0, link_s: float | None = 5.0, now: float = 50.0) -> MemberFormation:
    core = MemberFormation(host_id=HOST, me_id=3, wait_s=wait_s, link_s=link_s)
    out = core.start(device("gamma"), now)
    assert out[0] == fm.Send(HOST, fm.payload("report", device=device("gamma").to_dict()))
    assert out[1] == fm.Say("waiting for the host's plan")
    return core


def plan_body(names: list[str], ids: dict[str, int], dtype: str = "bf16") -> dict[str, Any]:
    plan = plan_of(names).to_dict()
    terms = TERMS.to_dict() | {"dtype": dtype}
    origins = {name: tag for tag, name in enumerate(ids, 1)}
    succession = names[1:]  # the ring after the host (names[0])
    return fm.payload(
        "plan",
        plan=plan,
        ids=ids,
        terms=terms,
        alternatives={},
        origins=origins,
        succession=succession,
        probes={},
    )


IDS = {"alpha": 1, "beta": 2, "gamma": 3}


def test_each_core_names_a_member_by_what_it_knows() -> None:
    host = host_with(3)
    host.handle(fm.Joined(2, "beta"), 100.1)
    assert (host.name_of(HOST), host.name_of(2), host.name_of(9)) == ("alpha", "beta", "member 9")
    core = member()
    assert (core.name_of(HOST), core.name_of(2)) == ("the host", "member 2")  # before the plan
    out = core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.0)
    assert (core.name_of(HOST), core.name_of(2)) == ("alpha", "beta")
    assert only(out, fm.LinkNow).succession == ("beta", "gamma")  # this member knows the host's successor


def test_member_normal_flow() -> None:
    core = member()
    out = core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.0)
    got = only(out, fm.LinkNow)
    assert (got.me, got.host, got.terms) == ("gamma", "alpha", TERMS)
    assert got.plan.block_range("gamma") == (8, 12)
    assert core.step is Step.LINKING and core.deadline == 56.0
    assert core.linked(52.0) == [] and core.deadline is None
    assert core.fetched(1000.0) == []  # the fetch has no deadline
    out = core.started(1001.0)
    assert out == [fm.Send(HOST, fm.payload("ready")), fm.Say("ready; waiting for the other members")]
    assert core.step is Step.CONFIRMING and core.deadline == 1001.0 + core.wait_s
    assert core.handle(fm.Message(HOST, fm.payload("formed")), 1002.0) == [
        fm.Formed(("alpha", "beta", "gamma"))
    ]
    assert core.step is Step.FORMED


def test_a_member_renamed_by_the_host_is_told() -> None:
    """Two members of one name: the host appends the later one's id; that member used to learn its
    session name only from its links' log lines."""
    core = member()  # reported as "gamma"
    out = core.handle(
        fm.Message(HOST, plan_body(["alpha", "beta", "gamma-3"], {"alpha": 1, "beta": 2, "gamma-3": 3})), 51.0
    )
    assert out[0] == fm.Say("this member is gamma-3 in the session: gamma was taken")
    assert only(out, fm.LinkNow).me == "gamma-3"


def ready_member() -> MemberFormation:
    core = member()
    core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.0)
    core.linked(52.0)
    core.fetched(60.0)
    core.started(61.0)
    return core


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        (
            fm.Message(HOST, fm.payload("refused", reason="member beta left before the session formed")),
            "the host refused the session: member beta left before the session formed",
        ),
        (
            fm.Left(2, "disconnected"),
            "member beta lost its connection to the rendezvous before the session formed",
        ),
        (fm.Left(HOST, "left"), "the host left before the session formed"),
    ],
    ids=["refused", "member-left", "host-left"],
)
def test_a_ready_member_ends_when_the_session_does_not_form(event, reason) -> None:
    """Ready is not formed: a member that was ready while another failed to start used to serve a
    ring that never formed (its neighbour gone), until someone killed it."""
    core = ready_member()
    failed = only(core.handle(event, 62.0), fm.Failed)
    assert failed.reason == reason
    assert failed.host_left == (event == fm.Left(HOST, "left"))  # a spare then joins the successor
    assert core.step is Step.FAILED


def test_a_ready_member_times_out_without_the_hosts_confirmation() -> None:
    core = ready_member()
    assert core.tick(61.0 + core.wait_s - 0.1) == []
    assert only(core.tick(61.0 + core.wait_s), fm.Failed).reason == (
        f"the host did not confirm the session within {core.wait_s:g} s of this member's ready"
    )


def test_a_formed_host_refuses_whoever_joins_at_once() -> None:
    """A member joining a formed session (its code still open) used to probe, report and then wait
    for a plan until its --wait ran out; the host now refuses it when it joins."""
    core = host_with(2)
    gathered(core, {2: "beta"})
    core.planned(plan_of(["alpha", "beta"]), 102.0, TERMS)
    core.handle(fm.Message(2, fm.payload("ready")), 103.0)
    assert kinds(core.started(104.0)) == ["Send", "Formed"]
    out = core.handle(fm.Joined(5, "late"), 200.0)
    reason = "this session has formed and takes no more members; ask the host for a new session"
    assert out == [
        fm.Send(5, fm.payload("refused", reason=reason)),
        fm.Say("late tried to join the formed session; told it takes no more members"),
    ]
    joiner = member()  # the late member's core reads the refusal as soon as it starts
    assert only(joiner.handle(fm.Message(HOST, out[0].body), 51.0), fm.Failed).reason == (
        f"the host refused the session: {reason}"
    )


def test_formed_before_this_member_is_ready_is_ignored() -> None:
    core = member()
    core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.0)
    assert kinds(core.handle(fm.Message(HOST, fm.payload("formed")), 52.0)) == ["Rejected"]
    assert core.step is Step.LINKING


def test_member_refused_names_the_reason() -> None:
    core = member()
    out = core.handle(
        fm.Message(HOST, fm.payload("refused", reason="member beta: needs 15.1 GB, has 12.0 GB")), 51.0
    )
    assert out == [fm.Failed("the host refused the session: member beta: needs 15.1 GB, has 12.0 GB")]


def test_member_refused_after_the_plan_while_linking() -> None:
    core = member()
    core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.0)
    out = core.handle(fm.Message(HOST, fm.payload("refused", reason="member beta left")), 52.0)
    assert out == [fm.Failed("the host refused the session: member beta left")]


def test_member_plan_times_out_exactly_at_the_deadline() -> None:
    core = member(wait_s=10.0, now=50.0)
    assert core.tick(59.999) == []
    assert core.tick(60.0) == [fm.Failed("no plan from the host within 10 s")]


def test_a_plan_at_the_deadline_is_too_late() -> None:
    core = member(wait_s=10.0, now=50.0)
    out = core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 60.0)
    assert out == [fm.Failed("no plan from the host within 10 s")]


def test_member_links_time_out_by_now() -> None:
    core = member(link_s=5.0)
    core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.0)
    assert core.tick(55.999) == []
    assert core.linked(56.0) == [fm.Failed("the links of this session were not up within 5 s")]


def test_member_rejects_messages_from_others_duplicates_and_unknown_ops() -> None:
    core = member()
    out = core.handle(fm.Message(2, plan_body(["alpha", "beta", "gamma"], IDS)), 51.0)
    assert only(out, fm.Rejected).reason == "'plan' from member 2, which is not the host"
    assert only(core.handle(fm.Message(HOST, fm.payload("ready")), 51.1), fm.Rejected).reason == (
        "unexpected 'ready' from the host"
    )
    core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.2)
    out = core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.3)
    assert only(out, fm.Rejected).reason == "a second plan from the host while linking"


def test_member_steps_out_of_order_are_a_caller_bug() -> None:
    core = member()
    with pytest.raises(fm.FormationError, match="while awaiting the plan; it needs fetching weights"):
        core.fetched(51.0)


def test_member_fails_when_the_host_or_a_plan_member_leaves() -> None:
    core = member()
    assert core.handle(fm.Left(2, "left"), 50.5) == []  # before the plan: not this member's concern
    assert core.handle(fm.Left(HOST, "disconnected"), 51.0) == [
        fm.Failed("the host lost its connection to the rendezvous before the session formed", host_left=True)
    ]
    core = member()
    core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.0)
    core.linked(52.0)
    assert core.handle(fm.Left(2, "timed_out"), 53.0) == [
        fm.Failed("member beta went silent at the rendezvous before the session formed")
    ]


def test_a_plan_that_leaves_this_member_out_or_is_unreadable() -> None:
    core = member()
    out = core.handle(fm.Message(HOST, plan_body(["alpha", "beta"], {"alpha": 1, "beta": 2})), 51.0)
    assert out == [fm.Failed("the host's plan leaves out this member")]
    core = member()
    out = core.handle(fm.Message(HOST, fm.payload("plan", plan={"order": 3})), 51.0)
    assert kinds(out) == ["Failed"] and out[0].reason.startswith("the host's plan is unreadable")


def test_a_plan_without_a_known_dtype_is_unreadable() -> None:
    """Every member computes in the host's dtype; a plan that names none (or an unknown one) would
    leave the members to disagree, so it fails here, naming the field."""
    unknown = plan_body(["alpha", "beta", "gamma"], IDS, dtype="int4")
    missing = plan_body(["alpha", "beta", "gamma"], IDS)
    del missing["terms"]["dtype"]
    for body in (unknown, missing):
        out = member().handle(fm.Message(HOST, body), 51.0)
        assert kinds(out) == ["Failed"] and "unreadable" in out[0].reason and "dtype" in out[0].reason


# ------------------------------------------------------------------ host: random interleavings


@st.composite
def interleavings(draw: st.DrawFn) -> tuple[int, list[tuple[str, int]]]:
    """N, and every member's join -> admit (its link authenticated) -> report -> ready (now and
    then a duplicate, a leave, a rejoin or a failed admission thrown in; sometimes one member too
    many) interleaved with the host's own report (`start`, after which it no longer measures
    itself), its `started` and clock ticks, in any order."""
    n = draw(st.integers(1, 4))
    scripts = []
    extras = st.sampled_from(["join", "admit", "deny", "report", "ready", "leave"])
    for m in range(2, n + 1 + draw(st.integers(0, 1)) + 1):
        script = ["join", "admit", "report", "ready"]
        for extra in draw(st.lists(extras, max_size=2)):
            script.insert(draw(st.integers(0, len(script))), extra)
        scripts.append([(kind, m) for kind in script])
    scripts.append([("start", 0), *[("started", 0)] * draw(st.integers(1, 2))])
    scripts.append([("tick", draw(st.integers(0, 8))) for _ in range(draw(st.integers(0, 3)))])
    merged: list[tuple[str, int]] = []
    scripts = [sc for sc in scripts if sc]
    while scripts:
        i = draw(st.integers(0, len(scripts) - 1))
        merged.append(scripts[i].pop(0))
        scripts = [sc for sc in scripts if sc]
    return n, merged


@settings(max_examples=150, deadline=None)
@given(case=interleavings())
def test_host_core_invariants_under_any_interleaving(case: tuple[int, list[tuple[str, int]]]) -> None:
    """Whatever arrives in whatever order: one plan at most, only after the host's own report, over N
    distinct reporting members still present and admitted; `Formed` only after the host started
    and every other plan member was ready; nothing but rejections once the attempt is over, or
    once formed a refusal to a member joining."""
    n, actions = case
    core = HostFormation(members=n, wait_s=30.0, host_id=HOST, host_name="alpha")
    seen = {"planned": None, "started": False, "over": False, "present": {HOST}, "admitted": {HOST}}

    def check(outs: list[fm.Output], now: float) -> None:
        if seen["over"]:  # ... or, once formed, the refusal whoever joins is sent
            refusal = [o for o in outs if isinstance(o, fm.Send) and o.body["op"] == "refused"]
            assert all(isinstance(o, fm.Rejected) for o in outs) or (
                core.step is Step.FORMED and len(refusal) == 1 and refusal[0].to not in core.ids.values()
            ), outs
        assert all(o.reason for o in outs if isinstance(o, fm.Rejected | fm.Failed))
        if any(isinstance(o, fm.Formed) for o in outs):
            assert seen["started"] and core.ready == set(seen["planned"].values()) - {HOST}
        seen["over"] = seen["over"] or any(isinstance(o, fm.Failed | fm.Formed) for o in outs)
        if any(isinstance(o, fm.PlanNow) for o in outs):
            assert seen["planned"] is None
            plan_now = only(outs, fm.PlanNow)
            assert len(plan_now.devices) == n == len(set(plan_now.ids))
            assert set(plan_now.ids.values()) <= seen["present"] & seen["admitted"]
            assert core.step is Step.PLANNING and "alpha" in plan_now.ids
            seen["planned"] = plan_now.ids
            check(core.planned(plan_of(list(plan_now.ids)), now, TERMS), now)

    for step, (kind, m) in enumerate(actions, start=1):
        now = float(step)
        if kind == "start":
            check(core.start(device("alpha"), now), now)
        elif kind == "admit":
            out = core.admitted(m, now)
            seen["admitted"] |= {m} if m in core.admitted_ids else set()
            check(out, now)
        elif kind == "deny":  # taken only while it is being linked with
            out = core.not_admitted(m, "no path", now)
            if not any(isinstance(o, fm.Rejected) for o in out):
                seen["admitted"].discard(m)
            check(out, now)
        elif kind == "tick":
            check(core.tick(now + m * 5), now)
        elif kind == "started" and core.step is Step.LINKING:
            seen["started"] = True
            check(core.started(now), now)
        elif kind in ("join", "leave"):
            (seen["present"].add if kind == "join" else seen["present"].discard)(m)
            if kind == "leave":
                seen["admitted"].discard(m)
            happened = fm.Joined(m, f"m{m}") if kind == "join" else fm.Left(m, "left")
            check(core.handle(happened, now), now)
        elif kind in ("report", "ready"):
            body = report(f"m{m}") if kind == "report" else fm.payload("ready")
            check(core.handle(fm.Message(m, body), now), now)
    event(f"ended {core.step.value} with {n} member(s)")  # --hypothesis-show-statistics


MEMBER_EXTRAS = ["plan", "plan-other", "refused", "ready", "formed", "leave-host", "leave-beta", "tick"]


@st.composite
def member_inputs(draw: st.DrawFn) -> list[str]:
    """The happy path (plan, linked, fetched, started) with up to four other inputs, or steps
    repeated, thrown in anywhere."""
    script = ["plan", "linked", "fetched", "started", "formed"]
    extras = st.sampled_from([*MEMBER_EXTRAS, "linked", "fetched", "started"])
    for extra in draw(st.lists(extras, max_size=4)):
        script.insert(draw(st.integers(0, len(script))), extra)
    return script


@settings(max_examples=150, deadline=None)
@given(inputs=member_inputs())
def test_member_core_invariants_under_any_inputs(inputs: list[str]) -> None:
    """One LinkNow at most and only from the host's plan; `ready` sent once, only after the member
    linked, fetched and started; formed only by the host's `formed` after that; nothing but
    rejections after the end; steps taken out of turn are caller bugs (FormationError), never a
    silent state change."""
    core = member(wait_s=10.0, link_s=5.0, now=0.0)
    links = readies = 0
    over = False
    for i, what in enumerate(inputs, start=1):
        now, before = i * 1.5, core.step
        try:
            if what in ("linked", "fetched", "started"):
                outs = getattr(core, what)(now)
            elif what == "tick":
                outs = core.tick(now)
            elif what.startswith("leave"):
                outs = core.handle(fm.Left(HOST if what == "leave-host" else 2, "left"), now)
            else:
                sender = 2 if what == "plan-other" else HOST
                body = (
                    plan_body(["alpha", "beta", "gamma"], IDS)
                    if what.startswith("plan")
                    else fm.payload(what)
                )
                outs = core.handle(fm.Message(sender, body), now)
        except fm.FormationError:
            assert core.step is before
            continue
        if over:
            assert all(isinstance(o, fm.Rejected) for o in outs), outs
        links += sum(isinstance(o, fm.LinkNow) for o in outs)
        sent_ready = [o for o in outs if isinstance(o, fm.Send) and o.body["op"] == "ready"]
        if sent_ready:
            assert before is Step.STARTING and what == "started"
        readies += len(sent_ready)
        if any(isinstance(o, fm.Formed) for o in outs):  # only the host's word after this one's ready
            assert readies == 1 and what == "formed" and before is Step.CONFIRMING
        over = over or any(isinstance(o, fm.Failed | fm.Formed) for o in outs)
    assert links <= 1 and readies <= 1
    event(f"member ended {core.step.value}")  # --hypothesis-show-statistics


def test_the_host_prints_each_plan_note_once_under_the_plans():
    from kafila.models.presets import resolve_manifest
    from kafila.planner import plan_all
    from kafila.session.forming.plans import fmt_plans

    fleet = [
        DeviceReport("fast", 40 * 10**9, 400e9, overhead_s=1e-4),
        DeviceReport("slow", 40 * 10**9, 100e9, overhead_s=1e-4),
    ]
    text = fmt_plans(plan_all(fleet, resolve_manifest("qwen3-8b"), context=4096, concurrency=1))
    lines = text.splitlines()
    assert lines[0].startswith("division") and [ln.split()[0] for ln in lines[1:4]] == [
        "kafila",
        "uniform",
        "memory",
    ]
    notes = lines[4:]
    assert all(n.startswith("note: ") for n in notes) and len(set(notes)) == len(notes)
    assert any(n.startswith("note: ring ordered by the NAT counting rule") for n in notes)  # every plan's
    assert any(n.startswith("note: 1 request in flight cannot keep 2 stages busy") for n in notes)


def test_a_member_kept_as_a_spare_waits_for_a_plan_without_a_deadline_and_starts_in_its_epoch() -> None:
    """A member that joined a serving session: the host keeps it as a spare (it says why, and the
    shell relays its API to the host meanwhile) and it waits past its --wait; a plan that comes
    later starts it in the re-plan's epoch."""
    core = member(wait_s=10.0, now=50.0)
    why = "gamma waits as a spare: time per token 3.2% better, not more than the 5.0% margin"
    out = core.handle(fm.Message(HOST, fm.payload("spare", reason=why)), 51.0)
    assert out == [
        fm.Say(
            f"the host keeps this member as a spare ({why}); it is planned in when a member is lost or "
            "it would make the session faster"
        ),
        fm.Spared(HOST, why),
    ]
    assert core.step is Step.AWAITING_PLAN and core.tick(5000.0) == []
    body = plan_body(["alpha", "beta", "gamma"], IDS) | {"epoch": 4}
    link = only(core.handle(fm.Message(HOST, body), 5001.0), fm.LinkNow)
    assert link.epoch == 4 and link.me == "gamma"
    assert only(core.handle(fm.Message(HOST, fm.payload("spare", reason="x")), 5002.0), fm.Rejected)


def test_a_plan_at_forming_starts_in_the_first_epoch() -> None:
    core = member()
    assert (
        only(
            core.handle(fm.Message(HOST, plan_body(["alpha", "beta", "gamma"], IDS)), 51.0), fm.LinkNow
        ).epoch
        == 1
    )


def test_a_joiner_of_another_session_version_is_refused_in_its_own_version_and_removed() -> None:
    """Its report is not read: the host answers `refused` in the joiner's envelope, naming both
    versions, removes it at the rendezvous and goes on gathering; its place stays open."""
    core = host_with(3)
    admitted(core, 2, "beta", 101.0)
    admitted(core, 3, "old", 101.0)
    old = SESSION_VERSION - 1
    out = core.handle(fm.OtherVersion(3, old), 102.0)
    why = (
        f"this member speaks session messages v{old}; the session's host (kafila {__version__}) speaks "
        f"v{SESSION_VERSION}: join with a newer kafila that speaks v{SESSION_VERSION}"
    )
    assert out == [
        fm.Send(3, {fm.KEY: old, "op": "refused", "reason": why}),
        fm.Remove(3, f"old was not admitted: {why}"),
        fm.Say(f"old was not admitted: {why}"),
    ]
    assert kinds(core.handle(fm.Left(3, "removed"), 102.5)) == []  # the removal it asked for
    core.handle(fm.Message(2, report("beta")), 103.0)
    assert kinds(gathered(core, {4: "gamma"}, 104.0))[-1] == "PlanNow"  # the place was still open


def test_a_formed_host_refuses_a_newcomer_of_another_version_and_a_members_is_only_logged() -> None:
    core = host_with(2)
    gathered(core, {2: "beta"})
    core.planned(plan_of(["alpha", "beta"]), 102.0, TERMS)
    core.handle(fm.Message(2, fm.payload("ready")), 103.0)
    core.started(104.0)
    newer = SESSION_VERSION + 1
    out = core.handle(fm.OtherVersion(7, newer), 200.0)
    assert kinds(out) == ["Send", "Remove", "Say"] and out[0] == fm.Send(
        7, {fm.KEY: newer, "op": "refused", "reason": out[0].body["reason"]}
    )
    assert "join with an older kafila" in out[0].body["reason"]
    assert kinds(core.handle(fm.OtherVersion(2, newer), 201.0)) == ["Rejected"]  # beta is in the ring


def test_a_member_whose_host_speaks_another_session_version_stops_naming_both() -> None:
    core = member()
    out = core.handle(fm.OtherVersion(HOST, SESSION_VERSION + 1), 51.0)
    assert out == [
        fm.Failed(
            f"the session's host speaks session messages v{SESSION_VERSION + 1}; this member (kafila "
            f"{__version__}) speaks v{SESSION_VERSION}: join with a kafila that speaks v{SESSION_VERSION + 1}"
        )
    ]
    assert kinds(member().handle(fm.OtherVersion(9, 1), 51.0)) == ["Rejected"]  # not the host: ignored


def test_the_hosts_table_of_plans_says_the_bytes_each_division_fetches() -> None:
    """Where members reported what their disks hold, the table under the host's plans says what
    each division fetches from the host and from members."""
    from kafila.session.forming.plans import fmt_plans

    def dev(name: str, bw_gb_s: float, held: Held) -> DeviceReport:
        return DeviceReport(name, 12 * 10**9, bw_gb_s * 1e9, overhead_s=1e-4, held=held)

    qwen8 = resolve_manifest("qwen3-8b")
    fleet = [
        dev("alpha", 100, Held()),
        dev("new", 110, Held()),
        dev("beta", 100, Held(frozenset(range(10, 36)))),
    ]
    text = fmt_plans(plan_all(fleet, qwen8, context=4096, weights_host="alpha"))
    assert "weights to fetch: kafila 0.0 MB from the host + 771.8 MB from members; uniform " in text
    assert "weights to fetch" not in fmt_plans(plan_all(fleet, qwen8, context=4096))
