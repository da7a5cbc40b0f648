"""The terms of a session: what the host decided and every member follows (pure, no I/O).

The host sends them inside its `plan` message (a signaling payload the rendezvous forwards
unread; kafila.session.forming.core). Parsing is strict and versioned like the signaling
messages: a missing or unknown field, a wrong type or a value out of range raises
`TermsError` naming it. Every member of a session runs the same kafila.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar, Self

TERMS_VERSION = 2  # 2: the weight format (quant)
SESSION_DTYPES = ("fp32", "bf16", "fp16")  # kafila.engine.DTYPES' keys (a test keeps them equal)
SESSION_QUANTS = ("none", "int8", "q4")  # kafila.models.manifest.QUANT_FORMATS (a test keeps them equal)
MAX_MODEL = 200
DIVISIONS = ("kafila", "uniform", "memory")


class TermsError(ValueError):
    """Session terms that do not parse; the message names the field."""


@dataclass(frozen=True)
class SessionTerms:
    model: str  # the model id clients ask for
    chunk: int  # prompt tokens per prefill step
    queue: int  # requests that may wait for a slot at the head; more get 429
    dtype: str  # the session's one dtype: every member computes in it
    context: int  # tokens per request
    concurrency: int  # requests served at once
    division: str  # how the blocks were divided
    quant: str = "none"  # the session's weight format: every member loads its blocks in it

    def __post_init__(self) -> None:
        if not self.model or len(self.model) > MAX_MODEL:
            raise TermsError(f"model must be 1 to {MAX_MODEL} characters, got {len(self.model)}")
        for key, lo in (("chunk", 1), ("queue", 0), ("context", 1), ("concurrency", 1)):
            if getattr(self, key) < lo:
                raise TermsError(f"{key} must be at least {lo}, got {getattr(self, key)}")
        if self.dtype not in SESSION_DTYPES:
            raise TermsError(f"dtype {self.dtype!r} is none of {list(SESSION_DTYPES)}")
        if self.division not in DIVISIONS:
            raise TermsError(f"division {self.division!r} is none of {list(DIVISIONS)}")
        if self.quant not in SESSION_QUANTS:
            raise TermsError(f"quant {self.quant!r} is none of {list(SESSION_QUANTS)}")

    def to_dict(self) -> dict[str, Any]:
        return {"v": TERMS_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, body: Any) -> SessionTerms:
        if not isinstance(body, Mapping):
            raise TermsError("the terms are not an object")
        version = body.get("v")
        if version != TERMS_VERSION or isinstance(version, bool):
            raise TermsError(f"terms version {version!r}, this member speaks {TERMS_VERSION}")
        want = {"model", "chunk", "queue", "dtype", "context", "concurrency", "division", "quant"}
        keys = set(body) - {"v"}
        if missing := want - keys:
            raise TermsError(f"terms: missing {sorted(missing)}")
        if extra := keys - want:
            raise TermsError(f"terms: unknown {sorted(extra)}")
        for key in ("model", "dtype", "division", "quant"):
            if not isinstance(body[key], str):
                raise TermsError(f"{key} must be text, got {type(body[key]).__name__}")
        for key in ("chunk", "queue", "context", "concurrency"):
            if not isinstance(body[key], int) or isinstance(body[key], bool):
                raise TermsError(f"{key} must be an integer, got {type(body[key]).__name__}")
        return cls(**{k: body[k] for k in want})


# ------------------------------------------------------------------ forming messages

KEY = "kafila_session"  # marks a signaling payload as a session message; its value is the version
SESSION_VERSION = 5  # 2: request origins (`origins`) in `plan` and `epoch`; 3: a spare's relayed requests;
# 4: `succession`, `probes` in `plan` and `epoch`; 5: `held` in a member's report, `host_bytes` and
# `peer_bytes` in a plan (a version 4 member refuses a plan with fields it does not know),
# `checkpoint` in the host's capability, `handover`
MAX_REASON = 4096
# a request id (u32 on the ring, kafila.proto.tensor) carries in its top ORIGIN_BITS the origin tag
# of the member whose API took it: the host gives each member id its own tag, never reused
ORIGIN_BITS = 12
MAX_ORIGIN = (1 << ORIGIN_BITS) - 1
# the succession order a plan and each epoch carry: who coordinates the session if its host is lost
MAX_SUCCESSION = 256
MAX_NAME = 200


class SessionMessageError(ValueError):
    """A forming message that does not parse; the message names the field."""


def payload(op: str, **body: Any) -> dict[str, Any]:
    """A session message as a signaling payload (the rendezvous forwards it unread)."""
    return {KEY: SESSION_VERSION, "op": op, **body}


@dataclass(frozen=True)
class Report:
    """member -> host: what this member offers (a DeviceReport's dict, read by the planner)."""

    device: dict[str, Any]
    OP: ClassVar[str] = "report"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, device=self.device)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Report:
        _check(body, cls.OP, {"device"})
        return cls(_object(body, "device"))


