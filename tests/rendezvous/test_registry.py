"""The pure session core: open/join/leave/expiry, wrong codes, proofs of the secret, rate limits,
caps, presence. The verifier here is a fixed key (the registry never derives one: members do, from
the code, kafila.proto.codes.join_key)."""

from __future__ import annotations

import dataclasses
import random

import pytest

from kafila.proto import signaling as sig
from kafila.proto.codes import join_proof
from kafila.proto.errors import ProtocolError
from kafila.rendezvous.limits import Limits
from kafila.rendezvous.registry import Close, Event, Note, ProbeInfo, Registry, Send


def sends(events: list[Event], conn: int | None = None) -> list[sig.ServerMessage]:
    return [e.message for e in events if isinstance(e, Send) and (conn is None or e.conn == conn)]


def closes(events: list[Event]) -> list[Close]:
    return [e for e in events if isinstance(e, Close)]


def make(**overrides: float) -> Registry:
    limits = dataclasses.replace(Limits(), **overrides)  # type: ignore[arg-type]
    return Registry(limits, probe=ProbeInfo(3478, 3479, None), rand_below=random.Random(1).randrange)


KEY, WRONG_KEY, SALT = bytes(range(32)), bytes(32), bytes(range(16))


def open_session(reg: Registry, conn: int = 1, now: float = 0.0, expected: int = 3) -> str:
    reg.connect(conn, f"10.0.0.{conn}", now)
    (opened,) = sends(reg.receive(conn, sig.Open("m", expected, f"host{conn}", {"bw": 1}), now))
    assert isinstance(opened, sig.Opened)
    (protected,) = sends(reg.receive(conn, sig.Protect(SALT.hex(), KEY.hex(), "p"), now))
    assert protected == sig.Protected(opened.session, "p")
    return opened.session


def join(
    reg: Registry, conn: int, code: str, now: float = 0.0, source: str | None = None, key: bytes = KEY
) -> list[Event]:
    """A join as a member makes it: a challenge, then the proof of `key` over its nonce."""
    if conn not in reg.conns:
        reg.connect(conn, source or f"10.0.0.{conn}", now)
    events = reg.receive(conn, sig.JoinChallenge(code), now)
    challenge = sends(events, conn)[0]
    if not isinstance(challenge, sig.Challenge):
        return events
    assert challenge.salt == SALT.hex()
    proof = join_proof(key, challenge.session, bytes.fromhex(challenge.nonce))
    return reg.receive(conn, sig.Join(code, proof.hex(), f"m{conn}", {"bw": conn}), now)


def test_open_then_join_introduces_members_both_ways() -> None:
    reg = make()
    code = open_session(reg)
    events = join(reg, 2, code, 1.0)
    (joined,) = sends(events, 2)
    assert isinstance(joined, sig.Joined)
    assert [m.name for m in joined.members] == ["host1", "m2"]
    assert joined.members[0].host and not joined.members[1].host
    assert joined.probe_port == 3478 and joined.members_expected == 3
    (introduced,) = sends(events, 1)
    assert isinstance(introduced, sig.MemberJoined) and introduced.member.id == 2
    assert reg.joins["ok"] == 1 and reg.member_count == 2


def test_signal_is_forwarded_unchanged_and_unknown_target_is_refused() -> None:
    reg = make()
    code = open_session(reg)
    join(reg, 2, code)
    payload = {"candidates": ["1.2.3.4:5"], "opaque": {"x": [1, None]}}
    assert sends(reg.receive(2, sig.Signal(1, payload), 1.0), 1) == [sig.SignalFrom(2, payload)]
    (err,) = sends(reg.receive(2, sig.Signal(9, {}), 1.0))
    assert isinstance(err, sig.Error) and err.code == "unknown_member"


def test_update_reaches_every_member() -> None:
    reg = make()
    code = open_session(reg)
    join(reg, 2, code)
    events = reg.receive(2, sig.Update(nat={"class": "restrictive"}, candidates=["5.6.7.8:9"]), 1.0)
    updates = sends(events)
    assert len(updates) == 2 and all(isinstance(u, sig.MemberUpdated) for u in updates)
    assert updates[0].member.nat == {"class": "restrictive"}  # type: ignore[union-attr]
    assert updates[0].member.capability == {"bw": 2}  # type: ignore[union-attr]


