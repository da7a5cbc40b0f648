"""Signaling messages: round trips, strict validation with clear messages, and fuzzing."""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import fields
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.proto import signaling as sig
from kafila.proto.errors import ProtocolError

INFO = sig.MemberInfo(
    id=2,
    name="desk",
    host=False,
    address="198.51.100.4",
    capability={"bw": 21.5},
    candidates=["10.0.0.2:5000"],
)
CLIENT = [
    sig.Open("smollm2-135m", 3, "laptop", {"mem_gb": 16}, {"class": "ordinary"}, ["192.168.1.5:4000"], "r1"),
    sig.Protect("00" * 16, "ab" * 32, "r0"),
    sig.JoinChallenge("4-k7m2", "r5"),
    sig.Join("4-k7m2", "cd" * 32, "desk", {}, None, [], None),
    sig.TicketRequest("r6"),
    sig.Reopen(
        "4-k7m2",
        "aa" * 32,
        "00" * 16,
        "ab" * 32,
        1,
        4,
        "smollm2-135m",
        3,
        "laptop",
        {},
        relays=[sig.relay_leg_claim(4_000_000_000, 1, 3, "cd" * 16)],
        ref="r7",
    ),
    sig.RejoinChallenge("4-k7m2", 3, "r8"),
    sig.Rejoin("4-k7m2", "cd" * 32, 3, "desk", {"role": "member"}, {"class": "ordinary"}, ["10.0.0.2:5000"]),
    sig.Update(nat={"class": "restrictive"}),
    sig.Update(),
    sig.Signal(3, {"kind": "offer", "nested": {"a": [1, 2.5, None, True]}}),
    sig.RelayRequest(1, "r9"),
    sig.Heartbeat(),
    sig.Leave("done"),
    sig.Remove(2, "failed to prove the secret word"),
]
SERVER = [
    sig.Opened("4-k7m2", 1, 600.0, 10.0, 3478, 3479, "203.0.113.9", "r1"),
    sig.Protected("4-k7m2", "r0"),
    sig.Ticket("4-k7m2", "aa" * 32, True, "r6"),
    sig.Challenge("4-k7m2", "00" * 16, "ef" * 16, 30.0, "r5"),
    sig.Joined("4-k7m2", 2, "smollm2-135m", 3, [INFO], 10.0),
    sig.MemberJoined(INFO),
    sig.MemberUpdated(INFO),
    sig.SignalFrom(1, {"x": "y"}),
    sig.RelayAllocated(99, 1, 0, "ab" * 16, "r4"),
    sig.HeartbeatAck("r2"),
    sig.MemberLeft(3, "timed_out"),
    sig.MemberLeft(2, "removed"),
    sig.Error("session_full", "session 4-k7m2 already has its 3 members", True, "r3"),
]


@pytest.mark.parametrize("msg", CLIENT, ids=lambda m: type(m).__name__)
def test_client_round_trip(msg: sig.ClientMessage) -> None:
    text = sig.encode(msg)
    assert json.loads(text)["v"] == sig.VERSION
    assert sig.decode_client(text) == msg


@pytest.mark.parametrize("msg", SERVER, ids=lambda m: type(m).__name__)
def test_server_round_trip(msg: sig.ServerMessage) -> None:
    assert sig.decode_server(sig.encode(msg)) == msg


def test_signal_sender_travels_as_from() -> None:
    assert json.loads(sig.encode(sig.SignalFrom(4, {})))["from"] == 4


REOPEN: dict[str, Any] = {
    "session": "4-k7m2",
    "ticket": "aa" * 32,
    "salt": "00" * 16,
    "verifier": "ab" * 32,
    "member": 1,
    "next_member": 4,
    "model": "m",
    "members_expected": 3,
    "name": "laptop",
    "capability": {},
}


def _frame(kind: str, **fields: Any) -> str:
    return json.dumps({"v": sig.VERSION, "type": kind, **fields})