@dataclass(frozen=True)
class PlanMessage:
    """host -> members: the plan (a Plan's dict), member ids by name, the terms, the divisions
    compared (for /session), the plan epoch it starts in: 1 at forming; a member that joined
    the serving session (or a spare planned in) starts in the re-plan's epoch (left out when 1),
    each member's request origin tag by name (`origins`, as `epoch` carries them), and the
    succession order (`succession`: the members that take the host's coordinating role, first
    present first, should the host be lost) with every member's probe by name (`probes`: a
    DeviceReport's dict each, which a successor re-plans with)."""

    plan: dict[str, Any]
    ids: dict[str, int]
    terms: SessionTerms
    alternatives: dict[str, Any] | None = None
    epoch: int = 1
    origins: dict[str, int] = field(default_factory=dict)
    succession: tuple[str, ...] = ()
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    OP: ClassVar[str] = "plan"

    def body(self) -> dict[str, Any]:
        terms = self.terms.to_dict()
        more = {} if self.epoch == 1 else {"epoch": self.epoch}
        return payload(
            self.OP,
            plan=self.plan,
            ids=self.ids,
            terms=terms,
            alternatives=self.alternatives,
            origins=self.origins,
            succession=list(self.succession),
            probes=self.probes,
            **more,
        )

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> PlanMessage:
        _check(
            body,
            cls.OP,
            {"plan", "ids", "terms", "alternatives", "epoch", "origins", "succession", "probes"},
            optional={"alternatives", "epoch"},
        )
        ids = _ids(body, "plan")
        alternatives = body.get("alternatives")
        if alternatives is not None and not isinstance(alternatives, dict):
            raise SessionMessageError("plan: alternatives must be an object")
        try:
            terms = SessionTerms.from_dict(body["terms"])
        except TermsError as exc:
            raise SessionMessageError(f"plan: {exc}") from None
        epoch = _epoch(body) if "epoch" in body else 1
        origins, succession, probes = _origins(body, cls.OP), _succession(body, cls.OP), _probes(body, cls.OP)
        return cls(_object(body, "plan"), ids, terms, alternatives, epoch, origins, succession, probes)


def _ids(body: Mapping[str, Any], op: str) -> dict[str, int]:
    ids = _object(body, "ids")
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ids.values()):
        raise SessionMessageError(f"{op}: ids must map names to member ids")
    return dict(ids)


def _origins(body: Mapping[str, Any], op: str) -> dict[str, int]:
    """Request origin tags by member name: each from 1 to MAX_ORIGIN, no two members alike (two
    members of one tag would take each other's answers)."""
    origins = _object(body, "origins")
    for name, tag in origins.items():
        if not isinstance(tag, int) or isinstance(tag, bool) or not 1 <= tag <= MAX_ORIGIN:
            raise SessionMessageError(
                f"{op}: origin of {name!r} must be an integer from 1 to {MAX_ORIGIN}, got {tag!r}"
            )
    if len(set(origins.values())) != len(origins):
        shared = sorted(t for t, n in Counter(origins.values()).items() if n > 1)
        raise SessionMessageError(f"{op}: origins {shared} are given to more than one member")
    return dict(origins)


