"""Signaling messages: JSON text frames over the rendezvous WebSocket (pure, no I/O).

Every frame is one JSON object `{"v": 2, "type": "<name>", ...fields}`. Decoding is strict:
unknown types, unknown or missing fields, wrong JSON types, out-of-range numbers, oversized text,
duplicate keys, NaN/Infinity and nesting deeper than `MAX_DEPTH` raise `ProtocolError` with a
message naming the field. Member-to-member payloads (`signal.payload`) and the capability/NAT
reports are opaque JSON objects: the rendezvous forwards them without interpreting them.

Client -> rendezvous: open, protect, join_challenge, join, ticket_request, reopen,
rejoin_challenge, rejoin, succeed_challenge, succeed, update, signal, relay_request, heartbeat,
leave, remove.
Rendezvous -> client: opened, protected, ticket, challenge, joined, member_joined, member_updated, signal,
relay_allocated, heartbeat_ack, member_left, error. docs/protocol.md lists every field.

Version 2 (this one) added the proof of the code's secret part a join carries (protect,
join_challenge/challenge, join.proof: docs/rendezvous.md); within it, re-registering a session
after the rendezvous restarted (ticket_request/ticket, reopen, rejoin_challenge, rejoin) came as
new message types, which a rendezvous without them answers `unknown_type`; so did a member taking
the place of a host that is gone (succeed_challenge, succeed). A frame of another
version is answered with an `error` (code `unsupported_version`) in that version's envelope where
its `error` has the same fields, so an older member reads why; `decode_server` reads such an error
from an older rendezvous the same way.
"""

from __future__ import annotations

import json
import math
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, ClassVar, Union
from urllib.parse import urlsplit

from kafila.proto.errors import ProtocolError
from kafila.proto.udp import url_host

VERSION = 2
OLD_VERSIONS = frozenset({1})  # versions whose `error` message reads as this one's
SIGNAL_PATH = "/v1/signal"  # the rendezvous's WebSocket endpoint
DEFAULT_PORT = 8470  # the rendezvous's signaling (HTTP/WebSocket) port
MAX_MESSAGE_BYTES = 64 * 1024  # what the rendezvous accepts from a member
MAX_SERVER_MESSAGE_BYTES = 4 * 1024 * 1024  # what a member accepts from the rendezvous
MAX_OBJECT_BYTES = 16 * 1024  # one capability or NAT report, serialized
MAX_PAYLOAD_BYTES = 48 * 1024  # one signal payload, serialized
MAX_DEPTH = 16
MAX_NAME = 64
MAX_MODEL = 200
MAX_REF = 64
MAX_CANDIDATES = 16
MAX_CANDIDATE = 64
MAX_MEMBERS = 256
MAX_RELAY_CLAIMS = 64  # relay legs a member names when it registers again (one per link on the relay)

JsonObject = dict[str, Any]


def _m(
    *,
    key: str | None = None,
    max_len: int | None = None,
    lo: float | None = None,
    hi: float | None = None,
    max_bytes: int | None = None,
) -> dict[str, Any]:
    """Field metadata the strict decoder checks: JSON key, length/range/size bounds."""
    return {"key": key, "max_len": max_len, "lo": lo, "hi": hi, "max_bytes": max_bytes}


# ------------------------------------------------------------------ shared values


