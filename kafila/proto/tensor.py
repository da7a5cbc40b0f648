"""Session messages on a ring link: tensor frames and control messages (pure encode/decode).

Every message is one length-prefixed record, so the same bytes work over a message-oriented link
(one record per message) and over a byte stream (`FrameReader` splits them again):

    u32 body_length | u8 version | u8 kind | u32 epoch | body

`epoch` is the plan epoch of the ring the sender is in (1: the plan the session formed with; each
re-plan counts one up). A channel belongs to one epoch and drops, undecoded, every record of
another (kafila.proto.epoch.EpochGate): a frame still in flight from before a re-plan is never
computed. Version 2 added the epoch; version 1 records are refused by name.

Tensor frames (kind HIDDEN) carry hidden states for a batch of requests at one stage step:

    u16 flags | u32 step | u8 dtype | u8 ndim | u16 n_entries | u8 n_timings
    ndim x u32 shape
    n_entries x (u32 request_id | u32 position | u32 n_tokens)
    n_timings x u32 compute microseconds of each stage this frame has passed, in ring order
    raw tensor bytes (row-major, little-endian; exactly numel * itemsize of dtype)

Entries name which rows of the tensor belong to which request: request `r` owns `n_tokens` rows
starting where the previous entry ended, and its first row is at sequence position `position`.

Fetch responses (kind FETCH_DATA) are `u32 fetch_id | raw bytes`. Every other kind is a UTF-8 JSON
object whose fields are checked on decode. Decoding never trusts a length: malformed input raises
`FrameError` naming what was wrong, nothing else.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import asdict, dataclass, field
from enum import IntEnum
from typing import Any, ClassVar

VERSION = 2  # 2: the plan epoch in every record's prefix
MAX_EPOCH = 2**32 - 1
MAX_BODY = 1 << 30  # 1 GiB: a frame larger than this is refused, not allocated

_PREFIX = struct.Struct("<IBBI")  # body_length, version, kind, epoch
_HIDDEN = struct.Struct("<HIBBHB")  # flags, step, dtype, ndim, n_entries, n_timings
_ENTRY = struct.Struct("<III")  # request_id, position, n_tokens
_U32 = struct.Struct("<I")


class FrameError(ValueError):
    """Bytes that are not a valid session message; the text says which field is wrong."""


class Kind(IntEnum):
    HIDDEN = 1  # hidden states travelling around the ring
    FETCH_REQUEST = 2  # member -> host: give me bytes [offset, offset+length) of file
    FETCH_DATA = 3  # host -> member: the bytes of one fetch request
    GENERATE = 4  # non-head member -> head: run this request
    TOKENS = 5  # head -> requester: tokens produced for a request
    CANCEL = 6  # either way: stop this request
    ERROR = 7  # a request (or the link) failed; the message says why
    CONTROL = 8  # session control: plan, ready, heartbeat, leave (JSON, typed by "op")


class DType(IntEnum):
    F32 = 1
    F16 = 2
    BF16 = 3


ITEMSIZE = {DType.F32: 4, DType.F16: 2, DType.BF16: 2}


class Flag:
    PREFILL = 1  # rows are prompt tokens (prefill chunk), not decode steps
    LAST_CHUNK = 2  # the last prefill chunk: the head samples after it


@dataclass(frozen=True)
class Entry:
    request_id: int
    position: int  # sequence position of this request's first row
    n_tokens: int


@dataclass(frozen=True)
class Hidden:
    """Hidden states [sum(n_tokens), hidden] for a batch of requests at one step."""

    step: int
    dtype: DType
    shape: tuple[int, ...]
    entries: tuple[Entry, ...]
    data: bytes
    flags: int = 0
    timings_us: tuple[int, ...] = ()  # compute time at each stage passed so far (microseconds)

    kind: ClassVar[Kind] = Kind.HIDDEN


@dataclass(frozen=True)
class FetchData:
    fetch_id: int
    data: bytes

    kind: ClassVar[Kind] = Kind.FETCH_DATA


@dataclass(frozen=True)
class FetchRequest:
    fetch_id: int
    file: str
    offset: int
    length: int

    kind: ClassVar[Kind] = Kind.FETCH_REQUEST


@dataclass(frozen=True)
class Generate:
    """A request forwarded to the head: prompt token ids plus sampling parameters."""

    request_id: int
    prompt: tuple[int, ...]
    max_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[int, ...] = ()
    repeat_penalty: float = 1.0
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0
    # carried from a head that was lost: `generated` holds the tokens its client has had, which the
    # new head prefills after the prompt and goes on from (also while it re-plans)
    carried: bool = False
    generated: tuple[int, ...] = ()
    # the member whose client asked, where it is not the one the request id's origin tag names (a
    # spare's request, relayed by the host): the head's records name it ("": the origin's member)
    asker: str = ""

    kind: ClassVar[Kind] = Kind.GENERATE


@dataclass(frozen=True)
class Tokens:
    """Tokens the head produced; `finish` is set on the last message ("stop" | "length")."""

    request_id: int
    tokens: tuple[int, ...]
    finish: str | None = None
    queue_position: int | None = None  # set while the request waits for a slot
    prefill_s: float | None = None  # set once, on the message with the first token
    drafted: int = 0  # drafted tokens the step that gave these verified (speculative decoding)
    accepted: int = 0  # ... and those of them kept (among `tokens`)

    kind: ClassVar[Kind] = Kind.TOKENS


@dataclass(frozen=True)
class Cancel:
    request_id: int
    reason: str = "cancelled"

    kind: ClassVar[Kind] = Kind.CANCEL


@dataclass(frozen=True)
class Error:
    request_id: int  # 0: the error concerns the link or session, not one request
    code: str
    message: str

    kind: ClassVar[Kind] = Kind.ERROR


@dataclass(frozen=True)
class Control:
    op: str
    body: dict[str, Any] = field(default_factory=dict)

    kind: ClassVar[Kind] = Kind.CONTROL


Message = Hidden | FetchData | FetchRequest | Generate | Tokens | Cancel | Error | Control

# JSON kinds: class and the type each field must have after decoding
_JSON: dict[Kind, type] = {
    Kind.FETCH_REQUEST: FetchRequest,
    Kind.GENERATE: Generate,
    Kind.TOKENS: Tokens,
    Kind.CANCEL: Cancel,
    Kind.ERROR: Error,
    Kind.CONTROL: Control,
}
_FIELDS: dict[type, dict[str, tuple[type, ...]]] = {
    FetchRequest: {"fetch_id": (int,), "file": (str,), "offset": (int,), "length": (int,)},
    Generate: {
        "request_id": (int,),
        "prompt": (list,),
        "max_tokens": (int,),
        "temperature": (float, int),
        "top_k": (int,),
        "top_p": (float, int),
        "seed": (int, type(None)),
        "stop": (list,),
        "repeat_penalty": (float, int),
        "repeat_last_n": (int,),
        "presence_penalty": (float, int),
        "frequency_penalty": (float, int),
        "min_p": (float, int),
        "carried": (bool,),
        "generated": (list,),
        "asker": (str,),
    },
    Tokens: {
        "request_id": (int,),
        "tokens": (list,),
        "finish": (str, type(None)),
        "queue_position": (int, type(None)),
        "prefill_s": (float, int, type(None)),
        "drafted": (int,),
        "accepted": (int,),
    },
    Cancel: {"request_id": (int,), "reason": (str,)},
    Error: {"request_id": (int,), "code": (str,), "message": (str,)},
    Control: {"op": (str,), "body": (dict,)},
}
_INT_LISTS = {"prompt", "tokens", "stop", "generated"}
_OPTIONAL = {
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "stop",
    "repeat_penalty",
    "repeat_last_n",
    "presence_penalty",
    "frequency_penalty",
    "min_p",
    "carried",
    "generated",
    "asker",
    "finish",
    "queue_position",
    "prefill_s",
    "drafted",
    "accepted",
    "reason",
}


PREFIX_BYTES = _PREFIX.size


@dataclass(frozen=True)
class Header:
    """A record's prefix, read without its body."""

    length: int  # body bytes
    kind: int  # not checked yet: the body's decoder names an unknown kind
    epoch: int