def _succession(body: Mapping[str, Any], op: str) -> tuple[str, ...]:
    """The succession order: distinct member names (1 to MAX_NAME characters), at most
    MAX_SUCCESSION of them (a name twice would make two members each think it comes first)."""
    order = body["succession"]
    if not isinstance(order, list) or len(order) > MAX_SUCCESSION:
        raise SessionMessageError(f"{op}: succession must be a list of at most {MAX_SUCCESSION} member names")
    for name in order:
        if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME:
            raise SessionMessageError(
                f"{op}: succession must name members by 1 to {MAX_NAME} characters, got {name!r:.40}"
            )
    if len(set(order)) != len(order):
        twice = sorted(n for n, k in Counter(order).items() if k > 1)
        raise SessionMessageError(f"{op}: succession names {twice} more than once")
    return tuple(order)


def _probes(body: Mapping[str, Any], op: str) -> dict[str, dict[str, Any]]:
    """Every member's probe by name: an object each (the planner reads it as a DeviceReport)."""
    probes = _object(body, "probes")
    for name, report in probes.items():
        if not isinstance(report, dict):
            raise SessionMessageError(
                f"{op}: the probe of {name!r:.40} must be an object, got {type(report).__name__}"
            )
    return dict(probes)


@dataclass(frozen=True)
class _Reasoned:
    """A message that carries only why (the base of `refused` and `failed`)."""

    reason: str
    OP: ClassVar[str] = ""

    def body(self) -> dict[str, Any]:
        return payload(self.OP, reason=self.reason)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        _check(body, cls.OP, {"reason"})
        return cls(_reason(body))


@dataclass(frozen=True)
class _Bare:
    """A message that carries nothing but its op (the base of `ready` and `formed`)."""

    OP: ClassVar[str] = ""

    def body(self) -> dict[str, Any]:
        return payload(self.OP)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        _check(body, cls.OP, set())
        return cls()


@dataclass(frozen=True)
class Refused(_Reasoned):
    """host -> members: the session will not form, and why."""

    OP: ClassVar[str] = "refused"


@dataclass(frozen=True)
class Failed(_Reasoned):
    """member -> host: why this member cannot go on (the host ends the attempt with it)."""

    OP: ClassVar[str] = "failed"


@dataclass(frozen=True)
class Spare(_Reasoned):
    """host -> a member that joined the serving session: it waits as a spare, and why (the
    predicted gain and the margin, or the planner's reason); a `plan` may follow at any time."""

    OP: ClassVar[str] = "spare"


@dataclass(frozen=True)
class Ready(_Bare):
    """member -> host: linked, weights here, ring role started."""

    OP: ClassVar[str] = "ready"


@dataclass(frozen=True)
class AllReady(_Bare):
    """host -> members (`formed`): every member is ready; the session serves."""

    OP: ClassVar[str] = "formed"


def _check(
    body: Mapping[str, Any], op: str, want: set[str], optional: frozenset[str] | set[str] = frozenset()
) -> None:
    if not isinstance(body, Mapping):
        raise SessionMessageError(f"{op}: the message is not an object")
    version = body.get(KEY)
    if version != SESSION_VERSION or isinstance(version, bool):
        raise SessionMessageError(
            f"{op}: session message version {version!r}, this member speaks {SESSION_VERSION}"
        )
    if body.get("op") != op:
        raise SessionMessageError(f"{op}: the message's op is {body.get('op')!r}")
    keys = set(body) - {KEY, "op"}
    if missing := want - set(optional) - keys:
        raise SessionMessageError(f"{op}: missing {sorted(missing)}")
    if extra := keys - want:
        raise SessionMessageError(f"{op}: unknown {sorted(extra)}")


def _object(body: Mapping[str, Any], key: str) -> dict[str, Any]:
    value = body[key]
    if not isinstance(value, dict):
        raise SessionMessageError(f"{key} must be an object, got {type(value).__name__}")
    return value


def _reason(body: Mapping[str, Any]) -> str:
    value = body["reason"]
    if not isinstance(value, str):
        raise SessionMessageError(f"reason must be text, got {type(value).__name__}")
    return value[:MAX_REASON]