@pytest.mark.parametrize(
    ("text", "code", "words"),
    [
        ("not json", "bad_message", "not valid JSON"),
        ("[1]", "bad_message", "must be a JSON object, got array"),
        ('{"type": "heartbeat"}', "unsupported_version", "version None is not supported"),
        ('{"v": true, "type": "heartbeat"}', "unsupported_version", "version True"),
        (
            '{"v": 1, "type": "heartbeat"}',
            "unsupported_version",
            "version 1 is not supported: this side speaks version 2; upgrade kafila",
        ),
        ('{"v": 2, "type": "dance"}', "unknown_type", "unknown message type 'dance'"),
        ('{"v": 2, "type": "opened"}', "unknown_type", "unknown message type 'opened'"),
        (_frame("heartbeat", extra=1), "bad_message", "heartbeat: unknown field(s) ['extra']"),
        (_frame("join", name="x", capability={}), "bad_message", "join: missing field 'session'"),
        (
            _frame("join", session="4-k7m2", name="x", capability={}),
            "bad_message",
            "join: missing field 'proof'",
        ),
        (_frame("signal", to="3", payload={}), "bad_message", "signal.to: expected integer, got string"),
        (_frame("signal", to=True, payload={}), "bad_message", "signal.to: expected integer, got boolean"),
        (_frame("signal", to=0, payload={}), "bad_message", "signal.to: 0 is below the minimum 1"),
        (_frame("signal", to=2, payload=[]), "bad_message", "signal.payload: expected object, got array"),
        (
            _frame("join", session="4-k7m2", proof="", name="x" * 65, capability={}),
            "bad_message",
            "65 characters",
        ),
        (
            _frame("join", session="4-k7m2", proof="", name="a\nb", capability={}),
            "bad_message",
            "control characters",
        ),
        (_frame("update", candidates=["a"] * 17), "bad_message", "17 items, at most 16"),
        (_frame("update", candidates=[1]), "bad_message", "update.candidates[0]: expected string"),
        (_frame("remove", member=0, reason="x"), "bad_message", "remove.member: 0 is below the minimum 1"),
        (_frame("remove", member=2), "bad_message", "remove: missing field 'reason'"),
        (_frame("remove", member=2, reason="x" * 201), "bad_message", "remove.reason: 201 characters"),
        # re-registering after a restart: the ids, the ticket and the proof are checked as strictly
        (
            _frame("rejoin_challenge", session="4-k7m2"),
            "bad_message",
            "rejoin_challenge: missing field 'member'",
        ),
        (
            _frame("rejoin_challenge", session="4-k7m2", member=0),
            "bad_message",
            "rejoin_challenge.member: 0 is below the minimum 1",
        ),
        (
            _frame("rejoin", session="4-k7m2", proof="", member="2", name="x", capability={}),
            "bad_message",
            "rejoin.member: expected integer, got string",
        ),
        (
            _frame("rejoin", session="4-k7m2", member=2, name="x", capability={}),
            "bad_message",
            "rejoin: missing field 'proof'",
        ),
        (
            _frame("ticket_request", session="4-k7m2"),
            "bad_message",
            "ticket_request: unknown field(s) ['session']",
        ),
        (
            _frame("reopen", **{**REOPEN, "next_member": 1}),
            "bad_message",
            "reopen.next_member: 1 is below the minimum 2",
        ),
        (
            _frame("reopen", **{**REOPEN, "ticket": "ab" * 65}),
            "bad_message",
            "reopen.ticket: 130 characters, at most 128",
        ),
        (
            _frame("reopen", **{**REOPEN, "member": True}),
            "bad_message",
            "reopen.member: expected integer, got boolean",
        ),
        (
            _frame("reopen", **{k: v for k, v in REOPEN.items() if k != "verifier"}),
            "bad_message",
            "reopen: missing field 'verifier'",
        ),
        ('{"v": 2, "v": 2, "type": "heartbeat"}', "bad_message", "duplicate key 'v'"),
        ('{"v": 2, "type": "open", "members_expected": NaN}', "bad_message", "NaN is not allowed"),
        # a number beyond a float reads as inf: the server could not send the message on to anyone
        ('{"v":2,"type":"signal","to":2,"payload":{"x":1e400}}', "bad_message", "number 1e400 is beyond"),
        ('{"v":2,"type":"update","nat":{"rtt":-1e999}}', "bad_message", "number -1e999 is beyond"),
    ],
)
def test_bad_frames_name_the_problem(text: str, code: str, words: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(words)) as info:
        sig.decode_client(text)
    assert info.value.code == code