def test_wrong_code_and_malformed_code() -> None:
    reg = make()
    open_session(reg)
    (err,) = sends(join(reg, 2, "9-zzzz"))
    assert isinstance(err, sig.Error) and err.code == "unknown_session" and "9-zzzz" in err.message
    (err,) = sends(join(reg, 3, "not a code at all"))
    assert isinstance(err, sig.Error) and err.code == "bad_code"
    assert reg.joins["unknown_session"] == 1 and reg.joins["bad_code"] == 1


def test_session_full_and_member_cap() -> None:
    reg = make(max_members=4)
    code = open_session(reg, expected=3)
    join(reg, 2, code)
    join(reg, 3, code)
    join(reg, 4, code)  # formed at 3: a fourth is its host's to decide about, up to the cap
    (err,) = sends(join(reg, 5, code))
    assert err == sig.Error("session_full", f"session {code} has 4 members, the limit is 4")
    reg.connect(9, "10.9.9.9", 0.0)
    (err,) = sends(reg.receive(9, sig.Open("m", 5, "big", {}), 0.0))
    assert (
        isinstance(err, sig.Error)
        and err.code == "limit"
        and "expects 5 members, the limit is 4" in err.message
    )


def test_session_cap() -> None:
    reg = make(max_sessions=2)
    open_session(reg, 1)
    open_session(reg, 2)
    reg.connect(3, "10.0.0.3", 0.0)
    (err,) = sends(reg.receive(3, sig.Open("m", 2, "x", {}), 0.0))
    assert isinstance(err, sig.Error) and err.code == "limit" and "2 sessions, the limit is 2" in err.message


def test_join_rate_limited_per_source_address() -> None:
    reg = make(join_burst_per_address=3, join_rate_per_address=0.1)
    open_session(reg)
    outcomes = [sends(join(reg, 10 + i, "9-zzzz", 1.0, source="203.0.113.5"))[0] for i in range(5)]
    codes = [o.code for o in outcomes if isinstance(o, sig.Error)]
    assert codes == ["unknown_session"] * 3 + ["rate_limited"] * 2
    assert "retry in 10 s" in outcomes[3].message  # type: ignore[union-attr]
    # another address is not affected, and the first one recovers at the configured rate
    assert sends(join(reg, 20, "9-zzzz", 1.0, source="203.0.113.6"))[0].code == "unknown_session"  # type: ignore[union-attr]
    assert sends(join(reg, 21, "9-zzzz", 11.0, source="203.0.113.5"))[0].code == "unknown_session"  # type: ignore[union-attr]


def test_a_wrong_secret_takes_no_place_and_learns_nothing_about_the_host() -> None:
    reg = make()
    code = open_session(reg, expected=2)
    reg.connect(2, "203.0.113.9", 1.0)
    events = reg.receive(2, sig.JoinChallenge(code, "c"), 1.0)
    (challenge,) = sends(events)
    assert isinstance(challenge, sig.Challenge) and challenge.ref == "c"
    assert sends(events, 1) == []  # the host hears of no one
    proof = join_proof(WRONG_KEY, code, bytes.fromhex(challenge.nonce))
    events = reg.receive(2, sig.Join(code, proof.hex(), "guesser", {}), 1.0)
    (err,) = sends(events)
    assert isinstance(err, sig.Error) and err.code == "wrong_secret" and sends(events, 1) == []
    said = repr(events)
    assert "host1" not in said and "10.0.0.1" not in said and "bw" not in said
    assert reg.member_count == 1 and reg.joins["wrong_secret"] == 1
    (joined,) = sends(join(reg, 3, code, 1.0), 3)  # the one place is still there
    assert isinstance(joined, sig.Joined)


def test_a_join_needs_a_fresh_challenge_that_serves_one_join() -> None:
    reg = make(challenge_s=5.0)
    code = open_session(reg, expected=5)
    reg.connect(2, "10.0.0.2", 0.0)
    (err,) = sends(reg.receive(2, sig.Join(code, "00" * 32, "m2", {}), 0.0))
    assert isinstance(err, sig.Error) and err.code == "no_challenge"
    (challenge,) = sends(reg.receive(2, sig.JoinChallenge(code), 0.0))
    assert isinstance(challenge, sig.Challenge)
    proof = join_proof(KEY, code, bytes.fromhex(challenge.nonce)).hex()
    (late,) = sends(reg.receive(2, sig.Join(code, proof, "m2", {}), 6.0))  # the nonce expired
    assert isinstance(late, sig.Error) and late.code == "no_challenge"
    (challenge,) = sends(reg.receive(2, sig.JoinChallenge(code), 7.0))
    assert isinstance(challenge, sig.Challenge)
    stale = sig.Join(code, proof, "m2", {})  # a proof over an earlier nonce
    assert sends(reg.receive(2, stale, 7.0))[0].code == "wrong_secret"  # type: ignore[union-attr]
    assert sends(reg.receive(2, stale, 7.0))[0].code == "no_challenge"  # type: ignore[union-attr]