# ------------------------------------------------------------------ epoch messages
# After forming, the host and each member talk over their control link (not the rendezvous): a
# member lost mid-session makes the host re-plan, and the next plan epoch is agreed on with these.
# Each is one JSON object (`encode` / `parse_epoch`), versioned and strict as the forming messages.

MAX_EPOCH = 2**31 - 1
MAX_COUNT = 2**53  # a count a float holds exactly
MAX_CONTROL_BYTES = 1 << 20


@dataclass(frozen=True)
class NewEpoch:
    """host -> survivors: serving stops; move to `plan` (a Plan's dict) as epoch `epoch`, because
    of `cause` ("m2 was lost (silent)"); `ids`: member ids by name when the plan names a member
    the survivors have not linked with before (one that joined), else None; `origins`: every
    member's request origin tag by name (the head names whoever asked by them); `succession`: who
    coordinates from this epoch on should the host be lost, first present first; `probes`: every
    member's probe by name, which a successor re-plans with."""

    epoch: int
    plan: dict[str, Any]
    cause: str
    ids: dict[str, int] | None = None
    origins: dict[str, int] = field(default_factory=dict)
    succession: tuple[str, ...] = ()
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)
    OP: ClassVar[str] = "epoch"

    def body(self) -> dict[str, Any]:
        more = {} if self.ids is None else {"ids": self.ids}
        order = list(self.succession)
        return payload(
            self.OP,
            epoch=self.epoch,
            plan=self.plan,
            cause=self.cause,
            origins=self.origins,
            succession=order,
            probes=self.probes,
            **more,
        )

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> NewEpoch:
        keys = {"epoch", "plan", "cause", "ids", "origins", "succession", "probes"}
        _check(body, cls.OP, keys, optional={"ids"})
        ids = _ids(body, cls.OP) if "ids" in body else None
        plan, cause, order = _object(body, "plan"), _text(body, "cause"), _succession(body, cls.OP)
        return cls(_epoch(body), plan, cause, ids, _origins(body, cls.OP), order, _probes(body, cls.OP))


@dataclass(frozen=True)
class _EpochOnly:
    epoch: int
    OP: ClassVar[str] = ""

    def body(self) -> dict[str, Any]:
        return payload(self.OP, epoch=self.epoch)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Self:
        _check(body, cls.OP, {"epoch"})
        return cls(_epoch(body))


@dataclass(frozen=True)
class EpochReady(_EpochOnly):
    """member -> host: its stage for `epoch` is loaded, its new edges linked, its role started."""

    OP: ClassVar[str] = "epoch_ready"


@dataclass(frozen=True)
class Resume(_EpochOnly):
    """host -> survivors: every member is ready for `epoch`; serve."""

    OP: ClassVar[str] = "resume"


@dataclass(frozen=True)
class EpochFailed:
    """member -> host: this member cannot move to `epoch`, and why (the host ends the session)."""

    epoch: int
    reason: str
    OP: ClassVar[str] = "epoch_failed"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, epoch=self.epoch, reason=self.reason)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> EpochFailed:
        _check(body, cls.OP, {"epoch", "reason"})
        return cls(_epoch(body), _reason(body))


@dataclass(frozen=True)
class SessionEnded(_Reasoned):
    """host -> survivors: the session ends, and why (the members left cannot hold the model...)."""

    OP: ClassVar[str] = "ended"


@dataclass(frozen=True)
class MemberLost:
    """member -> host: this member's ring broke because `member` is gone (`cause`: "silent",
    "closed"; `detail`: what it saw)."""

    member: str
    cause: str
    detail: str
    OP: ClassVar[str] = "lost"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, member=self.member, cause=self.cause, detail=self.detail)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> MemberLost:
        _check(body, cls.OP, {"member", "cause", "detail"})
        return cls(_text(body, "member"), _text(body, "cause"), _text(body, "detail"))


