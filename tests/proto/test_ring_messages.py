"""Ring-control messages (kafila.proto.ring): what is sent parses back the same, and anything else
is refused with RingMessageError naming what is wrong, never another exception."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.proto import ring as rc
from kafila.proto import tensor as t
from kafila.proto.ring import Cause, Free, RingBroken, RingMessageError, StageFailed

IDS = st.lists(st.integers(min_value=0, max_value=2**62), max_size=20).map(tuple)
TEXT = st.text(max_size=200)
HOP = st.fixed_dictionaries({"member": TEXT, "request_id": st.integers(min_value=0)})
MESSAGES = st.one_of(
    st.builds(RingBroken, TEXT, st.sampled_from(Cause), TEXT),
    st.builds(Free, IDS, st.lists(HOP, max_size=4).map(tuple)),
    st.builds(StageFailed, IDS, TEXT),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(TEXT, inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=150, deadline=None)
@given(MESSAGES)
def test_every_message_parses_back_from_its_frame_and_its_encoding(msg: rc.RingControl) -> None:
    frame = rc.control(msg)
    assert rc.parse(frame) == msg
    decoded = t.decode(t.encode(frame, 1))  # as it crosses a link
    assert isinstance(decoded, t.Control) and rc.parse(decoded) == msg


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(sorted(rc.OPS)), st.dictionaries(TEXT, JSON, max_size=6))
def test_any_other_body_is_refused_with_a_ring_message_error(op: str, body: dict[str, Any]) -> None:
    with contextlib.suppress(RingMessageError):  # and only that: anything else fails the test
        rc.parse(t.Control(op, body))


@settings(max_examples=100, deadline=None)
@given(MESSAGES, st.sampled_from(["drop", "extra", "version", "retype"]), st.data())
def test_a_damaged_message_is_refused_naming_the_field(msg: rc.RingControl, damage: str, data: Any) -> None:
    body = msg.body()
    key = data.draw(st.sampled_from(sorted(k for k in body if k != "v")))
    if damage == "drop":
        del body[key]
    elif damage == "extra":
        body["surprise"] = 1
    elif damage == "version":
        body["v"] = data.draw(st.sampled_from([0, 2, True, "1", None]))
    else:
        body[key] = 3.5
    with pytest.raises(RingMessageError) as err:
        rc.parse(t.Control(msg.OP, body))
    named = {"drop": key, "extra": "surprise", "version": "version", "retype": ""}[damage]
    assert named in str(err.value)


def test_the_console_text_is_made_from_the_structured_value() -> None:
    broken = RingBroken("m1", Cause.SILENT, "member m1 stopped answering (nothing for 5 s)")
    assert broken.text() == "the ring is broken: member m1 stopped answering (nothing for 5 s)"
    assert broken.blames("m1") and not broken.blames("m1-5")
    assert not RingBroken("m1", Cause.CLOSED, "link to m1 closed").blames("m1")


def test_an_unknown_op_is_refused() -> None:
    with pytest.raises(RingMessageError, match="unknown ring-control op 'beat'"):
        rc.parse(t.Control("beat"))