@dataclass(frozen=True, slots=True)
class MemberInfo:
    """What every member of a session learns about every other member."""

    id: int = field(metadata=_m(lo=1, hi=2**31))
    name: str = field(metadata=_m(max_len=MAX_NAME))
    host: bool = field(metadata=_m())  # opened the session
    address: str = field(metadata=_m(max_len=64))  # signaling source IP as the rendezvous saw it
    capability: JsonObject = field(metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    nat: JsonObject | None = field(default=None, metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    candidates: list[str] = field(default_factory=list, metadata=_m(max_len=MAX_CANDIDATES))


# ------------------------------------------------------------------ client -> rendezvous


@dataclass(frozen=True, slots=True)
class Open:
    """Register a new session; this connection becomes its first member (the host)."""

    TYPE: ClassVar[str] = "open"
    model: str = field(metadata=_m(max_len=MAX_MODEL))
    members_expected: int = field(metadata=_m(lo=1, hi=MAX_MEMBERS))
    name: str = field(metadata=_m(max_len=MAX_NAME))
    capability: JsonObject = field(metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    nat: JsonObject | None = field(default=None, metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    candidates: list[str] = field(default_factory=list, metadata=_m(max_len=MAX_CANDIDATES))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Protect:
    """Host only, once, right after `opened`: the session's join verifier (hex), i.e.
    `codes.join_key(code, salt)`, and its salt (hex). Joins are refused until it came."""

    TYPE: ClassVar[str] = "protect"
    salt: str = field(metadata=_m(max_len=2 * 64))
    verifier: str = field(metadata=_m(max_len=2 * 64))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class JoinChallenge:
    """Ask for a fresh nonce to prove the code's secret part on (answered with `challenge`)."""

    TYPE: ClassVar[str] = "join_challenge"
    session: str = field(metadata=_m(max_len=32))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Join:
    """Join a session by the public part of its code, proving the secret part without sending it:
    `proof` (hex) is `codes.join_proof(join_key(code, salt), public, nonce)` over this connection's
    last `challenge`, which it uses up."""

    TYPE: ClassVar[str] = "join"
    session: str = field(metadata=_m(max_len=32))
    proof: str = field(metadata=_m(max_len=2 * 64))
    name: str = field(metadata=_m(max_len=MAX_NAME))
    capability: JsonObject = field(metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    nat: JsonObject | None = field(default=None, metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    candidates: list[str] = field(default_factory=list, metadata=_m(max_len=MAX_CANDIDATES))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class TicketRequest:
    """Host only, once its verifier is registered: ask for the session's re-open ticket (answered
    with `ticket`), which lets it register the same session again after the rendezvous restarts."""

    TYPE: ClassVar[str] = "ticket_request"
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Reopen:
    """Host, after losing the rendezvous: register its session again under the same public code,
    with the verifier and salt it protected it with and the `ticket` the rendezvous gave for them
    (docs/rendezvous.md, "Re-registering after a restart"). Answered with `opened`. `member` is
    the host's own id; the session's ids below `next_member` are kept for its members' `rejoin`."""

    TYPE: ClassVar[str] = "reopen"
    session: str = field(metadata=_m(max_len=32))
    ticket: str = field(metadata=_m(max_len=2 * 64))
    salt: str = field(metadata=_m(max_len=2 * 64))
    verifier: str = field(metadata=_m(max_len=2 * 64))
    member: int = field(metadata=_m(lo=1, hi=2**31))
    next_member: int = field(metadata=_m(lo=2, hi=2**31))
    model: str = field(metadata=_m(max_len=MAX_MODEL))
    members_expected: int = field(metadata=_m(lo=1, hi=MAX_MEMBERS))
    name: str = field(metadata=_m(max_len=MAX_NAME))
    capability: JsonObject = field(metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    nat: JsonObject | None = field(default=None, metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    candidates: list[str] = field(default_factory=list, metadata=_m(max_len=MAX_CANDIDATES))
    # the relay legs this member holds, "CHANNEL/LEG/PEER/TOKEN" (token hex): the restarted relay
    # learns whose channels it took back (relay_leg_claim)
    relays: list[str] = field(default_factory=list, metadata=_m(max_len=MAX_RELAY_CLAIMS))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class RejoinChallenge:
    """A member of a session the host re-opened asks for a nonce to prove the code on, to take
    its place `member` again (answered with `challenge`)."""

    TYPE: ClassVar[str] = "rejoin_challenge"
    session: str = field(metadata=_m(max_len=32))
    member: int = field(metadata=_m(lo=1, hi=2**31))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Rejoin:
    """Take place `member` again in a re-opened session, proving the code as a join does over this
    connection's last `rejoin_challenge` (for the same member). Answered with `joined`; the others
    get `member_updated` (a member back, not a new one)."""

    TYPE: ClassVar[str] = "rejoin"
    session: str = field(metadata=_m(max_len=32))
    proof: str = field(metadata=_m(max_len=2 * 64))
    member: int = field(metadata=_m(lo=1, hi=2**31))
    name: str = field(metadata=_m(max_len=MAX_NAME))
    capability: JsonObject = field(metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    nat: JsonObject | None = field(default=None, metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    candidates: list[str] = field(default_factory=list, metadata=_m(max_len=MAX_CANDIDATES))
    relays: list[str] = field(default_factory=list, metadata=_m(max_len=MAX_RELAY_CLAIMS))  # as reopen's
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class SucceedChallenge:
    """A member of a session whose host is gone asks for a nonce to prove the code on, to take the
    host's place (answered with `challenge`)."""

    TYPE: ClassVar[str] = "succeed_challenge"
    session: str = field(metadata=_m(max_len=32))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Succeed:
    """This member (already in the session on this connection) becomes the session's host, its
    host being gone, proving the code as a join does over this connection's last
    `succeed_challenge`. Answered with `joined`; the others get `member_updated` (it is the host)."""

    TYPE: ClassVar[str] = "succeed"
    session: str = field(metadata=_m(max_len=32))
    proof: str = field(metadata=_m(max_len=2 * 64))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Update:
    """Replace this member's capability, NAT report or candidates; others get member_updated."""

    TYPE: ClassVar[str] = "update"
    capability: JsonObject | None = field(default=None, metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    nat: JsonObject | None = field(default=None, metadata=_m(max_bytes=MAX_OBJECT_BYTES))
    candidates: list[str] | None = field(default=None, metadata=_m(max_len=MAX_CANDIDATES))


@dataclass(frozen=True, slots=True)
class Signal:
    """An opaque payload for one other member of the session."""

    TYPE: ClassVar[str] = "signal"
    to: int = field(metadata=_m(lo=1, hi=2**31))
    payload: JsonObject = field(metadata=_m(max_bytes=MAX_PAYLOAD_BYTES))


@dataclass(frozen=True, slots=True)
class RelayRequest:
    """Ask for a relay channel for the ring edge between this member and `peer`."""

    TYPE: ClassVar[str] = "relay_request"
    peer: int = field(metadata=_m(lo=1, hi=2**31))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Heartbeat:
    TYPE: ClassVar[str] = "heartbeat"
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Leave:
    TYPE: ClassVar[str] = "leave"
    reason: str | None = field(default=None, metadata=_m(max_len=200))


@dataclass(frozen=True, slots=True)
class Remove:
    """Host only: take `member` out of the session (it failed to authenticate); its place frees up."""

    TYPE: ClassVar[str] = "remove"
    member: int = field(metadata=_m(lo=1, hi=2**31))
    reason: str = field(metadata=_m(max_len=200))


# ------------------------------------------------------------------ rendezvous -> client


@dataclass(frozen=True, slots=True)
class Opened:
    TYPE: ClassVar[str] = "opened"
    session: str = field(metadata=_m(max_len=32))  # public part of the code
    member: int = field(metadata=_m(lo=1, hi=2**31))
    expires_in: float = field(metadata=_m(lo=0))  # seconds the code stays valid while nobody joins
    heartbeat_s: float = field(metadata=_m(lo=0))  # send a heartbeat at least this often
    probe_port: int | None = field(default=None, metadata=_m(lo=1, hi=65535))  # UDP probes and relay
    probe_alt_port: int | None = field(default=None, metadata=_m(lo=1, hi=65535))
    probe_alt_host: str | None = field(default=None, metadata=_m(max_len=64))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Protected:
    TYPE: ClassVar[str] = "protected"
    session: str = field(metadata=_m(max_len=32))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Ticket:
    """The session's re-open ticket (hex): the rendezvous's MAC of the code's public part, salt and
    verifier under a key kept with its relay secret; only the host gets it."""

    TYPE: ClassVar[str] = "ticket"
    session: str = field(metadata=_m(max_len=32))
    ticket: str = field(metadata=_m(max_len=2 * 64))
    kept: bool = field(default=False, metadata=_m())  # the secret outlives a restart: so does the ticket
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Challenge:
    """A nonce (hex) for one join on `session`, and the session's salt (hex) to derive the key with;
    it says nothing about the host."""

    TYPE: ClassVar[str] = "challenge"
    session: str = field(metadata=_m(max_len=32))
    salt: str = field(metadata=_m(max_len=2 * 64))
    nonce: str = field(metadata=_m(max_len=2 * 64))
    expires_in: float = field(metadata=_m(lo=0))  # seconds the nonce stays good for a join
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class Joined:
    TYPE: ClassVar[str] = "joined"
    session: str = field(metadata=_m(max_len=32))
    member: int = field(metadata=_m(lo=1, hi=2**31))
    model: str = field(metadata=_m(max_len=MAX_MODEL))
    members_expected: int = field(metadata=_m(lo=1, hi=MAX_MEMBERS))
    # everyone in the session, this member included
    members: list[MemberInfo] = field(metadata=_m(max_len=MAX_MEMBERS))
    heartbeat_s: float = field(metadata=_m(lo=0))
    probe_port: int | None = field(default=None, metadata=_m(lo=1, hi=65535))
    probe_alt_port: int | None = field(default=None, metadata=_m(lo=1, hi=65535))
    probe_alt_host: str | None = field(default=None, metadata=_m(max_len=64))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class MemberJoined:
    TYPE: ClassVar[str] = "member_joined"
    member: MemberInfo = field(metadata=_m())


@dataclass(frozen=True, slots=True)
class MemberUpdated:
    TYPE: ClassVar[str] = "member_updated"
    member: MemberInfo = field(metadata=_m())


@dataclass(frozen=True, slots=True)
class SignalFrom:
    """A signal delivered to its recipient; `sender` travels as JSON key "from"."""

    TYPE: ClassVar[str] = "signal"
    sender: int = field(metadata=_m(key="from", lo=1, hi=2**31))
    payload: JsonObject = field(metadata=_m(max_bytes=MAX_PAYLOAD_BYTES))


@dataclass(frozen=True, slots=True)
class RelayAllocated:
    """A relay channel for the edge to `peer`; `token` (hex) binds this member's leg only."""

    TYPE: ClassVar[str] = "relay_allocated"
    channel: int = field(metadata=_m(lo=1, hi=2**32 - 1))
    peer: int = field(metadata=_m(lo=1, hi=2**31))
    leg: int = field(metadata=_m(lo=0, hi=1))
    token: str = field(metadata=_m(max_len=32))
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class HeartbeatAck:
    TYPE: ClassVar[str] = "heartbeat_ack"
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


@dataclass(frozen=True, slots=True)
class MemberLeft:
    TYPE: ClassVar[str] = "member_left"
    member: int = field(metadata=_m(lo=1, hi=2**31))
    reason: str = field(metadata=_m(max_len=32))  # "left", "timed_out", "disconnected", "removed"


@dataclass(frozen=True, slots=True)
class Error:
    """A refused or malformed request. `fatal`: the rendezvous closes the connection after it."""

    TYPE: ClassVar[str] = "error"
    code: str = field(metadata=_m(max_len=32))
    message: str = field(metadata=_m(max_len=1000))
    fatal: bool = field(default=False, metadata=_m())
    ref: str | None = field(default=None, metadata=_m(max_len=MAX_REF))


ClientMessage = (
    Open
    | Protect
    | JoinChallenge
    | Join
    | TicketRequest
    | Reopen
    | RejoinChallenge
    | Rejoin
    | SucceedChallenge
    | Succeed
    | Update
    | Signal
    | RelayRequest
    | Heartbeat
    | Leave
    | Remove
)
ServerMessage = (
    Opened
    | Protected
    | Ticket
    | Challenge
    | Joined
    | MemberJoined
    | MemberUpdated
    | SignalFrom
    | RelayAllocated
    | HeartbeatAck
    | MemberLeft
    | Error
)
CLIENT_TYPES: dict[str, type] = {
    c.TYPE: c
    for c in (
        Open,
        Protect,
        JoinChallenge,
        Join,
        TicketRequest,
        Reopen,
        RejoinChallenge,
        Rejoin,
        SucceedChallenge,
        Succeed,
        Update,
        Signal,
        RelayRequest,
        Heartbeat,
        Leave,
        Remove,
    )
}
SERVER_TYPES: dict[str, type] = {
    c.TYPE: c
    for c in (
        Opened,
        Protected,
        Ticket,
        Challenge,
        Joined,
        MemberJoined,
        MemberUpdated,
        SignalFrom,
        RelayAllocated,
        HeartbeatAck,
        MemberLeft,
        Error,
    )
}

# ------------------------------------------------------------------ encode


def encode(msg: ClientMessage | ServerMessage, version: int = VERSION) -> str:
    """One JSON text frame for a message (compact, stable key order); `version` only for an `error`
    answering a peer of an older version (see the module doc)."""
    if version != VERSION and not (isinstance(msg, Error) and version in OLD_VERSIONS):
        raise ValueError(f"only an error can be encoded for version {version}, not {type(msg).TYPE}")
    body = {"v": version, "type": type(msg).TYPE, **_to_json(msg)}
    return json.dumps(body, separators=(",", ":"), allow_nan=False)


def _to_json(obj: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for f in fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, list):
            value = [_to_json(v) if isinstance(v, MemberInfo) else v for v in value]
        elif isinstance(value, MemberInfo):
            value = _to_json(value)
        out[f.metadata["key"] or f.name] = value
    return out


# ------------------------------------------------------------------ decode


def decode_client(text: str | bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> ClientMessage:
    """Parse a frame a member sent to the rendezvous."""
    return typing.cast(ClientMessage, _decode(text, max_bytes, CLIENT_TYPES))


def decode_server(text: str | bytes, max_bytes: int = MAX_SERVER_MESSAGE_BYTES) -> ServerMessage:
    """Parse a frame the rendezvous sent to a member."""
    return typing.cast(ServerMessage, _decode(text, max_bytes, SERVER_TYPES))


def _decode(text: str | bytes, max_bytes: int, table: dict[str, type]) -> Any:
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if len(raw) > max_bytes:
        raise ProtocolError(f"message of {len(raw)} bytes exceeds the limit of {max_bytes}", "too_large")
    obj = _parse_json(raw)
    if not isinstance(obj, dict):
        raise ProtocolError(f"message must be a JSON object, got {_jtype(obj)}")
    ref = obj.get("ref")
    try:
        return _typed(obj, table)
    except ProtocolError as exc:  # a readable ref goes back with the error, to the waiting request
        exc.ref = ref if isinstance(ref, str) and 0 < len(ref) <= MAX_REF else None
        raise


def _typed(obj: dict[str, Any], table: dict[str, type]) -> Any:
    version = obj.pop("v", None)
    kind = obj.pop("type", None)
    old_error = table is SERVER_TYPES and kind == "error" and version in OLD_VERSIONS
    if (version != VERSION and not old_error) or isinstance(version, bool):
        exc = ProtocolError(
            f"signaling protocol version {version!r} is not supported: this side speaks version "
            f"{VERSION}{_upgrade(version)}",
            "unsupported_version",
        )
        exc.version = version if isinstance(version, int) and not isinstance(version, bool) else None
        raise exc
    if not isinstance(kind, str) or kind not in table:
        raise ProtocolError(f"unknown message type {kind!r}; expected one of {sorted(table)}", "unknown_type")
    return _build(table[kind], obj, kind)


def _upgrade(version: Any) -> str:
    if isinstance(version, int) and not isinstance(version, bool) and version < VERSION:
        return "; upgrade kafila on the member (joins now prove the code's secret to the rendezvous)"
    if isinstance(version, int) and not isinstance(version, bool) and version > VERSION:
        return "; upgrade this side of kafila"
    return ""


def _parse_json(raw: bytes) -> Any:
    try:
        return json.loads(
            raw, object_pairs_hook=_no_duplicates, parse_constant=_no_constant, parse_float=_finite_float
        )
    except ProtocolError:
        raise
    except RecursionError as exc:
        raise ProtocolError("JSON nested too deeply") from exc
    except (ValueError, UnicodeDecodeError) as exc:
        raise ProtocolError(f"not valid JSON: {exc}") from exc


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise ProtocolError(f"duplicate key {k!r}")
        out[k] = v
    return out


def _no_constant(name: str) -> Any:
    raise ProtocolError(f"{name} is not allowed in a message")


def _finite_float(text: str) -> float:
    """A JSON number as a float; one beyond a float's range (1e400 reads as inf) is refused here,
    since no message holding it could be sent on (encoding refuses inf and NaN)."""
    v = float(text)
    if not math.isfinite(v):
        raise ProtocolError(f"number {text[:40]} is beyond what a message may hold")
    return v


def _build(cls: type, obj: dict[str, Any], where: str) -> Any:
    hints = typing.get_type_hints(cls)
    specs = {f.metadata["key"] or f.name: f for f in fields(cls)}
    unknown = sorted(set(obj) - set(specs))
    if unknown:
        raise ProtocolError(f"{where}: unknown field(s) {unknown}; allowed {sorted(specs)}")
    kwargs: dict[str, Any] = {}
    for key, f in specs.items():
        if key not in obj:
            if f.default is MISSING and f.default_factory is MISSING:
                raise ProtocolError(f"{where}: missing field {key!r}")
            continue
        kwargs[f.name] = _check(obj[key], hints[f.name], f.metadata, f"{where}.{key}")
    return cls(**kwargs)


def _check(value: Any, hint: Any, meta: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        return _check(value, options[0], meta, where)
    if origin is list:
        return _check_list(value, typing.get_args(hint)[0], meta, where)
    if origin is dict:
        return _check_object(value, meta, where)
    if hint is MemberInfo:
        if not isinstance(value, dict):
            raise ProtocolError(f"{where}: expected object, got {_jtype(value)}")
        return _build(MemberInfo, value, where)
    return _check_scalar(value, hint, meta, where)


def _check_scalar(value: Any, hint: Any, meta: Any, where: str) -> Any:
    if hint is bool:
        if not isinstance(value, bool):
            raise ProtocolError(f"{where}: expected boolean, got {_jtype(value)}")
        return value
    if hint is str:
        if not isinstance(value, str):
            raise ProtocolError(f"{where}: expected string, got {_jtype(value)}")
        if meta["max_len"] is not None and len(value) > meta["max_len"]:
            raise ProtocolError(f"{where}: {len(value)} characters, at most {meta['max_len']}")
        if any(ord(c) < 0x20 or 0xD800 <= ord(c) <= 0xDFFF for c in value):
            raise ProtocolError(f"{where}: control characters or lone surrogates are not allowed")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ProtocolError(f"{where}: expected integer, got {_jtype(value)}")
    elif hint is float:
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise ProtocolError(f"{where}: expected number, got {_jtype(value)}")
        value = float(value)
    else:  # pragma: no cover - a schema mistake, not bad input
        raise TypeError(f"{where}: unsupported schema type {hint!r}")
    if meta["lo"] is not None and value < meta["lo"]:
        raise ProtocolError(f"{where}: {value} is below the minimum {meta['lo']}")
    if meta["hi"] is not None and value > meta["hi"]:
        raise ProtocolError(f"{where}: {value} is above the maximum {meta['hi']}")
    return value


def _check_list(value: Any, item: Any, meta: Any, where: str) -> list[Any]:
    if not isinstance(value, list):
        raise ProtocolError(f"{where}: expected array, got {_jtype(value)}")
    if meta["max_len"] is not None and len(value) > meta["max_len"]:
        raise ProtocolError(f"{where}: {len(value)} items, at most {meta['max_len']}")
    item_meta = {"key": None, "max_len": MAX_CANDIDATE, "lo": None, "hi": None, "max_bytes": None}
    return [_check(v, item, item_meta, f"{where}[{i}]") for i, v in enumerate(value)]


def _check_object(value: Any, meta: Any, where: str) -> JsonObject:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected object, got {_jtype(value)}")
    if _depth(value) > MAX_DEPTH:
        raise ProtocolError(f"{where}: nested deeper than {MAX_DEPTH} levels")
    size = len(json.dumps(value, separators=(",", ":")))
    if meta["max_bytes"] is not None and size > meta["max_bytes"]:
        raise ProtocolError(f"{where}: {size} bytes, at most {meta['max_bytes']}", "too_large")
    return value


def _depth(value: Any, level: int = 1) -> int:
    if level > MAX_DEPTH:
        return level
    if isinstance(value, dict):
        return max((_depth(v, level + 1) for v in value.values()), default=level)
    if isinstance(value, list):
        return max((_depth(v, level + 1) for v in value), default=level)
    return level


def _jtype(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int | float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    return "object"


def relay_leg_claim(channel: int, leg: int, peer: int, token: str) -> str:
    """A relay leg as `reopen` and `rejoin` name it."""
    return f"{channel}/{leg}/{peer}/{token}"


def parse_relay_leg_claim(text: str) -> tuple[int, int, int, bytes]:
    """(channel, leg, peer, token) of a `relay_leg_claim`; ProtocolError naming what is wrong."""
    parts = text.split("/")
    try:
        if len(parts) != 4 or not all(p.isascii() and p.isdecimal() for p in parts[:3]):
            raise ValueError
        channel, leg, peer, token = int(parts[0]), int(parts[1]), int(parts[2]), bytes.fromhex(parts[3])
    except ValueError:
        raise ProtocolError(f"relay leg {text!r}: expected CHANNEL/LEG/PEER/TOKEN (token in hex)") from None
    if not (1 <= channel < 2**32 and leg in (0, 1) and 1 <= peer <= 2**31 and len(token) == 16):
        raise ProtocolError(
            f"relay leg {text!r}: a channel 1..2^32-1, leg 0 or 1, a member id, 16 token bytes"
        )
    return channel, leg, peer, token


def signal_url(text: str) -> str:
    """The signaling URL for what a person types for the rendezvous: a ws:// or wss:// URL, an
    http:// or https:// one (its WebSocket twin), or HOST[:PORT] (ws://, port 8470); a URL without
    a path gets the signaling path. ValueError names what is wrong."""
    given, bad = text.strip(), f"{text!r} is not a rendezvous address"
    parts = urlsplit(given if "://" in given else f"ws://{given}")
    scheme = {"ws": "ws", "wss": "wss", "http": "ws", "https": "wss"}.get(parts.scheme.lower())
    if scheme is None:
        raise ValueError(f"{bad}: give a ws://, wss://, http:// or https:// URL, or HOST[:PORT]")
    try:
        port = parts.port
    except ValueError as exc:  # a port that is not a number or past 65535
        raise ValueError(f"{bad}: {exc}") from None
    if not parts.hostname:
        raise ValueError(f"{bad}: it names no host")
    host = url_host(parts.hostname)
    port = port if port is not None else (DEFAULT_PORT if "://" not in given else None)
    path = parts.path if parts.path not in ("", "/") else SIGNAL_PATH
    query = f"?{parts.query}" if parts.query else ""
    return f"{scheme}://{host}{'' if port is None else f':{port}'}{path}{query}"