@dataclass(frozen=True)
class PathReport:
    """member -> host: its link to `peer` has run `direct` (or through the relay) long enough to
    count as measured (kafila.session.forming.paths); the host re-prices the ring with it."""

    peer: str
    direct: bool
    OP: ClassVar[str] = "path"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, peer=self.peer, direct=self.direct)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> PathReport:
        _check(body, cls.OP, {"peer", "direct"})
        direct = body["direct"]
        if not isinstance(direct, bool):
            raise SessionMessageError(f"direct must be true or false, got {direct!r}")
        return cls(_text(body, "peer"), direct)


@dataclass(frozen=True)
class DecodeCounts:
    """head -> host (where the head is another member): the decode circuits the head counted this
    session, the drafted tokens they verified and those kept, and the share of a stage's one-row
    step it prices each drafted row at (measured, or its draft policy's); the host prices its plan
    for them (kafila.planner.decide.measured)."""

    circuits: int
    drafted: int
    accepted: int
    row_share: float
    OP: ClassVar[str] = "decode"

    def __post_init__(self) -> None:
        if not 0 <= self.accepted <= self.drafted or self.circuits < 0:
            raise SessionMessageError(
                f"decode counts of {self.circuits} circuits keeping {self.accepted} of {self.drafted} "
                "drafted tokens"
            )
        if not math.isfinite(self.row_share) or self.row_share < 0:
            raise SessionMessageError(f"row_share must be a finite share >= 0, got {self.row_share!r}")

    def body(self) -> dict[str, Any]:
        return payload(
            self.OP,
            circuits=self.circuits,
            drafted=self.drafted,
            accepted=self.accepted,
            row_share=self.row_share,
        )

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> DecodeCounts:
        _check(body, cls.OP, {"circuits", "drafted", "accepted", "row_share"})
        share = body["row_share"]
        if not isinstance(share, int | float) or isinstance(share, bool) or abs(share) > 1e6:
            raise SessionMessageError(f"row_share must be a number up to 1e6, got {str(share)[:40]}")
        counts = (_count(body, "circuits"), _count(body, "drafted"), _count(body, "accepted"))
        return cls(*counts, float(share))


@dataclass(frozen=True)
class Replaced:
    """successor -> the host it took over from: `by` coordinates the session since `epoch` (a host
    that was frozen past the ring's bound reads this on waking, and ends saying so)."""

    by: str
    epoch: int
    OP: ClassVar[str] = "replaced"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, by=self.by, epoch=self.epoch)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Replaced:
        _check(body, cls.OP, {"by", "epoch"})
        return cls(_text(body, "by"), _epoch(body))


@dataclass(frozen=True)
class HandOver:
    """host -> members: the host leaves on purpose and hands its role over in `epoch`: each member
    counts it gone at once (no loss has to be noticed), and the first present of the succession
    order the host published (`to`, as the host sees it) takes over."""

    to: str
    epoch: int
    OP: ClassVar[str] = "handover"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, to=self.to, epoch=self.epoch)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> HandOver:
        _check(body, cls.OP, {"to", "epoch"})
        return cls(_text(body, "to"), _epoch(body))


@dataclass(frozen=True)
class Succeeding:
    """successor -> survivors: this member is taking over from `host`, which published `epoch` (the
    epoch they hold), and is `doing` this now (linking, asking the survivors what they hold,
    fetching the blocks it lacks). Sent within a second of its start and repeated
    (kafila.planner.succession) until its own epoch goes out, so that a survivor awaiting it does
    not pass it over while it works. A member of a build that predates it logs it as unknown and
    waits for the epoch alone, as before."""

    host: str
    epoch: int
    doing: str
    OP: ClassVar[str] = "succeeding"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, host=self.host, epoch=self.epoch, doing=self.doing)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Succeeding:
        _check(body, cls.OP, {"host", "epoch", "doing"})
        return cls(_text(body, "host"), _epoch(body), _text(body, "doing"))


EpochMessage = (
    NewEpoch
    | EpochReady
    | Resume
    | EpochFailed
    | SessionEnded
    | MemberLost
    | PathReport
    | DecodeCounts
    | Replaced
    | HandOver
    | Succeeding
)
_EPOCH_OPS: dict[str, type[EpochMessage]] = {
    m.OP: m
    for m in (
        NewEpoch,
        EpochReady,
        Resume,
        EpochFailed,
        SessionEnded,
        MemberLost,
        PathReport,
        DecodeCounts,
        Replaced,
        HandOver,
        Succeeding,
    )
}


