"""The epoch messages the host and its members exchange on their control links after forming
(kafila.proto.session: `epoch`, `epoch_ready`, `resume`, `epoch_failed`, `ended`, `lost`, `path`,
`decode`, `replaced`, `handover`, `succeeding`): they parse back as sent, and nothing a peer sends
makes a parser raise anything but SessionMessageError."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.proto import session

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
EPOCHS = st.integers(1, session.MAX_EPOCH)
TEXT = st.text(max_size=60)
ORIGINS = st.lists(
    st.tuples(st.text(max_size=8), st.integers(1, session.MAX_ORIGIN)),
    max_size=4,
    unique_by=(lambda p: p[0], lambda p: p[1]),
).map(dict)
SUCCESSION = st.lists(st.text(min_size=1, max_size=8), max_size=5, unique=True).map(tuple)
PROBES = st.dictionaries(
    st.text(max_size=8), st.dictionaries(st.text(max_size=6), JSON, max_size=3), max_size=3
)
EPOCH_MESSAGES = st.one_of(
    st.builds(
        session.NewEpoch,
        EPOCHS,
        st.dictionaries(st.text(max_size=8), JSON, max_size=4),
        TEXT,
        st.none() | st.dictionaries(st.text(max_size=8), st.integers(1, 99), max_size=4),
        ORIGINS,
        SUCCESSION,
        PROBES,
    ),
    st.builds(session.EpochReady, EPOCHS),
    st.builds(session.Resume, EPOCHS),
    st.builds(session.EpochFailed, EPOCHS, TEXT),
    st.builds(session.SessionEnded, TEXT),
    st.builds(session.MemberLost, TEXT, TEXT, TEXT),
    st.builds(session.PathReport, TEXT, st.booleans()),
    st.tuples(st.integers(0, 10**6), st.integers(0, 10**6), st.integers(0, 10**6), st.floats(0.0, 10.0)).map(
        lambda t: session.DecodeCounts(t[0], t[1] + t[2], t[2], t[3])
    ),
    st.builds(session.Replaced, TEXT, EPOCHS),
    st.builds(session.HandOver, TEXT, EPOCHS),
    st.builds(session.Succeeding, TEXT, EPOCHS, TEXT),
)


@settings(max_examples=150, deadline=None)
@given(EPOCH_MESSAGES)
def test_epoch_messages_parse_back_as_sent(msg: Any) -> None:
    data = session.encode(msg)
    assert session.parse_epoch(data) == msg
    assert json.loads(data)[session.KEY] == session.SESSION_VERSION


@settings(max_examples=250, deadline=None)
@given(EPOCH_MESSAGES, st.text(max_size=12), JSON)
def test_an_epoch_message_with_any_field_changed_is_refused_or_parsed(msg: Any, key: str, value: Any) -> None:
    data = json.dumps(msg.body() | {key: value}).encode()
    with contextlib.suppress(session.SessionMessageError):
        session.parse_epoch(data)


@settings(max_examples=250, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_refused_or_parsed(data: bytes) -> None:
    with contextlib.suppress(session.SessionMessageError):
        session.parse_epoch(data)


def test_an_epoch_message_names_what_is_wrong() -> None:
    with pytest.raises(session.SessionMessageError, match="epoch must be an integer from 1"):
        session.parse_epoch(json.dumps(session.payload("resume", epoch=0)).encode())
    with pytest.raises(session.SessionMessageError, match="epoch must be an integer"):
        session.parse_epoch(json.dumps(session.payload("epoch_ready", epoch=True)).encode())
    with pytest.raises(session.SessionMessageError, match="unknown epoch message op 'formed'"):
        session.parse_epoch(json.dumps(session.payload("formed")).encode())
    with pytest.raises(
        session.SessionMessageError, match="epoch: missing \\['origins', 'plan', 'probes', 'succession'\\]"
    ):
        session.parse_epoch(json.dumps(session.payload("epoch", epoch=2, cause="x")).encode())
    with pytest.raises(session.SessionMessageError, match="epoch: origins \\[2\\] are given to more"):
        body = session.NewEpoch(2, {}, "x", origins={"a": 2}).body() | {"origins": {"a": 2, "b": 2}}
        session.parse_epoch(json.dumps(body).encode())
    with pytest.raises(session.SessionMessageError, match="epoch: succession names \\['c'\\] more than once"):
        body = session.NewEpoch(2, {}, "x", succession=("c",)).body() | {"succession": ["c", "c"]}
        session.parse_epoch(json.dumps(body).encode())
    with pytest.raises(session.SessionMessageError, match="lost: unknown \\['extra'\\]"):
        body = session.MemberLost("b", "silent", "gone").body() | {"extra": 1}
        session.parse_epoch(json.dumps(body).encode())
    with pytest.raises(session.SessionMessageError, match="replaced: missing \\['epoch'\\]"):
        session.parse_epoch(json.dumps(session.payload("replaced", by="b")).encode())
    with pytest.raises(session.SessionMessageError, match="succeeding: missing \\['doing'\\]"):
        session.parse_epoch(json.dumps(session.payload("succeeding", host="h", epoch=3)).encode())
    with pytest.raises(session.SessionMessageError, match="direct must be true or false, got 1"):
        session.parse_epoch(json.dumps(session.payload("path", peer="b", direct=1)).encode())
    with pytest.raises(
        session.SessionMessageError, match="circuits must be a count from 0 to 2\\*\\*53, got -1"
    ):
        body = session.DecodeCounts(3, 2, 1, 0.05).body() | {"circuits": -1}
        session.parse_epoch(json.dumps(body).encode())
    with pytest.raises(session.SessionMessageError, match="3 circuits keeping 4 of 2 drafted tokens"):
        session.parse_epoch(json.dumps(session.DecodeCounts(3, 2, 1, 0.0).body() | {"accepted": 4}).encode())
    with pytest.raises(
        session.SessionMessageError, match=r"row_share must be a finite share >= 0, got -0\.5"
    ):
        session.parse_epoch(
            json.dumps(session.DecodeCounts(3, 2, 1, 0.0).body() | {"row_share": -0.5}).encode()
        )
    with pytest.raises(session.SessionMessageError, match="not JSON"):
        session.parse_epoch(b"\xff{")
    with pytest.raises(session.SessionMessageError, match="not JSON"):
        session.parse_epoch(b"[" * 100_000)  # too deep to parse
    with pytest.raises(session.SessionMessageError, match="more than"):
        session.parse_epoch(b" " * (session.MAX_CONTROL_BYTES + 1))
