"""A member takes the place of its session's lost host (pure registry): it proves the code over a
fresh nonce, only once the host is gone from the rendezvous; the session then takes joins through
it under the same code, and the lost host cannot re-open the session over it."""

from __future__ import annotations

from kafila.proto import signaling as sig
from kafila.proto.codes import join_proof
from kafila.rendezvous.registry import Event, Registry
from tests.rendezvous.test_registry import KEY, WRONG_KEY, join, make, open_session, sends
from tests.rendezvous.test_reregister import formed, reopen
from tests.rendezvous.test_reregister import make as make_kept


def succeed(reg: Registry, conn: int, code: str, now: float = 0.0, key: bytes = KEY) -> list[Event]:
    """A succession as a member makes it: a challenge, then the proof of `key` over its nonce."""
    events = reg.receive(conn, sig.SucceedChallenge(code, "c"), now)
    challenge = sends(events, conn)[0]
    if not isinstance(challenge, sig.Challenge):
        return events
    proof = join_proof(key, challenge.session, bytes.fromhex(challenge.nonce))
    return reg.receive(conn, sig.Succeed(code, proof.hex(), "s"), now)


def three(reg: Registry) -> str:
    code = open_session(reg)
    join(reg, 2, code)
    join(reg, 3, code)
    return code


def test_a_member_takes_the_place_of_a_host_that_left_and_the_session_takes_joins_through_it() -> None:
    reg = make()
    code = three(reg)
    reg.disconnect(1, 1.0)  # the host's process was killed: its connection closed
    events = succeed(reg, 2, code, 2.0)
    (joined,) = sends(events, 2)
    assert isinstance(joined, sig.Joined) and joined.ref == "s" and joined.member == 2
    assert [(m.id, m.host) for m in joined.members] == [(2, True), (3, False)]
    (told,) = sends(events, 3)
    assert isinstance(told, sig.MemberUpdated) and told.member.id == 2 and told.member.host
    assert reg.joins["succeeded"] == 1
    # a newcomer joins with the same code and finds the new host among the members
    events = join(reg, 4, code, 3.0)
    (new,) = sends(events, 4)
    assert isinstance(new, sig.Joined) and new.member == 4
    assert [m.id for m in new.members if m.host] == [2]
    assert [type(m) for m in sends(events, 2)] == [sig.MemberJoined]
    # the new host's powers: it removes a member, and gets the session's re-open ticket
    assert isinstance(sends(reg.receive(2, sig.TicketRequest("t"), 3.0), 2)[0], sig.Ticket)
    reg.receive(2, sig.Remove(4, "not admitted"), 3.0)
    assert 4 not in reg.sessions[code].members


def test_no_member_takes_the_place_of_a_host_still_present_until_it_timed_out() -> None:
    reg = make()
    code = three(reg)
    got = sends(succeed(reg, 2, code, 5.0), 2)[0]
    assert isinstance(got, sig.Error) and got.code == "member_present"
    assert "host (member 1, host1) is still connected, silent for 5 s" in got.message
    assert "retry after 30 s of its silence" in got.message
    reg.receive(2, sig.Heartbeat(), 20.0)
    reg.receive(3, sig.Heartbeat(), 20.0)
    reg.tick(31.0)  # the frozen host timed out; the others beat
    assert 1 not in reg.sessions[code].members
    assert isinstance(sends(succeed(reg, 2, code, 31.0), 2)[0], sig.Joined)
    # the first member to take over holds the place: the next one is told who is host
    got = sends(succeed(reg, 3, code, 32.0), 3)[0]
    assert isinstance(got, sig.Error) and got.code == "member_present" and "member 2, m2" in got.message
    again = sends(succeed(reg, 2, code, 32.0), 2)[0]
    assert isinstance(again, sig.Error) and again.code == "already_host"


def test_a_succession_proves_the_code_over_a_fresh_nonce_and_a_wrong_proof_counts_as_a_joins() -> None:
    reg = make()
    code = three(reg)
    reg.disconnect(1, 1.0)
    got = sends(succeed(reg, 2, code, 2.0, key=WRONG_KEY), 2)[0]
    assert isinstance(got, sig.Error) and got.code == "wrong_secret"
    assert reg.joins["wrong_secret"] == 1
    assert not reg.sessions[code].members[2].info.host
    # no nonce, or one given for a join: refused untested
    got = sends(reg.receive(2, sig.Succeed(code, "00" * 32, "s"), 20.0), 2)[0]
    assert isinstance(got, sig.Error) and got.code == "no_challenge"
    # another session's code, or a connection in no session
    other = open_session(reg, conn=9)
    got = sends(reg.receive(2, sig.SucceedChallenge(other, "c"), 20.0), 2)[0]
    assert isinstance(got, sig.Error) and got.code == "bad_code"
    reg.connect(10, "10.0.0.10", 20.0)
    got = sends(reg.receive(10, sig.SucceedChallenge(code, "c"), 20.0), 10)[0]
    assert isinstance(got, sig.Error) and got.code == "not_in_session"
    # after the address's back-off the right proof takes the place
    assert isinstance(sends(succeed(reg, 2, code, 30.0), 2)[0], sig.Joined)


def test_the_lost_host_cannot_reopen_the_session_its_successor_holds() -> None:
    reg = make_kept()
    code, ticket = formed(reg)
    reg.disconnect(1, 1.0)
    assert isinstance(sends(succeed(reg, 2, code, 2.0), 2)[0], sig.Joined)
    got = reopen(reg, 11, code, ticket, now=3.0)  # the old host, woken, registers again
    assert isinstance(got, sig.Error) and got.code == "replaced"
    assert "member 2 (m2) took session" in got.message and "after member 1 was lost" in got.message
    assert [m.id for m in reg.sessions[code].members.values() if m.info.host] == [2]