def test_only_the_host_protects_once_and_joins_wait_for_it() -> None:
    reg = make()
    reg.connect(1, "10.0.0.1", 0.0)
    (opened,) = sends(reg.receive(1, sig.Open("m", 3, "host", {}), 0.0))
    assert isinstance(opened, sig.Opened)
    reg.connect(2, "10.0.0.2", 0.0)
    (err,) = sends(reg.receive(2, sig.JoinChallenge(opened.session), 0.0))
    assert isinstance(err, sig.Error) and err.code == "not_ready"
    (err,) = sends(reg.receive(1, sig.Protect("zz", KEY.hex()), 0.0))
    assert isinstance(err, sig.Error) and err.code == "bad_message"
    (err,) = sends(reg.receive(1, sig.Protect(SALT.hex(), KEY.hex()[:-2]), 0.0))
    assert isinstance(err, sig.Error) and "verifier of 32 bytes" in err.message
    assert isinstance(sends(reg.receive(1, sig.Protect(SALT.hex(), KEY.hex()), 0.0))[0], sig.Protected)
    (err,) = sends(reg.receive(1, sig.Protect(SALT.hex(), WRONG_KEY.hex()), 0.0))
    assert isinstance(err, sig.Error) and err.code == "already_protected"
    join(reg, 2, opened.session)
    (err,) = sends(reg.receive(2, sig.Protect(SALT.hex(), WRONG_KEY.hex()), 0.0))
    assert isinstance(err, sig.Error) and err.code == "not_host"


def test_wrong_proofs_back_off_but_never_hold_up_an_address_with_the_right_code() -> None:
    reg = make(
        failed_proof_burst_per_session=3,
        failed_proof_rate_per_session=0.01,
        failed_proof_backoff_s=2.0,
        join_burst_per_address=100,
    )
    code = open_session(reg, expected=10)
    outcome = lambda conn, now, source, key=WRONG_KEY: sends(  # noqa: E731
        join(reg, conn, code, now, source, key), conn
    )[0]
    first = [outcome(10 + i, 1.0, f"198.51.100.{i}") for i in range(6)]  # six addresses, one guess each
    assert [e.code for e in first] == ["wrong_secret"] * 6  # type: ignore[union-attr]
    again = outcome(20, 1.5, "198.51.100.0")  # a failed address: back-off, then the spent budget
    assert again.code == "rate_limited" and "retry in 0 s" not in again.message  # type: ignore[union-attr]
    assert outcome(21, 4.0, "198.51.100.0").code == "rate_limited"  # type: ignore[union-attr]
    for i in range(3):  # the legitimate members never failed: tested, joined, budgets spent or not
        assert isinstance(outcome(30 + i, 4.0, f"192.0.2.{i}", KEY), sig.Joined)
    assert reg.joins["rate_limited"] == 2 and reg.joins["wrong_secret"] == 6 and reg.member_count == 4
    # a whole IPv6 /48 counts as one address
    assert outcome(40, 5.0, "2001:db8:1:1::5").code == "wrong_secret"  # type: ignore[union-attr]
    assert outcome(41, 5.0, "2001:db8:1:2::9").code == "rate_limited"  # type: ignore[union-attr]


def test_open_rate_limited_per_source_address() -> None:
    reg = make(open_burst_per_address=1, open_rate_per_address=0.01)
    open_session(reg, 1)
    reg.connect(2, "10.0.0.1", 0.0)
    (err,) = sends(reg.receive(2, sig.Open("m", 2, "again", {}), 0.0))
    assert isinstance(err, sig.Error) and err.code == "rate_limited"


def test_leave_notifies_and_last_member_dissolves_the_session() -> None:
    reg = make()
    code = open_session(reg)
    join(reg, 2, code)
    events = reg.receive(1, sig.Leave(), 5.0)
    assert sends(events, 2) == [sig.MemberLeft(1, "left")]
    assert closes(events)[0].conn == 1
    assert code in reg.sessions
    events = reg.disconnect(2, 6.0)
    assert code not in reg.sessions and reg.member_count == 0
    assert any(isinstance(e, Note) and e.event == "session_dissolved" for e in events)


