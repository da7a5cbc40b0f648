"""Ring-control messages: what members tell each other about the ring itself (pure, no I/O).

They travel as `tensor.Control(op, body)` on the ring's links, among the hidden-state frames, so
they keep their order with them. Every body carries `"v": RING_VERSION`; parsing is strict: a
missing or unknown field, a wrong JSON type or another version raises `RingMessageError` naming
it. All members of a session run the same kafila, so there is no negotiation: a member that reads
another version says so instead of guessing.

    broken       RingBroken: the ring cannot carry requests any more, and why (structured: which
                 member, what happened to it); the text people read is made from it by `text()`
                 only where it is shown (the console line, the API's error, /session)
    free         Free: requests the head has finished; each member adds its hop reports on the way
    stage_error  StageFailed: a member's stage could not compute these requests (the head answers)
    resync       Resync: after a re-plan, every token of a carried request so far, to its member
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from kafila.proto import tensor as t

RING_VERSION = 1
MAX_TEXT = 4096  # a detail or message longer than this is cut, never refused: it is for people
MAX_IDS = 65536


class RingMessageError(ValueError):
    """A ring-control body that does not parse; the message names the field."""


class Cause(enum.StrEnum):
    """What broke the ring, as seen by the member that noticed it."""

    SILENT = "silent"  # `member` stopped answering (its heartbeats stopped), or, said by `member`
    # itself, its process did not run for longer than the ring's bound (the others counted it lost)
    CLOSED = "closed"  # `member`'s link closed
    LEFT = "left"  # the rendezvous says `member` left the session (or the host removed it)
    DISCONNECTED = "disconnected"  # the rendezvous lost `member`'s connection (killed, crashed, cut off)
    ENDED = "ended"  # the host ended the session on purpose: no fault
    ERROR = "error"  # anything else: a member's internal error, an unreadable message


def departure_cause(reason: str) -> Cause:
    """The cause of a rendezvous's `member_left` notice by its reason: "left" and "removed" are a
    member leaving, "disconnected", "timed_out" and anything else a connection lost."""
    return Cause.LEFT if reason in ("left", "removed") else Cause.DISCONNECTED


@dataclass(frozen=True)
class RingBroken:
    member: str  # the member the break is about (the one that went silent, closed or failed)
    cause: Cause
    detail: str  # what the member that noticed saw: "member m1 stopped answering (nothing for 5 s)"

    OP: ClassVar[str] = "broken"

    def text(self) -> str:
        """The line people read (console, API error, /session)."""
        return f"the ring is broken: {self.detail}"

    def blames(self, member: str) -> bool:
        """Whether this break says that `member` stopped answering."""
        return self.cause is Cause.SILENT and self.member == member

    def body(self) -> dict[str, Any]:
        return {"v": RING_VERSION, "member": self.member, "cause": self.cause.value, "detail": self.detail}

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> RingBroken:
        _fields(body, cls.OP, {"member", "cause", "detail"})
        cause = _text(body, "cause")
        try:
            return cls(_text(body, "member"), Cause(cause), _text(body, "detail"))
        except ValueError:
            raise RingMessageError(f"broken: cause {cause!r} is none of {[c.value for c in Cause]}") from None


@dataclass(frozen=True)
class Free:
    request_ids: tuple[int, ...]
    hops: tuple[dict[str, Any], ...] = ()  # one report per member and request (ring.stagetrace.hop_report)

    OP: ClassVar[str] = "free"

    def body(self) -> dict[str, Any]:
        return {"v": RING_VERSION, "request_ids": list(self.request_ids), "hops": list(self.hops)}

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Free:
        _fields(body, cls.OP, {"request_ids", "hops"})
        hops = body["hops"]
        if not isinstance(hops, list) or not all(isinstance(h, dict) for h in hops):
            raise RingMessageError("free: hops must be a list of objects")
        return cls(_ids(body, cls.OP), tuple(hops))


@dataclass(frozen=True)
class StageFailed:
    request_ids: tuple[int, ...]
    message: str  # names the member and the stage's error

    OP: ClassVar[str] = "stage_error"

    def body(self) -> dict[str, Any]:
        return {"v": RING_VERSION, "request_ids": list(self.request_ids), "message": self.message}

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> StageFailed:
        _fields(body, cls.OP, {"request_ids", "message"})
        return cls(_ids(body, cls.OP), _text(body, "message"))


@dataclass(frozen=True)
class Resync:
    """The head -> the member a carried request came from, once a re-plan's ring serves: every
    token of it emitted so far (answers on their way round when the ring broke were lost; the
    member passes on those its client has not had)."""

    request_id: int
    tokens: tuple[int, ...]

    OP: ClassVar[str] = "resync"

    def body(self) -> dict[str, Any]:
        return {"v": RING_VERSION, "request_id": self.request_id, "tokens": list(self.tokens)}

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Resync:
        _fields(body, cls.OP, {"request_id", "tokens"})
        rid, tokens = body["request_id"], body["tokens"]
        if not isinstance(rid, int) or isinstance(rid, bool) or rid < 0:
            raise RingMessageError("resync: request_id must be a non-negative integer")
        if (
            not isinstance(tokens, list)
            or len(tokens) > MAX_IDS
            or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in tokens)
        ):
            raise RingMessageError(f"resync: tokens must be a list of at most {MAX_IDS} token ids")
        return cls(rid, tuple(tokens))


RingControl = RingBroken | Free | StageFailed | Resync
_BY_OP: dict[str, type[RingBroken] | type[Free] | type[StageFailed] | type[Resync]] = {
    c.OP: c for c in (RingBroken, Free, StageFailed, Resync)
}
OPS = frozenset(_BY_OP)


def control(msg: RingControl) -> t.Control:
    """`msg` as the frame that carries it."""
    return t.Control(msg.OP, msg.body())


def parse(frame: t.Control) -> RingControl:
    """The ring-control message a frame carries (RingMessageError: not one, or malformed)."""
    kind = _BY_OP.get(frame.op)
    if kind is None:
        raise RingMessageError(f"unknown ring-control op {frame.op!r}")
    return kind.parse(frame.body)


def _fields(body: Mapping[str, Any], op: str, want: set[str]) -> None:
    if not isinstance(body, Mapping):
        raise RingMessageError(f"{op}: the body is not an object")
    version = body.get("v")
    if version != RING_VERSION or isinstance(version, bool):
        raise RingMessageError(f"{op}: ring-control version {version!r}, this member speaks {RING_VERSION}")
    keys = set(body) - {"v"}
    if missing := want - keys:
        raise RingMessageError(f"{op}: missing {sorted(missing)}")
    if extra := keys - want:
        raise RingMessageError(f"{op}: unknown {sorted(extra)}")


def _text(body: Mapping[str, Any], key: str) -> str:
    value = body[key]
    if not isinstance(value, str):
        raise RingMessageError(f"{key} must be text, got {type(value).__name__}")
    return value[:MAX_TEXT]


def _ids(body: Mapping[str, Any], op: str) -> tuple[int, ...]:
    ids = body["request_ids"]
    if (
        not isinstance(ids, list)
        or len(ids) > MAX_IDS
        or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids)
    ):
        raise RingMessageError(f"{op}: request_ids must be a list of at most {MAX_IDS} non-negative integers")
    return tuple(ids)