def encode(msg: Message, epoch: int) -> bytes:
    """One record of plan epoch `epoch`: length prefix, version, kind, epoch, body."""
    if not 0 <= epoch <= MAX_EPOCH or isinstance(epoch, bool):
        raise FrameError(f"epoch {epoch!r} is outside 0..{MAX_EPOCH}")
    body = _encode_body(msg)
    if len(body) > MAX_BODY:
        raise FrameError(f"{msg.kind.name} body of {len(body)} bytes exceeds the {MAX_BODY}-byte limit")
    return _PREFIX.pack(len(body), VERSION, int(msg.kind), epoch) + body


def header(record: bytes | memoryview) -> Header:
    """The prefix of exactly one record (its version and length checked), the body not read."""
    view = memoryview(record)
    if len(view) < _PREFIX.size:
        raise FrameError(f"record of {len(view)} bytes is shorter than the {_PREFIX.size}-byte prefix")
    length, version, kind, epoch = _PREFIX.unpack_from(view)
    if version != VERSION:
        raise FrameError(f"unsupported version {version} (this build speaks {VERSION})")
    if length != len(view) - _PREFIX.size:
        raise FrameError(f"length prefix says {length} bytes, record holds {len(view) - _PREFIX.size}")
    return Header(length, kind, epoch)