def test_member_that_vanishes_is_timed_out() -> None:
    reg = make(heartbeat_timeout_s=30.0)
    code = open_session(reg)
    join(reg, 2, code)
    reg.receive(1, sig.Heartbeat(), 20.0)
    events = reg.tick(31.0)  # member 2 silent since 0 (its socket never closed)
    assert sends(events, 1) == [sig.MemberLeft(2, "timed_out")]
    (err,) = sends(events, 2)
    assert isinstance(err, sig.Error) and err.code == "timed_out" and err.fatal
    assert [c.conn for c in closes(events)] == [2]
    assert reg.disconnect(2, 32.0) == []  # the socket closing later changes nothing
    assert reg.member_count == 1


def test_unused_code_expires_and_dissolves_the_session() -> None:
    reg = make(code_ttl_s=100.0, heartbeat_timeout_s=1e9)
    code = open_session(reg)
    assert reg.tick(99.0) == []
    events = reg.tick(100.0)
    (err,) = sends(events, 1)
    assert isinstance(err, sig.Error) and err.code == "code_expired" and err.fatal
    assert code not in reg.sessions
    (err,) = sends(join(reg, 2, code, 101.0))
    assert err.code == "unknown_session"  # type: ignore[union-attr]


def test_used_code_stops_accepting_joins_after_ttl_but_session_lives() -> None:
    reg = make(code_ttl_s=100.0, heartbeat_timeout_s=1e9)
    code = open_session(reg, expected=5)
    join(reg, 2, code, 50.0)
    reg.tick(160.0)
    assert code in reg.sessions
    (err,) = sends(join(reg, 3, code, 160.0))
    assert err.code == "unknown_session"  # type: ignore[union-attr]
    assert err.message == (  # type: ignore[union-attr]
        f"session {code}'s code expired: it takes joins for 100 s after it opened or was last joined; "
        "ask the host for a new session"
    )


def test_requests_before_joining_are_refused() -> None:
    reg = make()
    reg.connect(1, "10.0.0.1", 0.0)
    for msg in (sig.Signal(1, {}), sig.RelayRequest(1), sig.Update(), sig.Leave()):
        (err,) = sends(reg.receive(1, msg, 0.0))
        assert isinstance(err, sig.Error) and err.code == "not_in_session"
    assert sends(reg.receive(1, sig.Heartbeat("h"), 0.0)) == [sig.HeartbeatAck("h")]


def test_open_twice_is_refused() -> None:
    reg = make()
    open_session(reg)
    (err,) = sends(reg.receive(1, sig.Open("m", 2, "x", {}), 0.0))
    assert isinstance(err, sig.Error) and err.code == "already_in_session"


def test_bad_frames_get_errors_then_close() -> None:
    reg = make(max_bad_frames=3)
    reg.connect(1, "10.0.0.1", 0.0)
    bad = ProtocolError("signal.to: expected integer, got string")
    for i in range(3):
        events = reg.bad_frame(1, bad, 0.0)
        (err,) = sends(events)
        assert isinstance(err, sig.Error) and err.message == str(bad) and err.fatal == (i == 2)
    assert closes(events)[0].code == 1008


def test_a_bad_request_is_answered_to_its_ref() -> None:
    reg = make()
    reg.connect(1, "10.0.0.1", 0.0)
    (err,) = sends(
        reg.bad_frame(1, ProtocolError("open.members_expected: 0 is below the minimum 1", ref="r3"), 0.0)
    )
    assert isinstance(err, sig.Error) and err.ref == "r3" and err.code == "bad_message"


def test_relay_request_gives_each_member_its_own_token() -> None:
    reg = make()
    code = open_session(reg)
    join(reg, 2, code)
    events = reg.receive(2, sig.RelayRequest(1, "r1"), 1.0)
    (mine,) = sends(events, 2)
    (theirs,) = sends(events, 1)
    assert isinstance(mine, sig.RelayAllocated) and isinstance(theirs, sig.RelayAllocated)
    assert mine.channel == theirs.channel and mine.token != theirs.token
    assert (mine.peer, theirs.peer, mine.ref, theirs.ref) == (1, 2, "r1", None)
    assert {mine.leg, theirs.leg} == {0, 1}
    again = sends(reg.receive(1, sig.RelayRequest(2), 2.0), 1)[0]
    assert again.channel == mine.channel  # type: ignore[union-attr]
    reg.receive(2, sig.Leave(), 3.0)
    assert reg.relay.channels == {}


