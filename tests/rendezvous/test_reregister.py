"""Re-registering a session after the rendezvous restarted (pure registry): the host re-opens its
code with the ticket the rendezvous gave it, its members take their places back with the proof of
the code, and nobody else can take the code or a place."""

from __future__ import annotations

import dataclasses
import random

from kafila.proto import signaling as sig
from kafila.proto.codes import join_proof
from kafila.rendezvous.limits import Limits
from kafila.rendezvous.registry import Event, ProbeInfo, Registry, Send
from tests.rendezvous.test_registry import KEY, SALT, WRONG_KEY, join, open_session, sends

KEPT = bytes(range(100, 132))  # the rendezvous's kept secret (its --relay-secret-file)


def make(kept: bytes | None = KEPT, seed: int = 1) -> Registry:
    return Registry(
        Limits(),
        probe=ProbeInfo(3478, 3479, None),
        rand_below=random.Random(seed).randrange,
        kept_secret=kept,
    )


def ticket_of(reg: Registry, conn: int = 1) -> str:
    (got,) = sends(reg.receive(conn, sig.TicketRequest("t"), 0.0))
    assert isinstance(got, sig.Ticket) and got.ref == "t" and got.kept == reg.secret_kept
    return got.ticket


def reopen(
    reg: Registry,
    conn: int,
    code: str,
    ticket: str,
    now: float = 0.0,
    salt: str = SALT.hex(),
    verifier: str = KEY.hex(),
) -> sig.ServerMessage:
    if conn not in reg.conns:
        reg.connect(conn, f"10.0.1.{conn}", now)
    msg = sig.Reopen(code, ticket, salt, verifier, 1, 4, "m", 3, "host", {}, ref="o")
    return sends(reg.receive(conn, msg, now), conn)[0]


def rejoin(
    reg: Registry,
    conn: int,
    code: str,
    member: int,
    now: float = 0.0,
    key: bytes = KEY,
    relays: tuple[str, ...] = (),
) -> list[Event]:
    if conn not in reg.conns:
        reg.connect(conn, f"10.0.1.{conn}", now)
    events = reg.receive(conn, sig.RejoinChallenge(code, member), now)
    challenge = sends(events, conn)[0]
    if not isinstance(challenge, sig.Challenge):
        return events
    proof = join_proof(key, challenge.session, bytes.fromhex(challenge.nonce))
    msg = sig.Rejoin(code, proof.hex(), member, f"m{member}", {"bw": member}, relays=list(relays))
    return reg.receive(conn, msg, now)


def formed(reg: Registry) -> tuple[str, str]:
    """A session of three (host 1, members 2 and 3) and the host's ticket."""
    code = open_session(reg)
    join(reg, 2, code)
    join(reg, 3, code)
    return code, ticket_of(reg)


def test_after_a_restart_the_host_reopens_its_code_and_the_members_take_their_places_back() -> None:
    code, ticket = formed(make())
    again = make(seed=2)  # the restarted rendezvous: nothing but the kept secret
    opened = reopen(again, 11, code, ticket)
    assert isinstance(opened, sig.Opened) and (opened.session, opened.member) == (code, 1)
    events = rejoin(again, 12, code, 2)
    (joined,) = sends(events, 12)
    assert isinstance(joined, sig.Joined) and joined.member == 2
    assert [(m.id, m.host) for m in joined.members] == [(1, True), (2, False)]
    # the host hears of a member back, not of a new one (its formed session would refuse a join)
    (back,) = sends(events, 11)
    assert isinstance(back, sig.MemberUpdated) and back.member.id == 2
    assert isinstance(sends(rejoin(again, 13, code, 3), 13)[0], sig.Joined)
    assert again.joins["rejoined"] == 2
    # a new member joins the re-opened session after the old ones' ids, and the host hears of it
    events = join(again, 14, code)
    (joined,) = sends(events, 14)
    assert isinstance(joined, sig.Joined) and joined.member == 4
    assert [type(m) for m in sends(events, 11)] == [sig.MemberJoined]


