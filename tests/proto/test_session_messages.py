"""Session terms and forming messages (kafila.proto.session): they parse back as sent, and
anything else is refused with TermsError or SessionMessageError naming the field, never another
exception."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.engine import DTYPES, QUANT_CHOICES
from kafila.models.manifest import QUANT_FORMATS
from kafila.planner.decide import DIVISIONS
from kafila.proto import session
from kafila.proto.session import SessionTerms, TermsError

TERMS = st.builds(
    SessionTerms,
    st.text(min_size=1, max_size=session.MAX_MODEL),
    st.integers(1, 4096),
    st.integers(0, 1000),
    st.sampled_from(session.SESSION_DTYPES),
    st.integers(1, 1 << 20),
    st.integers(1, 64),
    st.sampled_from(session.DIVISIONS),
    st.sampled_from(session.SESSION_QUANTS),
)
SOME_TERMS = SessionTerms("m", 64, 8, session.SESSION_DTYPES[0], 512, 1, session.DIVISIONS[0])
KEYS = ["model", "chunk", "queue", "dtype", "context", "concurrency", "division", "quant", "v"]
JSON = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20)
# request origin tags by name: distinct, 1 to MAX_ORIGIN
ORIGINS = st.lists(
    st.tuples(st.text(max_size=10), st.integers(1, session.MAX_ORIGIN)),
    max_size=4,
    unique_by=(lambda p: p[0], lambda p: p[1]),
).map(dict)
# a succession order: distinct member names
SUCCESSION = st.lists(st.text(min_size=1, max_size=10), max_size=5, unique=True).map(tuple)
PROBES = st.dictionaries(
    st.text(max_size=8), st.dictionaries(st.text(max_size=8), JSON, max_size=3), max_size=3
)


@settings(max_examples=150, deadline=None)
@given(TERMS)
def test_terms_parse_back_as_sent(terms: SessionTerms) -> None:
    assert SessionTerms.from_dict(terms.to_dict()) == terms


@settings(max_examples=200, deadline=None)
@given(
    TERMS,
    st.sampled_from(KEYS),
    JSON,
)
def test_any_other_value_is_refused_with_a_terms_error(terms: SessionTerms, key: str, value: Any) -> None:
    with contextlib.suppress(TermsError):  # and only that: anything else fails the test
        SessionTerms.from_dict(terms.to_dict() | {key: value})


def test_a_missing_or_unknown_field_is_named() -> None:
    body = SessionTerms("m", 64, 8, "bf16", 2048, 1, "kafila", "q4").to_dict()
    with pytest.raises(TermsError, match="missing \\['queue'\\]"):
        SessionTerms.from_dict({k: v for k, v in body.items() if k != "queue"})
    with pytest.raises(TermsError, match="missing \\['quant'\\]"):  # a version-1 host's terms
        SessionTerms.from_dict({k: v for k, v in body.items() if k != "quant"} | {"v": 2})
    with pytest.raises(TermsError, match="quant 'q3' is none of"):
        SessionTerms.from_dict(body | {"quant": "q3"})
    with pytest.raises(TermsError, match="unknown \\['objective'\\]"):
        SessionTerms.from_dict(body | {"objective": "load"})
    with pytest.raises(TermsError, match="terms version 1, this member speaks 2"):
        SessionTerms.from_dict(body | {"v": 1})


def test_the_wire_names_agree_with_the_engine_and_the_planner() -> None:
    """proto imports neither; the values it accepts are theirs."""
    assert tuple(DTYPES) == session.SESSION_DTYPES and tuple(DIVISIONS) == session.DIVISIONS
    assert QUANT_FORMATS == session.SESSION_QUANTS
    assert ("auto", *session.SESSION_QUANTS) == QUANT_CHOICES  # a host resolves "auto" before sending


FORMING = st.one_of(
    st.builds(session.Report, st.dictionaries(st.text(max_size=10), JSON, max_size=4)),
    st.builds(
        session.PlanMessage,
        st.dictionaries(st.text(max_size=10), JSON, max_size=4),
        st.dictionaries(st.text(max_size=10), st.integers(0, 1000), max_size=4),
        TERMS,
        st.none() | st.dictionaries(st.text(max_size=10), JSON, max_size=3),
        st.integers(1, session.MAX_EPOCH),
        ORIGINS,
        SUCCESSION,
        PROBES,
    ),
    st.builds(session.Refused, st.text(max_size=100)),
    st.builds(session.Spare, st.text(max_size=100)),
    st.builds(session.Failed, st.text(max_size=100)),
    st.just(session.Ready()),
    st.just(session.AllReady()),
)
KINDS = {
    c.OP: c
    for c in (
        session.Report,
        session.PlanMessage,
        session.Refused,
        session.Spare,
        session.Failed,
        session.Ready,
    )
}
KINDS["formed"] = session.AllReady


@settings(max_examples=150, deadline=None)
@given(FORMING)
def test_forming_messages_parse_back_as_sent(msg: Any) -> None:
    body = msg.body()
    assert body[session.KEY] == session.SESSION_VERSION and body["op"] == msg.OP
    assert type(msg).parse(body) == msg


@settings(max_examples=200, deadline=None)
@given(FORMING, st.text(max_size=12), JSON)
def test_a_forming_message_with_any_field_changed_is_refused_or_parsed(
    msg: Any, key: str, value: Any
) -> None:
    """Only SessionMessageError ever comes out of a parser, whatever a peer sends."""
    with contextlib.suppress(session.SessionMessageError):
        type(msg).parse(msg.body() | {key: value})


def test_a_forming_message_names_what_is_wrong() -> None:
    with pytest.raises(session.SessionMessageError, match="ready: unknown \\['extra'\\]"):
        session.Ready.parse(session.payload("ready", extra=1))
    speaks = f"version 3, this member speaks {session.SESSION_VERSION}"
    with pytest.raises(session.SessionMessageError, match=speaks):
        session.Refused.parse(session.Refused("no").body() | {session.KEY: 3})
    with pytest.raises(session.SessionMessageError, match="reason must be text"):
        session.Failed.parse(session.payload("failed", reason=3))
    assert set(KINDS) == {"report", "plan", "refused", "spare", "failed", "ready", "formed"}
    with pytest.raises(session.SessionMessageError, match="epoch must be an integer from 1"):
        session.PlanMessage.parse(session.PlanMessage({}, {}, SOME_TERMS).body() | {"epoch": 0})


def test_a_plan_of_the_first_epoch_is_sent_as_forming_always_sent_it() -> None:
    """A plan for epoch 1 leaves `epoch` out, so a forming member of the version before reads it."""
    terms = SOME_TERMS
    assert "epoch" not in session.PlanMessage({}, {"a": 1}, terms).body()
    late = session.PlanMessage({}, {"a": 1}, terms, epoch=3)
    assert session.PlanMessage.parse(late.body()).epoch == 3


def test_a_plan_without_origins_or_with_a_shared_one_is_refused() -> None:
    """A host of the version before sent no origins; two members of one tag would take each
    other's answers, so a plan giving one tag twice is refused."""
    plan = session.PlanMessage({}, {"a": 1, "b": 2}, SOME_TERMS, origins={"a": 1, "b": 2})
    assert session.PlanMessage.parse(plan.body()).origins == {"a": 1, "b": 2}
    body = plan.body()
    with pytest.raises(session.SessionMessageError, match="plan: missing \\['origins'\\]"):
        session.PlanMessage.parse({k: v for k, v in body.items() if k != "origins"})
    with pytest.raises(session.SessionMessageError, match="plan: origins \\[3\\] are given to more than one"):
        session.PlanMessage.parse(body | {"origins": {"a": 3, "b": 3}})
    top = session.MAX_ORIGIN
    with pytest.raises(session.SessionMessageError, match=f"of 'a' must be an integer from 1 to {top}"):
        session.PlanMessage.parse(body | {"origins": {"a": top + 1}})
    with pytest.raises(session.SessionMessageError, match="origin of 'a' must be an integer"):
        session.PlanMessage.parse(body | {"origins": {"a": True}})


