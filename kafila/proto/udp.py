"""UDP control messages that share one socket with QUIC (pure encode/decode, no I/O).

Every message starts with a type byte in 0x00-0x3F; QUIC v1 always sets bit 0x40 in its first
byte, so `classify_datagram(data[0])` tells the two apart (as STUN does). The second byte is the
format version (`VERSION`). Integers are big-endian. An address is `family:u8 (4|6), port:u16,
ip:4|16 bytes`.

| type | message          | body after `type, version` |
|------|------------------|------------------------------|
| 0x01 | BindingRequest   | txid:12, flags:u8 (1 reply from other port, 2 reply from other address) |
| 0x02 | BindingResponse  | txid:12, applied flags:u8, observed addr, answered-from addr, other addr (or 0) |
| 0x03 | BindingError     | txid:12, code:u8, reason_len:u8, reason (utf-8) |
| 0x10 | RelayBind        | channel:u32, token:16 |
| 0x11 | RelayBindAck     | channel:u32, peer_bound:u8 (0/1), observed addr |
| 0x12 | RelayBindError   | channel:u32, code:u8, reason_len:u8, reason (utf-8) |
| 0x13 | RelayData        | channel:u32, then the datagram, unchanged, to the end |
| 0x20 | PunchProbe       | txid:12, auth_len:u16, auth (opaque, filled by kafila.net) |
| 0x21 | PunchAck         | txid:12, observed addr, auth_len:u16, auth |
| 0x30 | PathProbe        | txid:12, size:u16, zero padding: the datagram is exactly `size` bytes |
| 0x31 | PathAck          | txid:12, size:u16 (the probe's size as it arrived) |

Relay data travels in both directions with the same header: a member sends `RelayData(channel,
quic)` to the relay, and the relay forwards exactly those bytes to the other leg, so a member
socket carrying two relayed channels (both ring neighbours) knows which peer each came from.

A path probe asks whether the direct path carries datagrams of `size` bytes (sent with the
don't-fragment bit): the peer answers with a small PathAck, so an answer is never larger than
what asked for it (kafila.net.link raises its QUIC packet size to the largest size acknowledged).
"""

from __future__ import annotations

import ipaddress
import struct
from dataclasses import dataclass
from enum import Enum, IntEnum

from kafila.proto.errors import ProtocolError

VERSION = 1
TXID_BYTES = 12
TOKEN_BYTES = 16
MAX_AUTH_BYTES = 1024
MAX_REASON_BYTES = 255
RELAY_HEADER_BYTES = 6  # type, version, channel:u32
MAX_CHANNEL = 0xFFFFFFFF
PATH_PROBE_MIN = 16  # type, version, txid, size: a probe has at least its own fields
PATH_PROBE_MAX = 65507  # the largest UDP payload over IPv4

FLAG_CHANGE_PORT = 0x01
FLAG_CHANGE_ADDRESS = 0x02
_KNOWN_FLAGS = FLAG_CHANGE_PORT | FLAG_CHANGE_ADDRESS

Address = tuple[str, int]


