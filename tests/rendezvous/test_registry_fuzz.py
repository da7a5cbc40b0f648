"""Random sequences of connections, messages, bad frames, disconnects and clock ticks against the
pure registry: no exception, and its books stay consistent after every step."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.proto import signaling as sig
from kafila.proto.errors import ProtocolError
from kafila.rendezvous.limits import Limits
from kafila.rendezvous.registry import Registry, Send

LIMITS = Limits(
    max_sessions=3,
    max_members=4,
    max_connections=6,
    code_ttl_s=20.0,
    heartbeat_timeout_s=15.0,
    join_burst_per_address=4,
    relay_channels_per_session=2,
    max_bad_frames=2,
)
CONNS = st.integers(1, 7)
MEMBER = st.integers(1, 5)


def messages(codes: list[str]) -> st.SearchStrategy[sig.ClientMessage]:
    code = st.sampled_from([*codes, "9-zzzz", "bad"]) if codes else st.sampled_from(["9-zzzz", "bad"])
    return st.one_of(
        st.builds(sig.Open, st.just("m"), st.integers(1, 5), st.just("h"), st.just({})),
        st.builds(sig.JoinChallenge, code),
        st.builds(sig.Join, code, st.text("0123456789abcdef", max_size=64), st.just("j"), st.just({})),
        st.builds(
            sig.Protect, st.text("0123456789abcdef", max_size=64), st.text("0123456789abcdef", max_size=64)
        ),
        st.builds(sig.Update, nat=st.just({"class": "ordinary"})),
        st.builds(sig.Signal, MEMBER, st.just({"k": 1})),
        st.builds(sig.RelayRequest, MEMBER),
        st.builds(sig.Heartbeat),
        st.builds(sig.Leave),
        st.builds(sig.Remove, MEMBER, st.just("fuzz")),
    )


def check_books(reg: Registry) -> None:
    for code, session in reg.sessions.items():
        assert session.members, f"empty session {code} was not dissolved"
        for mid, member in session.members.items():
            conn = reg.conns[member.conn]
            assert (conn.session, conn.member) == (code, mid)
    for conn in reg.conns.values():
        if conn.session is not None:
            assert conn.member in reg.sessions[conn.session].members
    for channel in reg.relay.channels.values():
        members = reg.sessions[channel.session].members
        assert channel.legs[0].member in members and channel.legs[1].member in members


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_random_traffic_keeps_the_registry_consistent(data: st.DataObject) -> None:
    reg = Registry(LIMITS, rand_below=random.Random(0).randrange)
    now = 0.0
    for _ in range(data.draw(st.integers(5, 40))):
        now += data.draw(st.sampled_from([0.0, 0.5, 5.0, 16.0]))
        conn = data.draw(CONNS)
        action = data.draw(
            st.sampled_from(["connect", "message", "message", "message", "bad", "gone", "tick"])
        )
        if action == "connect" and conn not in reg.conns:
            events = reg.connect(conn, f"10.0.0.{conn % 3}", now)
        elif action == "message":
            events = reg.receive(conn, data.draw(messages(list(reg.sessions))), now)
        elif action == "bad":
            events = reg.bad_frame(conn, ProtocolError("fuzz"), now)
        elif action == "gone":
            events = reg.disconnect(conn, now)
        else:
            events = reg.tick(now)
        for event in events:
            if isinstance(event, Send):
                sig.decode_server(sig.encode(event.message))  # everything sent is a valid frame
        check_books(reg)