def test_a_stranger_cannot_take_a_code_after_a_restart() -> None:
    reg = make()
    code, ticket = formed(reg)
    stranger = open_session(reg, conn=7)  # a session of its own, and so a ticket of its own
    own = ticket_of(reg, 7)
    again = make(seed=2)
    forged = (bytes(32)).hex()
    for case, over in [
        ("a made-up ticket", {"ticket": forged}),
        ("its own session's ticket", {"ticket": own}),
        ("the host's ticket with its own verifier", {"verifier": WRONG_KEY.hex()}),
        ("the host's ticket with another salt", {"salt": bytes(16).hex()}),
    ]:
        args = {"ticket": ticket} | over
        got = reopen(again, 20, code, **args)
        assert isinstance(got, sig.Error) and got.code == "bad_ticket", case
        assert "never gave that ticket" in got.message, case
    assert code not in again.sessions and stranger != code
    # the host comes back; a second reopen (a replayed one) cannot push it out
    assert isinstance(reopen(again, 11, code, ticket), sig.Opened)
    got = reopen(again, 21, code, ticket)
    assert isinstance(got, sig.Error) and got.code == "member_present"
    assert again.conns[11].session == code


def test_a_rendezvous_that_kept_no_secret_says_why_no_session_survives_its_restart() -> None:
    code, ticket = formed(make(kept=None))
    got = reopen(make(kept=None), 11, code, ticket)
    assert isinstance(got, sig.Error) and got.code == "bad_ticket"
    assert "new secret at each start (no --relay-secret-file)" in got.message


def test_members_back_before_their_host_count_as_not_reopened_not_as_rejected_joins() -> None:
    """Members reconnect after a restart before their host re-opened the session: their refused
    rejoins are `not_reopened` on the joins counter (KafilaJoinsRejected ignores it), while a join of
    a code it does not know and a wrong proof count as before; the error members see stays
    `unknown_session` (a code they retry on)."""
    from prometheus_client import generate_latest

    from kafila.rendezvous.metrics import make_registry
    from tests.obs.test_metrics import value

    code, ticket = formed(make())
    again = make(seed=2)
    for conn, member in ((12, 2), (13, 3), (14, 2)):
        (early,) = sends(rejoin(again, conn, code, member), conn)
        assert isinstance(early, sig.Error) and early.code == "unknown_session"
    assert isinstance(sends(join(again, 15, code), 15)[0], sig.Error)  # a new member's join: a guess
    reopen(again, 11, code, ticket)
    assert isinstance(sends(rejoin(again, 16, code, 3, key=WRONG_KEY), 16)[0], sig.Error)
    assert again.joins == {"not_reopened": 3, "unknown_session": 1, "wrong_secret": 1}
    text = generate_latest(make_registry(again)).decode()
    counted = {
        o: value(text, "kafila_rendezvous_joins_total", outcome=o)
        for o in ("not_reopened", "unknown_session", "wrong_secret", "rejoined")
    }
    assert counted == {"not_reopened": 3, "unknown_session": 1, "wrong_secret": 1, "rejoined": 0}


def test_a_place_is_taken_back_only_by_whoever_proves_the_code_and_only_its_own() -> None:
    code, ticket = formed(make())
    again = make(seed=2)
    early = sends(rejoin(again, 12, code, 2), 12)[0]  # before the host re-opened: retry later
    assert isinstance(early, sig.Error) and early.code == "unknown_session"
    assert "has not re-registered it" in early.message
    reopen(again, 11, code, ticket)
    wrong = sends(rejoin(again, 13, code, 2, key=WRONG_KEY), 13)[0]
    assert (
        isinstance(wrong, sig.Error)
        and wrong.code == "wrong_secret"
        and 2 not in again.sessions[code].members
    )
    never = sends(rejoin(again, 14, code, 9), 14)[0]
    assert isinstance(never, sig.Error) and never.code == "unknown_member"
    host = sends(rejoin(again, 15, code, 1), 15)[0]
    assert isinstance(host, sig.Error) and host.code == "member_present"
    assert isinstance(sends(rejoin(again, 16, code, 2), 16)[0], sig.Joined)
    twice = sends(rejoin(again, 17, code, 2), 17)[0]
    assert isinstance(twice, sig.Error) and twice.code == "member_present"