def encode(msg: EpochMessage) -> bytes:
    return json.dumps(msg.body(), separators=(",", ":")).encode()


def parse_epoch(data: bytes) -> EpochMessage:
    """One epoch message from its bytes; SessionMessageError naming what is wrong."""
    if len(data) > MAX_CONTROL_BYTES:
        raise SessionMessageError(f"an epoch message of {len(data)} bytes, more than {MAX_CONTROL_BYTES}")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise SessionMessageError(f"an epoch message that is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise SessionMessageError("an epoch message that is not an object")
    op = body.get("op")
    kind = _EPOCH_OPS.get(op) if isinstance(op, str) else None
    if kind is None:
        raise SessionMessageError(f"unknown epoch message op {op!r}")
    return kind.parse(body)


def _epoch(body: Mapping[str, Any]) -> int:
    value = body["epoch"]
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_EPOCH:
        raise SessionMessageError(f"epoch must be an integer from 1 to {MAX_EPOCH}, got {value!r}")
    return value


def _count(body: Mapping[str, Any], key: str) -> int:
    value = body[key]
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_COUNT:
        raise SessionMessageError(f"{key} must be a count from 0 to 2**53, got {str(value)[:40]}")
    return value


def _text(body: Mapping[str, Any], key: str) -> str:
    value = body[key]
    if not isinstance(value, str):
        raise SessionMessageError(f"{key} must be text, got {type(value).__name__}")
    return value[:MAX_REASON]


# ------------------------------------------------------------------ relay messages
# A spare (a member the host keeps out of the ring) serves its API by relaying each request over its
# control link to the host, which answers it through its own API and ring role as its own clients'
# (kafila.session.ring.relay), naming the spare as the member that asked, and streams the response
# back (kafila.api.spare). One link message kind of their own (RELAY_KIND); each message is one JSON
# object, versioned and strict as the others; bytes travel as base64 text.

RELAY_KIND = 34  # link message kind of the relay messages (the epoch messages' is 33, the ring's 32)
MAX_ASK = 2**31 - 1  # a relayed request's number at its spare: 1 to this
MAX_ASK_BODY = 8 << 20  # bytes of a request body a spare relays; a larger one gets 413 at the spare
MAX_RELAY_BYTES = 2 * MAX_ASK_BODY  # one relay message (base64 takes 4/3, plus the JSON around it)
MAX_PATH = 2048
MAX_HEADERS = 32
MAX_HEADER = 8192  # characters of a header's name or value
RELAY_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD")


@dataclass(frozen=True)
class Ask:
    """spare -> host: a request its API took (number `ask`, unique at the spare): method, path,
    query string, the headers that shape the answer (content type, accept) and the body."""

    ask: int
    method: str
    path: str
    query: str = ""
    headers: tuple[tuple[str, str], ...] = ()
    content: bytes = b""
    OP: ClassVar[str] = "ask"

    def body(self) -> dict[str, Any]:
        return payload(
            self.OP,
            ask=self.ask,
            method=self.method,
            path=self.path,
            query=self.query,
            headers=[list(h) for h in self.headers],
            content=_b64(self.content),
        )

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Ask:
        _check(body, cls.OP, {"ask", "method", "path", "query", "headers", "content"})
        method, path, query = _text(body, "method"), body["path"], body["query"]
        if method not in RELAY_METHODS:
            raise SessionMessageError(f"ask: method {method!r} is none of {list(RELAY_METHODS)}")
        if not isinstance(path, str) or not path.startswith("/") or len(path) > MAX_PATH:
            raise SessionMessageError(f"ask: path must be text from '/', at most {MAX_PATH} characters")
        if not isinstance(query, str) or len(query) > MAX_PATH:
            raise SessionMessageError(f"ask: query must be text of at most {MAX_PATH} characters")
        content = _unb64(body, "content", MAX_ASK_BODY)
        return cls(_ask(body), method, path, query, _headers(body), content)


@dataclass(frozen=True)
class Reply:
    """host -> spare: the answer to ask `ask` starts: its HTTP status and headers."""

    ask: int
    status: int
    headers: tuple[tuple[str, str], ...] = ()
    OP: ClassVar[str] = "reply"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, ask=self.ask, status=self.status, headers=[list(h) for h in self.headers])

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Reply:
        _check(body, cls.OP, {"ask", "status", "headers"})
        status = body["status"]
        if not isinstance(status, int) or isinstance(status, bool) or not 100 <= status <= 599:
            raise SessionMessageError(f"reply: status must be an integer from 100 to 599, got {status!r}")
        return cls(_ask(body), status, _headers(body))


