"""UDP control messages: round trips, the first-byte rule shared with QUIC, and fuzzing."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.proto import udp
from kafila.proto.errors import ProtocolError
from kafila.proto.udp import DatagramKind, ErrorCode

TXID = bytes(range(12))
V4 = ("203.0.113.7", 40000)
V6 = ("2001:db8::1", 3478)

MESSAGES = [
    udp.BindingRequest(TXID),
    udp.BindingRequest(TXID, udp.FLAG_CHANGE_PORT | udp.FLAG_CHANGE_ADDRESS),
    udp.BindingResponse(TXID, udp.FLAG_CHANGE_PORT, V4, ("198.51.100.1", 3479), ("198.51.100.2", 3478)),
    udp.BindingResponse(TXID, 0, V6, V6, None),
    udp.BindingError(TXID, ErrorCode.UNSUPPORTED, "one address only"),
    udp.RelayBind(7, b"\xaa" * 16),
    udp.RelayBindAck(7, True, V4),
    udp.RelayBindError(7, ErrorCode.BAD_TOKEN, "token does not match"),
    udp.RelayData(0xFFFFFFFF, b"\xc3quic-packet"),
    udp.RelayData(1, b""),
    udp.PunchProbe(TXID, b"mac" * 10),
    udp.PunchAck(TXID, V4, b""),
    udp.PathProbe(TXID, udp.PATH_PROBE_MIN),
    udp.PathProbe(TXID, 1452),
    udp.PathAck(TXID, 16000),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_round_trip(msg: udp.UdpMessage) -> None:
    data = udp.encode(msg)
    assert data[0] < 0x40 and data[1] == udp.VERSION
    assert udp.classify_datagram(data[0]) is not DatagramKind.QUIC
    assert udp.decode(data) == msg


def test_relay_data_keeps_the_datagram_unchanged_behind_a_six_byte_header() -> None:
    quic = bytes([0xC3]) + bytes(range(200))
    data = udp.encode(udp.RelayData(42, quic))
    assert data[: udp.RELAY_HEADER_BYTES] == udp.relay_header(42)
    assert data[udp.RELAY_HEADER_BYTES :] == quic
    assert udp.relay_channel(data) == 42
    assert udp.relay_channel(quic) is None


def test_a_path_probe_is_exactly_its_size_and_a_cut_one_is_refused() -> None:
    data = udp.encode(udp.PathProbe(TXID, 1452))
    assert len(data) == 1452 and len(udp.encode(udp.PathAck(TXID, 1452))) < 20  # the answer is small
    with pytest.raises(ProtocolError, match="says 1452 bytes, 1400 arrived"):
        udp.decode(data[:1400])
    with pytest.raises(ProtocolError, match="padding is not zero"):
        udp.decode(data[:-1] + b"\x01")
    with pytest.raises(ProtocolError, match="size 3 outside"):
        udp.decode(udp.encode(udp.PathAck(TXID, 16))[:-2] + b"\x00\x03")
    for size in (udp.PATH_PROBE_MIN - 1, udp.PATH_PROBE_MAX + 1):
        with pytest.raises(ProtocolError, match=f"path probe size {size} outside"):
            udp.encode(udp.PathProbe(TXID, size))


def test_classify_first_byte() -> None:
    assert udp.classify_datagram(0xC0) is DatagramKind.QUIC  # long header
    assert udp.classify_datagram(0x41) is DatagramKind.QUIC  # short header
    assert udp.classify_datagram(0x01) is DatagramKind.BINDING
    assert udp.classify_datagram(0x13) is DatagramKind.RELAY
    assert udp.classify_datagram(0x20) is DatagramKind.PUNCH
    assert udp.classify_datagram(0x3F) is DatagramKind.PATH
    assert udp.classify_datagram(0x80) is DatagramKind.UNKNOWN
    with pytest.raises(ProtocolError):
        udp.classify_datagram(256)


def test_every_defined_type_is_below_0x40() -> None:
    assert all(t < 0x40 for t in udp.MsgType)


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (b"", "too short"),
        (b"\x01", "too short"),
        (b"\xc0\x00\x00\x00\x01", "not a control message"),
        (b"\x05\x01", "unknown control message type 0x05"),
        (b"\x01\x02" + TXID + b"\x00", "version 2 not supported"),
        (b"\x01\x01" + TXID[:5], "truncated"),
        (b"\x01\x01" + TXID + b"\x00extra", "trailing bytes"),
        (b"\x01\x01" + TXID + b"\x08", "unknown bits"),
        (b"\x02\x01" + TXID + b"\x00\x05\x00\x01", "address family 5"),
        (b"\x03\x01" + TXID + b"\x63\x00", "unknown error code 99"),
        (b"\x03\x01" + TXID + b"\x01\x02\xff\xfe", "not UTF-8"),
        (b"\x20\x01" + TXID + b"\x08\x00" + b"x" * 2048, "auth field of 2048 bytes"),
    ],
)
def test_bad_datagrams_name_the_problem(data: bytes, words: str) -> None:
    with pytest.raises(ProtocolError, match=words):
        udp.decode(data)


def test_encode_rejects_out_of_range_fields() -> None:
    with pytest.raises(ProtocolError, match="transaction id has 3 bytes"):
        udp.encode(udp.BindingRequest(b"abc"))
    with pytest.raises(ProtocolError, match="token has 4 bytes"):
        udp.encode(udp.RelayBind(1, b"abcd"))
    with pytest.raises(ProtocolError, match="not an IP address"):
        udp.encode(udp.PunchAck(TXID, ("example.com", 1)))
    with pytest.raises(ProtocolError, match="channel -1"):
        udp.encode(udp.RelayData(-1, b""))


@settings(deadline=None)
@given(st.binary(max_size=300))
def test_fuzz_decode_is_defined_and_canonical(data: bytes) -> None:
    """Every input either raises ProtocolError or decodes to a message that encodes back to it."""
    try:
        msg = udp.decode(data)
    except ProtocolError:
        return
    assert udp.encode(msg) == data


@settings(deadline=None)
@given(st.integers(0, 0x3F), st.integers(0, 3), st.binary(max_size=80))
def test_fuzz_control_prefixes(kind: int, version: int, body: bytes) -> None:
    data = bytes((kind, version)) + body
    try:
        msg = udp.decode(data)
    except ProtocolError as exc:
        assert str(exc)
        return
    assert udp.encode(msg) == data