def url_host(host: str) -> str:
    """A host as a URL or HOST:PORT writes it: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def format_address(addr: Address) -> str:
    """HOST:PORT as URLs, logs and candidates write it: an IPv6 address in brackets."""
    return f"{url_host(addr[0])}:{addr[1]}"


def parse_address(text: str) -> Address:
    host, _, port = text.rpartition(":")
    return (host.strip("[]"), int(port))


class MsgType(IntEnum):
    BINDING_REQUEST = 0x01
    BINDING_RESPONSE = 0x02
    BINDING_ERROR = 0x03
    RELAY_BIND = 0x10
    RELAY_BIND_ACK = 0x11
    RELAY_BIND_ERROR = 0x12
    RELAY_DATA = 0x13
    PUNCH_PROBE = 0x20
    PUNCH_ACK = 0x21
    PATH_PROBE = 0x30
    PATH_ACK = 0x31


class DatagramKind(Enum):
    QUIC = "quic"
    BINDING = "binding"  # 0x00-0x0F
    RELAY = "relay"  # 0x10-0x1F
    PUNCH = "punch"  # 0x20-0x2F
    PATH = "path"  # 0x30-0x3F: path MTU probes
    UNKNOWN = "unknown"  # 0x80-0xBF: neither QUIC v1 nor ours; drop it


class ErrorCode(IntEnum):
    """Codes of BindingError and RelayBindError."""

    BAD_REQUEST = 1
    UNSUPPORTED = 2  # e.g. "reply from other address" on a one-address server
    UNKNOWN_CHANNEL = 3
    BAD_TOKEN = 4
    LEG_TAKEN = 5  # the leg is bound to another address
    LIMIT = 6
    EXPIRED = 7


def classify_datagram(first_byte: int) -> DatagramKind:
    """Which family a datagram belongs to, from its first byte alone."""
    if not 0 <= first_byte <= 0xFF:
        raise ProtocolError(f"first byte {first_byte} is not a byte")
    if first_byte & 0x40:
        return DatagramKind.QUIC
    if first_byte & 0x80:
        return DatagramKind.UNKNOWN  # 0x80-0xBF without 0x40: not QUIC v1 and not ours
    return (
        DatagramKind.BINDING,
        DatagramKind.RELAY,
        DatagramKind.PUNCH,
        DatagramKind.PATH,
    )[first_byte >> 4]


@dataclass(frozen=True, slots=True)
class BindingRequest:
    txid: bytes
    flags: int = 0

    @property
    def change_port(self) -> bool:
        return bool(self.flags & FLAG_CHANGE_PORT)

    @property
    def change_address(self) -> bool:
        return bool(self.flags & FLAG_CHANGE_ADDRESS)


@dataclass(frozen=True, slots=True)
class BindingResponse:
    txid: bytes
    flags: int  # the changes that were applied
    observed: Address  # the request's source address as the server saw it
    answered_from: Address  # the server address this response leaves from
    other: Address | None  # the server's alternate address+port (RFC 5780 OTHER-ADDRESS), if any


@dataclass(frozen=True, slots=True)
class BindingError:
    txid: bytes
    code: ErrorCode
    reason: str


@dataclass(frozen=True, slots=True)
class RelayBind:
    channel: int
    token: bytes


@dataclass(frozen=True, slots=True)
class RelayBindAck:
    channel: int
    peer_bound: bool
    observed: Address


@dataclass(frozen=True, slots=True)
class RelayBindError:
    channel: int
    code: ErrorCode
    reason: str


@dataclass(frozen=True, slots=True)
class RelayData:
    channel: int
    payload: bytes


@dataclass(frozen=True, slots=True)
class PunchProbe:
    txid: bytes
    auth: bytes = b""


@dataclass(frozen=True, slots=True)
class PunchAck:
    txid: bytes
    observed: Address  # the probe's source address as the acking member saw it
    auth: bytes = b""


@dataclass(frozen=True, slots=True)
class PathProbe:
    txid: bytes
    size: int  # bytes of the whole datagram, padding included


@dataclass(frozen=True, slots=True)
class PathAck:
    txid: bytes
    size: int  # bytes of the probe as it arrived


UdpMessage = (
    BindingRequest
    | BindingResponse
    | BindingError
    | RelayBind
    | RelayBindAck
    | RelayBindError
    | RelayData
    | PunchProbe
    | PunchAck
    | PathProbe
    | PathAck
)


# ---------------------------------------------------------------- encoding


def _head(kind: MsgType) -> bytes:
    return bytes((kind, VERSION))


def _txid(txid: bytes) -> bytes:
    if len(txid) != TXID_BYTES:
        raise ProtocolError(f"transaction id has {len(txid)} bytes, expected {TXID_BYTES}")
    return txid


def _channel(channel: int) -> bytes:
    if not 0 <= channel <= MAX_CHANNEL:
        raise ProtocolError(f"channel {channel} outside 0..{MAX_CHANNEL}")
    return struct.pack("!I", channel)


def encode_address(addr: Address) -> bytes:
    host, port = addr
    if not 0 <= port <= 0xFFFF:
        raise ProtocolError(f"port {port} outside 0..65535")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError as exc:
        raise ProtocolError(f"address {host!r} is not an IP address") from exc
    return struct.pack("!BH", ip.version, port) + ip.packed


def _reason(text: str) -> bytes:
    raw = text.encode("utf-8")[:MAX_REASON_BYTES]
    raw = raw.decode("utf-8", "ignore").encode("utf-8")  # never cut a character in half
    return bytes((len(raw),)) + raw


def _auth(auth: bytes) -> bytes:
    if len(auth) > MAX_AUTH_BYTES:
        raise ProtocolError(f"auth field has {len(auth)} bytes, at most {MAX_AUTH_BYTES}")
    return struct.pack("!H", len(auth)) + auth


def _probe_size(size: int) -> bytes:
    if not PATH_PROBE_MIN <= size <= PATH_PROBE_MAX:
        raise ProtocolError(f"path probe size {size} outside {PATH_PROBE_MIN}..{PATH_PROBE_MAX}")
    return struct.pack("!H", size)


def encode(msg: UdpMessage) -> bytes:
    """Bytes of one control message (raises ProtocolError on out-of-range fields)."""
    match msg:
        case BindingRequest(txid, flags):
            if flags & ~_KNOWN_FLAGS:
                raise ProtocolError(f"binding flags 0x{flags:02x} has unknown bits")
            return _head(MsgType.BINDING_REQUEST) + _txid(txid) + bytes((flags,))
        case BindingResponse(txid, flags, observed, answered_from, other):
            tail = encode_address(other) if other is not None else b"\x00"
            return (
                _head(MsgType.BINDING_RESPONSE)
                + _txid(txid)
                + bytes((flags & _KNOWN_FLAGS,))
                + encode_address(observed)
                + encode_address(answered_from)
                + tail
            )
        case BindingError(txid, code, reason):
            return _head(MsgType.BINDING_ERROR) + _txid(txid) + bytes((code,)) + _reason(reason)
        case RelayBind(channel, token):
            if len(token) != TOKEN_BYTES:
                raise ProtocolError(f"relay token has {len(token)} bytes, expected {TOKEN_BYTES}")
            return _head(MsgType.RELAY_BIND) + _channel(channel) + token
        case RelayBindAck(channel, peer_bound, observed):
            return (
                _head(MsgType.RELAY_BIND_ACK)
                + _channel(channel)
                + bytes((int(peer_bound),))
                + encode_address(observed)
            )
        case RelayBindError(channel, code, reason):
            return _head(MsgType.RELAY_BIND_ERROR) + _channel(channel) + bytes((code,)) + _reason(reason)
        case RelayData(channel, payload):
            return relay_header(channel) + payload
        case PunchProbe(txid, auth):
            return _head(MsgType.PUNCH_PROBE) + _txid(txid) + _auth(auth)
        case PunchAck(txid, observed, auth):
            return _head(MsgType.PUNCH_ACK) + _txid(txid) + encode_address(observed) + _auth(auth)
        case PathProbe(txid, size):
            fields = _head(MsgType.PATH_PROBE) + _txid(txid) + _probe_size(size)
            return fields + bytes(size - len(fields))
        case PathAck(txid, size):
            return _head(MsgType.PATH_ACK) + _txid(txid) + _probe_size(size)
    raise ProtocolError(f"cannot encode {type(msg).__name__}")


def relay_header(channel: int) -> bytes:
    """The 6 bytes put in front of a datagram sent over a relay channel."""
    return _head(MsgType.RELAY_DATA) + _channel(channel)


# ---------------------------------------------------------------- decoding


class _Reader:
    def __init__(self, data: bytes, what: str) -> None:
        self.data = data
        self.pos = 0
        self.what = what

    def take(self, n: int) -> bytes:
        end = self.pos + n
        if end > len(self.data):
            raise ProtocolError(f"{self.what}: truncated at byte {self.pos} (needs {n} more)")
        out = self.data[self.pos : end]
        self.pos = end
        return out

    def u8(self) -> int:
        return self.take(1)[0]

    def u16(self) -> int:
        return int(struct.unpack("!H", self.take(2))[0])

    def u32(self) -> int:
        return int(struct.unpack("!I", self.take(4))[0])

    def address(self) -> Address:
        family = self.u8()
        if family not in (4, 6):
            raise ProtocolError(f"{self.what}: address family {family} (expected 4 or 6)")
        port = self.u16()
        raw = self.take(4 if family == 4 else 16)
        return (str(ipaddress.ip_address(raw)), port)

    def optional_address(self) -> Address | None:
        if self.pos < len(self.data) and self.data[self.pos] == 0:
            self.pos += 1
            return None
        return self.address()

    def reason(self) -> str:
        raw = self.take(self.u8())
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ProtocolError(f"{self.what}: reason is not UTF-8") from exc

    def error_code(self) -> ErrorCode:
        value = self.u8()
        try:
            return ErrorCode(value)
        except ValueError as exc:
            raise ProtocolError(f"{self.what}: unknown error code {value}") from exc

    def end(self) -> None:
        if self.pos != len(self.data):
            raise ProtocolError(f"{self.what}: {len(self.data) - self.pos} unexpected trailing bytes")


def decode(data: bytes) -> UdpMessage:
    """Parse one control datagram; ProtocolError names what is wrong. QUIC is not accepted here."""
    if len(data) < 2:
        raise ProtocolError(f"datagram of {len(data)} bytes is too short for a control message")
    if classify_datagram(data[0]) in (DatagramKind.QUIC, DatagramKind.UNKNOWN):
        raise ProtocolError(f"first byte 0x{data[0]:02x} is not a control message (QUIC or unknown)")
    try:
        kind = MsgType(data[0])
    except ValueError as exc:
        raise ProtocolError(f"unknown control message type 0x{data[0]:02x}") from exc
    if data[1] != VERSION:
        raise ProtocolError(
            f"{kind.name}: version {data[1]} not supported (this side speaks {VERSION})",
            code="unsupported_version",
        )
    r = _Reader(data, kind.name)
    r.pos = 2
    msg = _DECODERS[kind](r)
    r.end()
    return msg


def _flags(r: _Reader) -> int:
    flags = r.u8()
    if flags & ~_KNOWN_FLAGS:
        raise ProtocolError(f"{r.what}: flags 0x{flags:02x} has unknown bits")
    return flags


def _dec_binding_request(r: _Reader) -> UdpMessage:
    return BindingRequest(r.take(TXID_BYTES), _flags(r))


def _dec_binding_response(r: _Reader) -> UdpMessage:
    return BindingResponse(r.take(TXID_BYTES), _flags(r), r.address(), r.address(), r.optional_address())


def _dec_binding_error(r: _Reader) -> UdpMessage:
    return BindingError(r.take(TXID_BYTES), r.error_code(), r.reason())


def _dec_relay_bind(r: _Reader) -> UdpMessage:
    return RelayBind(r.u32(), r.take(TOKEN_BYTES))


def _dec_relay_bind_ack(r: _Reader) -> UdpMessage:
    channel = r.u32()
    bound = r.u8()
    if bound > 1:
        raise ProtocolError(f"{r.what}: peer_bound {bound} is not 0 or 1")
    return RelayBindAck(channel, bool(bound), r.address())


def _dec_relay_bind_error(r: _Reader) -> UdpMessage:
    return RelayBindError(r.u32(), r.error_code(), r.reason())


def _dec_relay_data(r: _Reader) -> UdpMessage:
    channel = r.u32()
    return RelayData(channel, r.take(len(r.data) - r.pos))


def _dec_auth(r: _Reader) -> bytes:
    n = r.u16()
    if n > MAX_AUTH_BYTES:
        raise ProtocolError(f"{r.what}: auth field of {n} bytes, at most {MAX_AUTH_BYTES}")
    return r.take(n)


def _dec_punch_probe(r: _Reader) -> UdpMessage:
    return PunchProbe(r.take(TXID_BYTES), _dec_auth(r))


def _dec_punch_ack(r: _Reader) -> UdpMessage:
    return PunchAck(r.take(TXID_BYTES), r.address(), _dec_auth(r))


def _dec_probe_size(r: _Reader) -> int:
    size = r.u16()
    if not PATH_PROBE_MIN <= size <= PATH_PROBE_MAX:
        raise ProtocolError(f"{r.what}: size {size} outside {PATH_PROBE_MIN}..{PATH_PROBE_MAX}")
    return size


def _dec_path_probe(r: _Reader) -> UdpMessage:
    txid, size = r.take(TXID_BYTES), _dec_probe_size(r)
    if size != len(r.data):
        raise ProtocolError(f"{r.what}: says {size} bytes, {len(r.data)} arrived")
    if any(r.take(size - r.pos)):
        raise ProtocolError(f"{r.what}: padding is not zero")
    return PathProbe(txid, size)


def _dec_path_ack(r: _Reader) -> UdpMessage:
    return PathAck(r.take(TXID_BYTES), _dec_probe_size(r))


_DECODERS = {
    MsgType.BINDING_REQUEST: _dec_binding_request,
    MsgType.BINDING_RESPONSE: _dec_binding_response,
    MsgType.BINDING_ERROR: _dec_binding_error,
    MsgType.RELAY_BIND: _dec_relay_bind,
    MsgType.RELAY_BIND_ACK: _dec_relay_bind_ack,
    MsgType.RELAY_BIND_ERROR: _dec_relay_bind_error,
    MsgType.RELAY_DATA: _dec_relay_data,
    MsgType.PUNCH_PROBE: _dec_punch_probe,
    MsgType.PUNCH_ACK: _dec_punch_ack,
    MsgType.PATH_PROBE: _dec_path_probe,
    MsgType.PATH_ACK: _dec_path_ack,
}


def relay_channel(data: bytes) -> int | None:
    """The channel of a RelayData datagram without copying its payload (None if it is not one)."""
    if len(data) < RELAY_HEADER_BYTES or data[0] != MsgType.RELAY_DATA or data[1] != VERSION:
        return None
    return int.from_bytes(data[2:6], "big")