@dataclass(frozen=True)
class Chunk:
    """host -> spare: the next bytes of the answer to ask `ask`; `end` on its last."""

    ask: int
    data: bytes
    end: bool = False
    OP: ClassVar[str] = "chunk"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, ask=self.ask, data=_b64(self.data), end=self.end)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Chunk:
        _check(body, cls.OP, {"ask", "data", "end"})
        end = body["end"]
        if not isinstance(end, bool):
            raise SessionMessageError(f"chunk: end must be true or false, got {end!r}")
        return cls(_ask(body), _unb64(body, "data", MAX_ASK_BODY), end)


@dataclass(frozen=True)
class Drop:
    """spare -> host: the client of ask `ask` left: stop answering it (its request is cancelled)."""

    ask: int
    OP: ClassVar[str] = "drop"

    def body(self) -> dict[str, Any]:
        return payload(self.OP, ask=self.ask)

    @classmethod
    def parse(cls, body: Mapping[str, Any]) -> Drop:
        _check(body, cls.OP, {"ask"})
        return cls(_ask(body))


RelayMessage = Ask | Reply | Chunk | Drop
_RELAY_OPS: dict[str, type[RelayMessage]] = {m.OP: m for m in (Ask, Reply, Chunk, Drop)}


def encode_relay(msg: RelayMessage) -> bytes:
    return json.dumps(msg.body(), separators=(",", ":")).encode()


def parse_relay(data: bytes) -> RelayMessage:
    """One relay message from its bytes; SessionMessageError naming what is wrong."""
    if len(data) > MAX_RELAY_BYTES:
        raise SessionMessageError(f"a relay message of {len(data)} bytes, more than {MAX_RELAY_BYTES}")
    try:
        body = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise SessionMessageError(f"a relay message that is not JSON: {exc}") from None
    if not isinstance(body, dict):
        raise SessionMessageError("a relay message that is not an object")
    op = body.get("op")
    kind = _RELAY_OPS.get(op) if isinstance(op, str) else None
    if kind is None:
        raise SessionMessageError(f"unknown relay message op {op!r}")
    return kind.parse(body)


def _ask(body: Mapping[str, Any]) -> int:
    value = body["ask"]
    if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_ASK:
        raise SessionMessageError(f"ask must be an integer from 1 to {MAX_ASK}, got {value!r}")
    return value


def _headers(body: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """Header pairs: at most MAX_HEADERS, each a lower-case name and a value of text."""
    value = body["headers"]
    if not isinstance(value, list) or len(value) > MAX_HEADERS:
        raise SessionMessageError(f"headers must be a list of at most {MAX_HEADERS} pairs")
    out = []
    for pair in value:
        ok = isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)
        if not ok or not pair[0] or pair[0] != pair[0].lower() or max(map(len, pair)) > MAX_HEADER:
            raise SessionMessageError(f"a header must be [lower-case name, value] of text, got {pair!r:.80}")
        out.append((pair[0], pair[1]))
    return tuple(out)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(body: Mapping[str, Any], key: str, most: int) -> bytes:
    value = body[key]
    if not isinstance(value, str) or len(value) > (most + 2) // 3 * 4:
        raise SessionMessageError(f"{key} must be base64 text of at most {most} bytes")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise SessionMessageError(f"{key} is not base64: {exc}") from None