def test_relay_request_for_self_or_stranger_is_refused() -> None:
    reg = make()
    code = open_session(reg)
    join(reg, 2, code)
    for peer in (2, 7):
        (err,) = sends(reg.receive(2, sig.RelayRequest(peer), 1.0))
        assert isinstance(err, sig.Error) and err.code == "unknown_member"


def test_relay_channel_cap_per_session() -> None:
    reg = make(relay_channels_per_session=1)
    code = open_session(reg)
    join(reg, 2, code)
    join(reg, 3, code)
    reg.receive(2, sig.RelayRequest(1), 1.0)
    (err,) = sends(reg.receive(3, sig.RelayRequest(1), 1.0))
    assert isinstance(err, sig.Error) and err.code == "limit" and "the limit is 1" in err.message


def test_connection_cap() -> None:
    reg = make(max_connections=1)
    assert reg.connect(1, "a", 0.0) == []
    events = reg.connect(2, "b", 0.0)
    assert closes(events)[0].code == 1013


def test_one_address_cannot_take_every_connection() -> None:
    """Connections that only heartbeat locked everyone out of a rendezvous (max_connections)."""
    reg = make(max_connections=10, max_connections_per_address=3)
    for conn in (1, 2, 3):
        assert reg.connect(conn, "203.0.113.7", 0.0) == []
    events = reg.connect(4, "203.0.113.7", 0.0)
    assert closes(events)[0].code == 1013
    (err,) = sends(events, 4)
    assert (
        isinstance(err, sig.Error)
        and err.message == "3 connections from 203.0.113.7, the limit per address is 3"
    )
    assert reg.connect(5, "198.51.100.1", 0.0) == []  # another address still gets in


def test_a_connection_that_never_opens_or_joins_is_closed_however_often_it_beats() -> None:
    reg = make(heartbeat_timeout_s=30.0)
    reg.connect(1, "a", 0.0)
    code = open_session(reg, 2, now=0.0)
    for now in (10.0, 20.0, 29.0):
        assert reg.receive(1, sig.Heartbeat(), now) and not closes(reg.tick(now))
        reg.receive(2, sig.Heartbeat(), now)
    assert [c.conn for c in closes(reg.tick(31.0))] == [1]  # the host, in its session, stays
    assert code in reg.sessions and 2 in reg.conns


@pytest.mark.parametrize("members", [2, 5])
def test_sessions_are_isolated(members: int) -> None:
    reg = make()
    a = open_session(reg, 1)
    b = open_session(reg, 100)
    for i in range(2, members + 1):
        join(reg, i, a)
    events = join(reg, 200, b)
    assert [m.name for m in sends(events, 200)[0].members] == ["host100", "m200"]  # type: ignore[union-attr]
    assert all(e.conn in (100, 200) for e in events if isinstance(e, Send))


def test_one_sources_refusals_are_logged_ten_a_minute_then_counted() -> None:
    """300 wrong-code joins from one client wrote 300 log lines (500 a second with bad frames)."""
    import structlog

    from kafila.rendezvous.app import SignalingHub

    clock = [0.0]
    hub = SignalingHub(make(), lambda: clock[0])
    refused = Note("join", {"outcome": "unknown_session", "source": "198.18.0.12", "session": "4-zzzz"})
    with structlog.testing.capture_logs() as logs:
        for _ in range(300):
            hub.apply([refused])
        hub.apply([Note("join", {"outcome": "unknown_session", "source": "203.0.113.9", "session": "x"})])
        hub.apply([Note("join", {"outcome": "ok", "source": "198.18.0.12", "session": "4-k7m2"})] * 20)
        clock[0] = 60.0
        hub.apply([refused])
    joins = [e for e in logs if e["event"] == "join"]
    from_one = [e for e in joins if e["source"] == "198.18.0.12" and e["outcome"] != "ok"]
    assert len(from_one) == 11 and from_one[-1]["not_logged_before"] == 290
    assert sum(e["source"] == "203.0.113.9" for e in joins) == 1  # another address has its own budget
    assert sum(e["outcome"] == "ok" for e in joins) == 20  # what worked is never sampled


