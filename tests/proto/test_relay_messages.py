"""The relay messages a spare and the host exchange on their control link (kafila.proto.session:
`ask`, `reply`, `chunk`, `drop`): they parse back as sent, and nothing a peer sends makes a parser
raise anything but SessionMessageError."""

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
ASKS = st.integers(1, session.MAX_ASK)
NAMES = st.text(alphabet="abcdefghijklmnopqrstuvwxyz-", min_size=1, max_size=20)
HEADERS = st.lists(st.tuples(NAMES, st.text(max_size=40)), max_size=6).map(tuple)
RELAY_MESSAGES = st.one_of(
    st.builds(
        session.Ask,
        ASKS,
        st.sampled_from(session.RELAY_METHODS),
        st.text(max_size=60).map(lambda p: "/" + p),
        st.text(max_size=60),
        HEADERS,
        st.binary(max_size=300),
    ),
    st.builds(session.Reply, ASKS, st.integers(100, 599), HEADERS),
    st.builds(session.Chunk, ASKS, st.binary(max_size=300), st.booleans()),
    st.builds(session.Drop, ASKS),
)


@settings(max_examples=200, deadline=None)
@given(RELAY_MESSAGES)
def test_relay_messages_parse_back_as_sent(msg: Any) -> None:
    data = session.encode_relay(msg)
    assert session.parse_relay(data) == msg
    assert json.loads(data)[session.KEY] == session.SESSION_VERSION


@settings(max_examples=300, deadline=None)
@given(RELAY_MESSAGES, st.text(max_size=12), JSON)
def test_a_relay_message_with_any_field_changed_is_refused_or_parsed(msg: Any, key: str, value: Any) -> None:
    data = json.dumps(msg.body() | {key: value}).encode()
    with contextlib.suppress(session.SessionMessageError):
        session.parse_relay(data)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200))
def test_any_bytes_are_a_relay_message_or_refused(data: bytes) -> None:
    with contextlib.suppress(session.SessionMessageError):
        session.parse_relay(data)


def test_a_relay_message_names_what_is_wrong() -> None:
    ask = session.Ask(1, "POST", "/v1/chat/completions", "", (("content-type", "application/json"),), b"{}")
    body = ask.body()
    cases = [
        (body | {"ask": 0}, "ask must be an integer from 1"),
        (body | {"method": "BREW"}, "method 'BREW' is none of"),
        (body | {"path": "v1"}, "path must be text from '/'"),
        (body | {"content": "***"}, "content is not base64"),
        (body | {"headers": [["Content-Type", "x"]]}, "lower-case name"),
        (body | {session.KEY: 3}, f"version 3, this member speaks {session.SESSION_VERSION}"),
        (session.Reply(1, 200).body() | {"status": 99}, "status must be an integer from 100 to 599"),
        (session.Chunk(1, b"x").body() | {"end": 1}, "end must be true or false"),
        (session.payload("wave", ask=1), "unknown relay message op 'wave'"),
    ]
    for sent, says in cases:
        with pytest.raises(session.SessionMessageError, match=says):
            session.parse_relay(json.dumps(sent).encode())
    big = b"x" * (session.MAX_RELAY_BYTES + 1)
    with pytest.raises(session.SessionMessageError, match=f"more than {session.MAX_RELAY_BYTES}"):
        session.parse_relay(big)


def test_the_relay_has_a_link_kind_of_its_own() -> None:
    """The ring's records (32) and the epoch messages (33) go on the same control link."""
    from kafila.session.channel import LINK_KIND
    from kafila.session.forming.epochs import CONTROL_KIND

    assert len({session.RELAY_KIND, LINK_KIND, CONTROL_KIND}) == 3