def test_a_nonce_serves_one_kind_of_request_for_one_place() -> None:
    code, ticket = formed(make())
    again = make(seed=2)
    reopen(again, 11, code, ticket)
    again.connect(12, "10.0.1.12", 0.0)
    # a rejoin challenge for member 2 proves nothing for member 3, nor for a plain join
    (challenge,) = sends(again.receive(12, sig.RejoinChallenge(code, 2), 0.0))
    assert isinstance(challenge, sig.Challenge)
    proof = join_proof(KEY, code, bytes.fromhex(challenge.nonce)).hex()
    (err,) = sends(again.receive(12, sig.Rejoin(code, proof, 3, "m", {}), 0.0))
    assert isinstance(err, sig.Error) and err.code == "no_challenge"
    (challenge,) = sends(again.receive(12, sig.RejoinChallenge(code, 2), 0.0))
    proof = join_proof(KEY, code, bytes.fromhex(challenge.nonce)).hex()  # type: ignore[union-attr]
    (err,) = sends(again.receive(12, sig.Join(code, proof, "m", {}), 0.0))
    assert isinstance(err, sig.Error) and err.code == "no_challenge"
    # and a join's nonce does not take a place back
    (challenge,) = sends(again.receive(12, sig.JoinChallenge(code), 0.0))
    proof = join_proof(KEY, code, bytes.fromhex(challenge.nonce)).hex()  # type: ignore[union-attr]
    (err,) = sends(again.receive(12, sig.Rejoin(code, proof, 2, "m", {}), 0.0))
    assert isinstance(err, sig.Error) and err.code == "no_challenge"


def test_only_the_host_gets_the_ticket_and_only_once_protected() -> None:
    reg = make()
    reg.connect(1, "10.0.0.1", 0.0)
    reg.receive(1, sig.Open("m", 3, "host", {}), 0.0)
    (early,) = sends(reg.receive(1, sig.TicketRequest("t"), 0.0))
    assert isinstance(early, sig.Error) and early.code == "not_ready"
    code = next(iter(reg.sessions))
    reg.receive(1, sig.Protect(SALT.hex(), KEY.hex()), 0.0)
    join(reg, 2, code)
    (refused,) = sends(reg.receive(2, sig.TicketRequest("t"), 0.0))
    assert isinstance(refused, sig.Error) and refused.code == "not_host"


def test_a_reopened_session_outlives_its_code_time_while_its_members_come_back() -> None:
    """A formed session of one, or one whose members are slow to come back, is not dissolved as
    "nobody joined" when its code's time passes: its host keeps its place."""
    code, ticket = formed(make())
    again = make(seed=2)
    reopen(again, 11, code, ticket)
    again.receive(11, sig.Heartbeat(), 599.0)
    events = again.tick(601.0)
    assert code in again.sessions and not any(isinstance(m, sig.Error) for m in sends(events))
    assert isinstance(sends(rejoin(again, 12, code, 2, now=601.0), 12)[0], sig.Joined)


def test_a_host_whose_own_connection_dropped_takes_its_place_back_in_the_running_session() -> None:
    reg = make()
    code, ticket = formed(reg)
    events = reg.disconnect(1, 1.0)
    assert [type(m) for m in sends(events, 2)] == [sig.MemberLeft]
    opened = reopen(reg, 11, code, ticket, now=2.0)
    assert isinstance(opened, sig.Opened) and opened.member == 1
    assert sorted(reg.sessions[code].members) == [1, 2, 3]