def test_a_member_and_a_rendezvous_of_different_versions_read_why_they_cannot_talk() -> None:
    """An error is the one message both versions share: a v1 member gets the refusal in v1's
    envelope (same fields), and a v2 member reads a v1 rendezvous's refusal of its frames."""
    with pytest.raises(ProtocolError) as info:
        sig.decode_client('{"v": 1, "type": "join", "session": "4-k7m2", "name": "x", "capability": {}}')
    assert info.value.code == "unsupported_version" and info.value.version == 1
    err = sig.Error("unsupported_version", str(info.value), fatal=True)
    old = json.loads(sig.encode(err, version=1))
    assert old["v"] == 1 and old["message"].startswith("signaling protocol version 1 is not supported")
    from_old_rendezvous = json.dumps(
        {
            "v": 1,
            "type": "error",
            "code": "unsupported_version",
            "message": "protocol version 2 not supported",
        }
    )
    assert sig.decode_server(from_old_rendezvous).code == "unsupported_version"  # type: ignore[union-attr]
    with pytest.raises(ProtocolError, match="version 1"):
        sig.decode_server('{"v": 1, "type": "heartbeat_ack"}')
    with pytest.raises(ValueError, match="only an error"):
        sig.encode(sig.HeartbeatAck(), version=1)


def test_a_bad_request_keeps_its_readable_ref_for_the_error_reply() -> None:
    refs = {"r7": "r7", None: None, 7: None, "": None, "x" * (sig.MAX_REF + 1): None}
    for ref, kept in refs.items():
        frame = _frame("open", members_expected=0, model="m", name="h", capability={}, ref=ref)
        with pytest.raises(ProtocolError, match="members_expected: 0 is below the minimum 1") as info:
            sig.decode_client(frame)
        assert info.value.ref == kept, ref
    with pytest.raises(ProtocolError) as info:
        sig.decode_client("not json")
    assert info.value.ref is None


def test_size_limits() -> None:
    big = _frame("signal", to=2, payload={"blob": "x" * sig.MAX_MESSAGE_BYTES})
    with pytest.raises(ProtocolError, match=r"exceeds the limit of 65536") as info:
        sig.decode_client(big)
    assert info.value.code == "too_large"
    over_payload = _frame("signal", to=2, payload={"blob": "x" * sig.MAX_PAYLOAD_BYTES})
    with pytest.raises(ProtocolError, match=r"signal.payload: \d+ bytes, at most 49152"):
        sig.decode_client(over_payload)


def test_depth_limits() -> None:
    deep: Any = {}
    for _ in range(sig.MAX_DEPTH + 2):
        deep = {"a": deep}
    with pytest.raises(ProtocolError, match="nested deeper than 16"):
        sig.decode_client(_frame("signal", to=2, payload=deep))
    with pytest.raises(ProtocolError, match="nested too deeply"):
        sig.decode_client("[" * 50_000 + "]" * 50_000, max_bytes=200_000)


def test_lone_surrogates_in_payload_survive_encoding() -> None:
    msg = sig.decode_client('{"v":2,"type":"signal","to":2,"payload":{"s":"\\ud800"}}')
    assert sig.decode_client(sig.encode(msg)) == msg


# ------------------------------------------------------------------ fuzzing

JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12,
)
FIELD_NAMES = sorted({f.name for cls in (*sig.CLIENT_TYPES.values(), sig.MemberInfo) for f in fields(cls)})


@st.composite
def almost_messages(draw: st.DrawFn) -> dict[str, Any]:
    """Objects shaped like messages: a real type, real field names, arbitrary values."""
    obj: dict[str, Any] = {
        "v": draw(st.sampled_from([1, 1, 1, 2])),
        "type": draw(st.sampled_from(list(sig.CLIENT_TYPES))),
    }
    for name in draw(st.lists(st.sampled_from([*FIELD_NAMES, "zzz"]), max_size=6, unique=True)):
        obj[name] = draw(JSON | st.sampled_from([1, 3, "4-k7m2", {}, [], ["1.2.3.4:5"]]))
    return obj


@settings(max_examples=120, deadline=None)
@given(almost_messages())
def test_fuzz_structured(obj: dict[str, Any]) -> None:
    text = json.dumps(obj)
    try:
        msg = sig.decode_client(text)
    except ProtocolError as exc:
        assert str(exc) and exc.code
        return
    assert sig.decode_client(sig.encode(msg)) == msg