def decode(record: bytes | memoryview) -> Message:
    """Inverse of `encode` for exactly one record, whatever its epoch (kafila.proto.epoch filters)."""
    return _decode_body(header(record).kind, memoryview(record)[_PREFIX.size :])


def _encode_body(msg: Message) -> bytes:
    if isinstance(msg, Hidden):
        return _encode_hidden(msg)
    if isinstance(msg, FetchData):
        return _U32.pack(msg.fetch_id) + bytes(msg.data)
    d = asdict(msg)
    for k in _INT_LISTS & d.keys():
        d[k] = list(d[k])
    return json.dumps(d, separators=(",", ":")).encode()


def _encode_hidden(msg: Hidden) -> bytes:
    expected = hidden_nbytes(msg.dtype, msg.shape)
    if len(msg.data) != expected:
        raise FrameError(f"hidden data is {len(msg.data)} bytes, shape {msg.shape} needs {expected}")
    rows = sum(e.n_tokens for e in msg.entries)
    if msg.shape and rows != msg.shape[0]:
        raise FrameError(f"entries cover {rows} rows, tensor has {msg.shape[0]}")
    head = _HIDDEN.pack(
        msg.flags, msg.step, int(msg.dtype), len(msg.shape), len(msg.entries), len(msg.timings_us)
    )
    dims = b"".join(_U32.pack(n) for n in msg.shape)
    entries = b"".join(_ENTRY.pack(e.request_id, e.position, e.n_tokens) for e in msg.entries)
    timings = b"".join(_U32.pack(min(t, 2**32 - 1)) for t in msg.timings_us)
    return head + dims + entries + timings + bytes(msg.data)