def test_limits_hold_for_re_registration() -> None:
    limits = dataclasses.replace(Limits(), open_burst_per_address=1)
    reg = Registry(limits, kept_secret=KEPT)
    code, ticket = formed(reg)
    again = Registry(limits, kept_secret=KEPT)
    again.connect(30, "10.0.9.9", 0.0)
    again.receive(30, sig.Open("m", 2, "x", {}), 0.0)  # the address's one open
    again.connect(31, "10.0.9.9", 0.0)
    got = reopen(again, 31, code, ticket)
    assert isinstance(got, sig.Error) and got.code == "rate_limited"


def test_a_member_timed_out_without_a_restart_takes_its_place_back() -> None:
    """A laptop that slept past the heartbeat timeout: the rendezvous dropped it (`timed_out`); on
    waking it takes its own place back in the running session, the others see it back."""
    reg = make()
    code, _ = formed(reg)
    for conn in (1, 3):
        reg.receive(conn, sig.Heartbeat(), 29.0)
    events = reg.tick(31.0)
    assert [m.code for m in sends(events, 2) if isinstance(m, sig.Error)] == ["timed_out"]
    assert 2 not in reg.sessions[code].members
    events = rejoin(reg, 12, code, 2, now=32.0)
    assert isinstance(sends(events, 12)[0], sig.Joined)
    assert [type(m) for m in sends(events, 1)] == [sig.MemberUpdated]


def test_the_restarted_relay_learns_whose_channels_it_took_back_from_members_registering_again() -> None:
    """A relay channel taken back from its tokens after a restart knows neither session nor members;
    the members name their legs when they take their places back, so it is the session's again:
    counted in its limits, released when a member leaves, and the one a new request for the edge
    gets. A leg named with a token the secret did not sign changes nothing."""
    from kafila.proto import udp
    from kafila.rendezvous.relay import RelayTable

    limits = Limits()
    reg = Registry(limits, RelayTable(limits, KEPT), kept_secret=KEPT)
    code, ticket = formed(reg)
    events = reg.receive(2, sig.RelayRequest(3, "r"), 0.0)
    grants = {
        e.conn: e.message for e in events if isinstance(e, Send) and isinstance(e.message, sig.RelayAllocated)
    }
    two, three = grants[2], grants[3]
    relay = RelayTable(limits, KEPT, started=100.0)  # restarted: the link re-binds its leg first
    ack = relay.bind(udp.RelayBind(two.channel, bytes.fromhex(two.token)), ("10.0.0.2", 5000), 0, 100.0)
    assert isinstance(ack, udp.RelayBindAck) and relay.channels[two.channel].session.startswith("recovered-")
    again = Registry(limits, relay, kept_secret=KEPT)
    reopen(again, 11, code, ticket, now=101.0)
    forged = sig.relay_leg_claim(two.channel, two.leg, 1, "00" * 16)
    rejoin(again, 12, code, 2, now=101.0, relays=(forged,))
    assert relay.channels[two.channel].session.startswith("recovered-")  # not the session's
    again.receive(12, sig.Leave(), 101.5)
    rejoin(again, 13, code, 2, now=102.0, relays=(sig.relay_leg_claim(two.channel, two.leg, 3, two.token),))
    channel = relay.channels[two.channel]
    assert channel.session == code and {g.member for g in channel.legs} == {2, 3}
    rejoin(
        again, 14, code, 3, now=102.0, relays=(sig.relay_leg_claim(three.channel, three.leg, 2, three.token),)
    )
    assert [g.member for g in channel.legs] == [g.member for g in reg.relay.channels[two.channel].legs]
    # a new request for the edge gets the same channel, and leaving releases it
    events = again.receive(14, sig.RelayRequest(2, "again"), 103.0)
    assert {m.channel for m in sends(events) if isinstance(m, sig.RelayAllocated)} == {two.channel}
    again.receive(13, sig.Leave(), 104.0)
    assert two.channel not in relay.channels