def test_a_plan_names_its_succession_order_or_is_refused() -> None:
    """Every member can name the host's successor in advance: the order travels with the plan, and
    a host of the version before (no order) or an order naming a member twice is refused."""
    plan = session.PlanMessage(
        {}, {"a": 1, "b": 2, "c": 3}, SOME_TERMS, origins={"a": 1}, succession=("c", "b")
    )
    assert session.PlanMessage.parse(plan.body()).succession == ("c", "b")
    body = plan.body()
    with pytest.raises(session.SessionMessageError, match="plan: missing \\['succession'\\]"):
        session.PlanMessage.parse({k: v for k, v in body.items() if k != "succession"})
    with pytest.raises(session.SessionMessageError, match="plan: succession names \\['b'\\] more than once"):
        session.PlanMessage.parse(body | {"succession": ["b", "c", "b"]})
    with pytest.raises(session.SessionMessageError, match="plan: succession must name members by 1 to"):
        session.PlanMessage.parse(body | {"succession": ["b", ""]})
    with pytest.raises(session.SessionMessageError, match="plan: succession must be a list of at most 256"):
        session.PlanMessage.parse(body | {"succession": "bc"})
    with pytest.raises(session.SessionMessageError, match="plan: missing \\['probes'\\]"):
        session.PlanMessage.parse({k: v for k, v in body.items() if k != "probes"})
    with pytest.raises(
        session.SessionMessageError, match="plan: the probe of 'b' must be an object, got int"
    ):
        session.PlanMessage.parse(body | {"probes": {"b": 3}})
    too_many = [f"m{i}" for i in range(session.MAX_SUCCESSION + 1)]
    with pytest.raises(session.SessionMessageError, match="plan: succession must be a list of at most 256"):
        session.PlanMessage.parse(body | {"succession": too_many})
