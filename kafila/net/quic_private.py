"""Every private aioquic attribute a link touches, in one place, for the one aioquic version it knows.

aioquic's public API has no way to change a connection's packet size after it is made, to move
the packets in flight on a dead path to a new one at once, to send a waiting ACK now, or to read
its RTT estimate and unacknowledged stream bytes, or to learn of each ACK the peer sent and the
delay it says it held it, or to let its least round trip go when the path's delay grew. A link
needs all of them (kafila.net.link), so it
reaches into the connection here and only here. Importing this module checks the installed aioquic
against `AIOQUIC_VERSION`, and tests/net/test_quic_private.py drives every function below on a
real connection pair, so an upgrade fails loudly in one place instead of misbehaving on a path
change in the field.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import version

from aioquic import tls
from aioquic.quic import events
from aioquic.quic.congestion.base import create_congestion_control
from aioquic.quic.connection import QuicConnection
from aioquic.quic.rangeset import RangeSet
from aioquic.quic.recovery import QuicPacketSpace
from cryptography import x509

from kafila.net.congestion import LeastRtt

AIOQUIC_VERSION = "1.7.2"  # the version whose internals this module was written against (pyproject pin)
MAX_ACK_DELAY = 0.025  # the max_ack_delay aioquic 1.7 advertises: no ACK may wait longer


def check_version(installed: str) -> None:
    """Refuse an aioquic whose internals this module was not checked against."""
    if installed != AIOQUIC_VERSION:
        raise ImportError(
            f"kafila.net.quic_private was written for aioquic {AIOQUIC_VERSION}, found {installed}: "
            "re-check every attribute it uses (tests/net/test_quic_private.py) and update the pin"
        )


check_version(version("aioquic"))


def set_ack_delay(conn: QuicConnection, seconds: float) -> None:
    """How long the ACK of a lone packet may wait; never past what aioquic advertises to the peer."""
    conn._ack_delay = min(seconds, MAX_ACK_DELAY)


def smoothed_rtt(conn: QuicConnection) -> float:
    """QUIC's smoothed round-trip estimate in seconds (0 before the first sample)."""
    return float(conn._loss._rtt_smoothed)


def set_datagram_size(conn: QuicConnection, size: int) -> None:
    """Build packets of up to `size` bytes from now on. aioquic fixes the size when the connection
    is made; the connection, its congestion controller and its pacer each keep a copy."""
    conn._max_datagram_size = size
    conn._loss._cc._max_datagram_size = size  # type: ignore[attr-defined]  # each controller's own
    conn._loss._pacer._max_datagram_size = size


def declare_in_flight_lost(conn: QuicConnection, now: float, datagram_size: int) -> int:
    """Treat every packet in flight as lost now, so its data is queued again at once, and start a
    new congestion controller (a new path's window, RFC 9000 9.4). Returns how many packets."""
    loss, count = conn._loss, 0
    for space in loss.spaces:
        if space.sent_packets:
            lost = list(space.sent_packets.values())
            count += len(lost)
            loss._on_packets_lost(congestion_event=False, now=now, packets=lost, space=space)
    loss._pto_count = 0
    algorithm = conn._configuration.congestion_control_algorithm
    loss._cc = create_congestion_control(algorithm, max_datagram_size=datagram_size)
    return count


def pending_close(conn: QuicConnection) -> events.ConnectionTerminated | None:
    """The peer's close, which aioquic reports as an event only after draining (3 PTOs)."""
    return conn._close_event


def peer_certificate(conn: QuicConnection) -> x509.Certificate | None:
    """The certificate the peer's TLS actually presented (None before the handshake)."""
    return conn.tls._peer_certificate


def _ack_space(conn: QuicConnection) -> QuicPacketSpace | None:
    """The application packet space, whose `ack_at` says when the waiting ACK is due (None until
    1-RTT keys exist)."""
    return conn._spaces.get(tls.Epoch.ONE_RTT)


def ack_waiting(conn: QuicConnection) -> bool:
    """Whether an ACK of application data waits for its delay to run out."""
    space = _ack_space(conn)
    return space is not None and space.ack_at is not None


def send_waiting_ack_now(conn: QuicConnection, now: float) -> bool:
    """Make a delayed ACK due now; True when one was waiting (the caller then transmits)."""
    space = _ack_space(conn)
    if space is None or space.ack_at is None:
        return False
    space.ack_at = now
    return True


def unacked_stream_bytes(conn: QuicConnection, stream_id: int) -> int:
    """Bytes written to a stream that the peer has not acknowledged yet (0 for no such stream)."""
    stream = conn._streams.get(stream_id)
    if stream is None:
        return 0
    sender = stream.sender
    return int(sender._buffer_stop - sender._buffer_start)


def stream_written(conn: QuicConnection, stream_id: int) -> int:
    """Bytes written to a stream so far: the stream offset after its last byte (0 for no such stream)."""
    stream = conn._streams.get(stream_id)
    return 0 if stream is None else int(stream.sender._buffer_stop)


def stream_acked(conn: QuicConnection, stream_id: int) -> int:
    """Bytes of a stream the peer acknowledged from its start on, with no gap (0 for no such stream)."""
    stream = conn._streams.get(stream_id)
    return 0 if stream is None else int(stream.sender._buffer_start)


def on_ack(conn: QuicConnection, callback: Callable[[float, float], None]) -> None:
    """Call `callback(now, ack_delay)` after each ACK frame from the peer was applied (the acked
    stream bytes counted already): `now` the time it was received at (the `now` the connection was
    given), `ack_delay` the seconds the peer says it held that ACK after its largest packet came."""
    loss = conn._loss
    received = loss.on_ack_received

    def watched(*, ack_rangeset: RangeSet, ack_delay: float, now: float, space: QuicPacketSpace) -> None:
        received(ack_rangeset=ack_rangeset, ack_delay=ack_delay, now=now, space=space)
        callback(now, ack_delay)

    loss.on_ack_received = watched  # type: ignore[method-assign]


def window_min_rtt(conn: QuicConnection, least: LeastRtt) -> None:
    """Let aioquic's least round trip be `least`'s (the last 10-20 s) instead of the connection's
    whole life. aioquic takes the RTT variance as the mean distance of each sample from that least
    (RFC 9002 5.3 takes it from the smoothed RTT), so on a path whose delay grew after the least was
    measured (a session formed before the WAN lab shaped its links, a route change) the variance
    becomes the growth and the probe timeout srtt + 4 x variance + max_ack_delay: 0.22 s at 20 ms one
    way after forming at 0.1 ms, against 0.066 s (benchmarks/quic_loss.py --formed-ms 0.1, no copies).
    RFC 9002 5.2 lets an endpoint re-establish min_rtt. Each ACK whose largest packet is newly acked
    and ack-eliciting is a sample, as in aioquic."""
    loss = conn._loss
    received = loss.on_ack_received

    def windowed(*, ack_rangeset: RangeSet, ack_delay: float, now: float, space: QuicPacketSpace) -> None:
        largest = space.sent_packets.get(ack_rangeset.bounds().stop - 1)
        if largest is not None and largest.is_ack_eliciting and largest.sent_time is not None:
            least.sample(now, max(now - largest.sent_time, 0.001))  # aioquic's floor, 1 ms
        loss._rtt_min = least.value
        received(ack_rangeset=ack_rangeset, ack_delay=ack_delay, now=now, space=space)

    loss.on_ack_received = windowed  # type: ignore[method-assign]