def hidden_nbytes(dtype: DType, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * ITEMSIZE[DType(dtype)]


def _decode_body(kind: int, body: memoryview) -> Message:
    if kind == Kind.HIDDEN:
        return _decode_hidden(body)
    if kind == Kind.FETCH_DATA:
        if len(body) < _U32.size:
            raise FrameError("FETCH_DATA body has no fetch id")
        return FetchData(_U32.unpack_from(body)[0], bytes(body[_U32.size :]))
    if kind not in {int(k) for k in _JSON}:
        raise FrameError(f"unknown message kind {kind}")
    return _decode_json(Kind(kind), body)


def _decode_hidden(body: memoryview) -> Hidden:
    if len(body) < _HIDDEN.size:
        raise FrameError(f"HIDDEN body of {len(body)} bytes is shorter than its {_HIDDEN.size}-byte header")
    flags, step, dtype_code, ndim, n_entries, n_timings = _HIDDEN.unpack_from(body)
    if dtype_code not in DType._value2member_map_:
        raise FrameError(f"unknown dtype code {dtype_code}")
    at = _HIDDEN.size
    need = at + (ndim + n_timings) * _U32.size + n_entries * _ENTRY.size
    if len(body) < need:
        raise FrameError(
            f"HIDDEN header declares {ndim} dims, {n_entries} entries, {n_timings} timings; body too short"
        )
    shape = tuple(_U32.unpack_from(body, at + i * _U32.size)[0] for i in range(ndim))
    at += ndim * _U32.size
    entries = tuple(Entry(*_ENTRY.unpack_from(body, at + i * _ENTRY.size)) for i in range(n_entries))
    at += n_entries * _ENTRY.size
    timings = tuple(_U32.unpack_from(body, at + i * _U32.size)[0] for i in range(n_timings))
    at += n_timings * _U32.size
    data = body[at:]
    dtype = DType(dtype_code)
    if len(data) != hidden_nbytes(dtype, shape):
        raise FrameError(
            f"shape {shape} {dtype.name} needs {hidden_nbytes(dtype, shape)} bytes, got {len(data)}"
        )
    if shape and sum(e.n_tokens for e in entries) != shape[0]:
        raise FrameError(f"entries cover {sum(e.n_tokens for e in entries)} rows, tensor has {shape[0]}")
    return Hidden(
        step=step,
        dtype=dtype,
        shape=shape,
        entries=entries,
        data=bytes(data),
        flags=flags,
        timings_us=timings,
    )


def _decode_json(kind: Kind, body: memoryview) -> Message:
    cls = _JSON[kind]
    try:
        d = json.loads(bytes(body).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise FrameError(f"{kind.name} body is not JSON: {exc}") from None
    if not isinstance(d, dict):
        raise FrameError(f"{kind.name} body is {type(d).__name__}, not an object")
    fields = _FIELDS[cls]
    unknown = d.keys() - fields.keys()
    if unknown:
        raise FrameError(f"{kind.name} has unknown fields {sorted(unknown)}")
    for name, types in fields.items():
        _check_field(kind, d, name, types)
    for k in _INT_LISTS & d.keys():
        d[k] = tuple(d[k])
    return cls(**d)


def _check_field(kind: Kind, d: dict[str, Any], name: str, types: tuple[type, ...]) -> None:
    if name not in d:
        if name in _OPTIONAL:
            return
        raise FrameError(f"{kind.name} is missing {name!r}")
    value = d[name]
    if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
        raise FrameError(f"{kind.name}.{name} is {type(value).__name__}, expected {types[0].__name__}")
    if isinstance(value, int) and value < 0 and name not in {"seed"}:
        raise FrameError(f"{kind.name}.{name} is negative ({value})")
    if name in _INT_LISTS and not all(isinstance(t, int) and not isinstance(t, bool) for t in d[name]):
        raise FrameError(f"{kind.name}.{name} must be a list of token ids")


class FrameReader:
    """Splits a byte stream into records (pure: feed bytes, take complete messages)."""

    def __init__(self, max_body: int = MAX_BODY) -> None:
        self._buf = bytearray()
        self._max = max_body

    def feed(self, data: bytes) -> list[Message]:
        self._buf += data
        out: list[Message] = []
        while len(self._buf) >= _PREFIX.size:
            length = _U32.unpack_from(self._buf)[0]
            if length > self._max:
                raise FrameError(f"record of {length} bytes exceeds the {self._max}-byte limit")
            end = _PREFIX.size + length
            if len(self._buf) < end:
                break
            record = bytes(self._buf[:end])
            del self._buf[:end]
            out.append(decode(record))
        return out

    @property
    def pending(self) -> int:
        return len(self._buf)