def test_join_into_a_formed_session_is_admitted_up_to_the_cap_for_as_long_as_it_lives() -> None:
    """A formed session (it held its members_expected members) takes joins after its code's time:
    a member that was lost coming back under its own name, and a new one, each proving the code;
    a wrong proof is refused and counted as before; the per-session cap still holds."""
    reg = make(max_members=4, code_ttl_s=100.0, heartbeat_timeout_s=1e9)
    code = open_session(reg, expected=3)
    join(reg, 2, code, 1.0)
    join(reg, 3, code, 2.0)
    assert reg.sessions[code].formed
    reg.disconnect(3, 50.0)  # m3 is lost
    events = join(reg, 13, code, 500.0)  # m3 again, long after the code's time, on a new connection
    (joined,) = sends(events, 13)
    assert isinstance(joined, sig.Joined) and joined.member == 4
    assert [m.name for m in joined.members] == ["host1", "m2", "m13"]
    assert sends(events, 1)[0] == sig.MemberJoined(joined.members[-1])
    (err,) = sends(join(reg, 5, code, 501.0, key=WRONG_KEY), 5)
    assert isinstance(err, sig.Error) and err.code == "wrong_secret"
    (joined,) = sends(join(reg, 6, code, 502.0), 6)
    assert isinstance(joined, sig.Joined) and len(joined.members) == 4
    (err,) = sends(join(reg, 7, code, 503.0), 7)
    assert err == sig.Error("session_full", f"session {code} has 4 members, the limit is 4")
    assert reg.joins["ok"] == 4 and reg.joins["wrong_secret"] == 1 and reg.joins["session_full"] == 1


def test_a_session_still_forming_takes_no_join_past_its_count_or_its_code_time() -> None:
    reg = make(code_ttl_s=100.0, heartbeat_timeout_s=1e9)
    code = open_session(reg, expected=3)
    join(reg, 2, code, 1.0)
    reg.disconnect(2, 2.0)
    assert not reg.sessions[code].formed  # never held its three members
    (err,) = sends(join(reg, 3, code, 200.0))
    assert isinstance(err, sig.Error) and err.code == "unknown_session" and "code expired" in err.message


def test_host_removes_a_member_whose_place_then_takes_another_join() -> None:
    reg = make(max_members=3)
    code = open_session(reg, expected=3)
    join(reg, 2, code)
    join(reg, 3, code)
    reg.receive(2, sig.RelayRequest(1), 1.0)
    (full,) = sends(join(reg, 4, code, 1.0))
    assert isinstance(full, sig.Error) and full.code == "session_full"
    events = reg.receive(1, sig.Remove(2, "wrong secret word"), 2.0)
    assert sends(events, 1) == [sig.MemberLeft(2, "removed")]
    assert sends(events, 3) == [sig.MemberLeft(2, "removed")]
    (err,) = sends(events, 2)
    assert err == sig.Error(
        "removed", f"the host removed this member from session {code}: wrong secret word", fatal=True
    )
    assert [(c.conn, c.code) for c in closes(events)] == [(2, 1000)]
    notes = {e.event: e.fields for e in events if isinstance(e, Note)}
    assert notes["member_removed"] == {"session": code, "member": 2, "by": 1, "reason": "wrong secret word"}
    assert notes["member_left"]["reason"] == "removed"
    assert reg.relay.channels == {} and reg.member_count == 2 and reg.left == {"removed": 1}
    assert reg.receive(2, sig.JoinChallenge(code), 2.5) == []  # the removed connection counts no more
    assert reg.disconnect(2, 3.0) == []  # nor does its socket closing
    (joined,) = sends(join(reg, 5, code, 3.0), 5)
    assert isinstance(joined, sig.Joined) and [m.id for m in joined.members] == [1, 3, 4]


def test_only_the_host_may_remove_and_nothing_changes_when_refused() -> None:
    reg = make()
    code = open_session(reg)
    join(reg, 2, code)
    join(reg, 3, code)
    events = reg.receive(2, sig.Remove(3, "you look suspicious"), 1.0)
    assert len(events) == 1
    (err,) = sends(events, 2)
    assert isinstance(err, sig.Error) and err.code == "not_host" and not err.fatal and err.ref is None
    assert f"only the host of session {code} may remove members" in err.message
    for target in (1, 9):  # the host itself, a stranger
        events = reg.receive(1, sig.Remove(target, "x"), 1.0)
        assert len(events) == 1
        (err,) = sends(events, 1)
        assert isinstance(err, sig.Error) and err.code == "unknown_member" and not err.fatal
    assert [sorted(s.members) for s in reg.sessions.values()] == [[1, 2, 3]] and reg.left == {}
    reg.connect(7, "10.0.0.7", 1.0)
    (err,) = sends(reg.receive(7, sig.Remove(2, "x"), 1.0))
    assert isinstance(err, sig.Error) and err.code == "not_in_session"