@settings(deadline=None)
@given(st.text(max_size=200) | st.binary(max_size=200))
def test_fuzz_raw(data: str | bytes) -> None:
    for decode in (sig.decode_client, sig.decode_server):
        with contextlib.suppress(ProtocolError):
            decode(data)


@settings(max_examples=40, deadline=None)
@given(JSON)
def test_fuzz_server_side_decoder(value: Any) -> None:
    for kind in sig.SERVER_TYPES:
        obj = {"v": sig.VERSION, "type": kind, "member": value, "payload": value}
        obj |= {"members": value, "from": value}
        with contextlib.suppress(ProtocolError):
            sig.decode_server(json.dumps(obj))


@pytest.mark.parametrize(
    ("typed", "url"),
    [
        ("rdv.example.org", "ws://rdv.example.org:8470/v1/signal"),
        ("  10.0.0.5:9000 ", "ws://10.0.0.5:9000/v1/signal"),
        ("[2001:db8::1]", "ws://[2001:db8::1]:8470/v1/signal"),
        ("[2001:db8::1]:9000", "ws://[2001:db8::1]:9000/v1/signal"),
        ("http://rdv.example.org", "ws://rdv.example.org/v1/signal"),
        ("HTTPS://rdv.example.org/", "wss://rdv.example.org/v1/signal"),
        ("wss://[2001:db8::1]:443/custom?k=1", "wss://[2001:db8::1]:443/custom?k=1"),
        ("ws://127.0.0.1:8470/v1/signal", "ws://127.0.0.1:8470/v1/signal"),
    ],
)
def test_signal_url_accepts_what_a_person_types(typed: str, url: str) -> None:
    assert sig.signal_url(typed) == url


@pytest.mark.parametrize(
    ("typed", "says"),
    [
        ("ftp://rdv.example.org", "give a ws://, wss://, http:// or https:// URL, or HOST[:PORT]"),
        ("rdv.example.org:99999", "out of range"),
        ("rdv.example.org:port", "'rdv.example.org:port' is not a rendezvous address"),
        ("http://", "it names no host"),
    ],
)
def test_signal_url_refuses_naming_what_is_wrong(typed: str, says: str) -> None:
    with pytest.raises(ValueError, match=re.escape(says)):
        sig.signal_url(typed)


def test_the_rendezvous_sends_tickets_and_members_send_the_re_registration_not_the_other_way() -> None:
    """Each side reads only its own direction: a member cannot be sent a `reopen`, and a `ticket`
    from a member is not a message the rendezvous takes."""
    with pytest.raises(ProtocolError, match="unknown message type 'ticket'") as info:
        sig.decode_client(sig.encode(sig.Ticket("4-k7m2", "aa" * 32)))
    assert info.value.code == "unknown_type"
    with pytest.raises(ProtocolError, match="unknown message type 'rejoin'"):
        sig.decode_server(sig.encode(sig.Rejoin("4-k7m2", "cd" * 32, 3, "desk", {})))


def test_a_relay_leg_named_when_registering_again_reads_back_and_nothing_else_does() -> None:
    claim = sig.relay_leg_claim(4_000_000_000, 1, 3, "cd" * 16)
    assert len(claim) <= sig.MAX_CANDIDATE  # fits a list item of the message
    assert sig.parse_relay_leg_claim(claim) == (4_000_000_000, 1, 3, bytes.fromhex("cd" * 16))
    for bad in [
        "1/0/2",
        "1/0/2/cd/x",
        f"0/0/2/{'cd' * 16}",
        f"1/2/2/{'cd' * 16}",
        f"1/0/0/{'cd' * 16}",
        f"{2**32}/0/2/{'cd' * 16}",
        f"+1/0/2/{'cd' * 16}",
        f"1/0/ 2/{'cd' * 16}",
        f"1/0/2/{'cd' * 15}",
        "1/0/2/zz",
        f"١/0/2/{'cd' * 16}",  # an Arabic-Indic digit is a decimal to Python, not here
    ]:
        with pytest.raises(ProtocolError, match="relay leg"):
            sig.parse_relay_leg_claim(bad)
