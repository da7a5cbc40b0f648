"""Every function of kafila.net.quic_private on a real aioquic connection pair, in memory.

These touch each private attribute the link relies on, so an aioquic upgrade that renames or
reshapes one fails here, by name, rather than on a path change in the field.
"""

from __future__ import annotations

import ssl

import pytest
from aioquic.buffer import Buffer
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import pull_quic_header

from kafila.net import quic_private
from kafila.net.certs import Identity, make_identity
from kafila.net.congestion import LeastRtt

PEER = ("virtual-peer", 1)
ONE_WAY = 0.010  # seconds each datagram takes between the two in-memory ends


class Pair:
    """A client and a server connection that hand datagrams to each other, with a clock."""

    def __init__(self, identity: Identity) -> None:
        client_cfg = QuicConfiguration(is_client=True, alpn_protocols=["t"], verify_mode=ssl.CERT_NONE)
        server_cfg = QuicConfiguration(is_client=False, alpn_protocols=["t"])
        server_cfg.certificate, server_cfg.private_key = identity.certificate, identity.private_key
        self.client = QuicConnection(configuration=client_cfg)
        self.server: QuicConnection | None = None
        self.server_cfg = server_cfg
        self.now = 0.0
        self.client.connect(PEER, now=self.now)

    def deliver(self, src: QuicConnection, dst_is_server: bool) -> list[bytes]:
        """Send what `src` has, one way later; returns the datagrams (delivered)."""
        sent = [data for data, _ in src.datagrams_to_send(now=self.now)]
        if sent:
            self.now += ONE_WAY
        for data in sent:
            if dst_is_server:
                if self.server is None:  # the client's first Initial makes it, as a link does
                    dcid = pull_quic_header(Buffer(data=data), host_cid_length=8).destination_cid
                    self.server = QuicConnection(
                        configuration=self.server_cfg, original_destination_connection_id=dcid
                    )
                self.server.receive_datagram(data, PEER, now=self.now)
            else:
                self.client.receive_datagram(data, PEER, now=self.now)
        return sent

    def quiesce(self) -> None:
        """Let every timer (delayed ACKs, pacing) run out and every datagram arrive."""
        for _ in range(5):
            self.now += 1.0
            for conn in (self.client, self.server):
                assert conn is not None
                conn.handle_timer(now=self.now)
            self.settle()

    def settle(self) -> None:
        for _ in range(20):
            moved = self.deliver(self.client, True)
            assert self.server is not None
            if not (self.deliver(self.server, False) or moved):
                return


@pytest.fixture(scope="module")
def identity() -> Identity:
    return make_identity("quic-private-test")


@pytest.fixture
def pair(identity: Identity) -> Pair:
    p = Pair(identity)
    p.settle()
    assert p.server is not None
    return p


def test_the_installed_aioquic_is_the_one_this_module_knows() -> None:
    quic_private.check_version(quic_private.AIOQUIC_VERSION)
    with pytest.raises(ImportError, match=r"aioquic 1\.7\.2, found 9\.9\.9"):
        quic_private.check_version("9.9.9")


def test_smoothed_rtt_follows_the_round_trip(pair: Pair) -> None:
    assert quic_private.smoothed_rtt(pair.client) == pytest.approx(2 * ONE_WAY, rel=0.5)


def test_peer_certificate_is_the_servers(pair: Pair, identity: Identity) -> None:
    assert quic_private.peer_certificate(pair.client) == identity.certificate


def test_unacked_stream_bytes_until_the_peer_acknowledges(pair: Pair) -> None:
    assert quic_private.unacked_stream_bytes(pair.client, 0) == 0  # no such stream yet
    pair.client.send_stream_data(0, b"x" * 5000)
    assert quic_private.unacked_stream_bytes(pair.client, 0) == 5000
    pair.quiesce()
    assert quic_private.unacked_stream_bytes(pair.client, 0) == 0


def test_stream_offsets_and_each_ack_with_the_delay_the_peer_held_it(pair: Pair) -> None:
    assert pair.server is not None
    acks: list[tuple[float, float, int]] = []  # (now, ack delay, stream bytes acked by then)
    quic_private.on_ack(
        pair.client, lambda now, delay: acks.append((now, delay, quic_private.stream_acked(pair.client, 0)))
    )
    assert (quic_private.stream_written(pair.client, 0), quic_private.stream_acked(pair.client, 0)) == (0, 0)
    pair.client.send_stream_data(0, b"w" * 300)
    assert (quic_private.stream_written(pair.client, 0), quic_private.stream_acked(pair.client, 0)) == (
        300,
        0,
    )
    pair.deliver(pair.client, True)
    received = pair.now
    pair.now += 0.004  # the server holds its ACK 4 ms
    assert quic_private.send_waiting_ack_now(pair.server, pair.now)
    pair.deliver(pair.server, False)
    assert acks == [(pytest.approx(pair.now), pytest.approx(0.004, abs=1e-5), 300)]
    assert pair.now == pytest.approx(received + 0.004 + ONE_WAY)


def test_ack_delay_and_sending_a_waiting_ack_now(pair: Pair) -> None:
    assert pair.server is not None
    quic_private.set_ack_delay(pair.server, 10.0)  # capped at what aioquic advertises
    pair.client.send_stream_data(0, b"y" * 100)
    pair.deliver(pair.client, True)
    assert quic_private.ack_waiting(pair.server)
    assert pair.server.get_timer() == pytest.approx(pair.now + quic_private.MAX_ACK_DELAY)
    assert quic_private.send_waiting_ack_now(pair.server, pair.now)
    assert pair.deliver(pair.server, False)  # the ACK leaves at once
    assert not quic_private.ack_waiting(pair.server)
    assert not quic_private.send_waiting_ack_now(pair.server, pair.now)


def test_datagram_size_grows_the_packets(pair: Pair) -> None:
    pair.client.send_stream_data(0, b"z" * 20000)
    assert max(len(d) for d, _ in pair.client.datagrams_to_send(now=pair.now)) <= 1200
    pair.quiesce()
    quic_private.set_datagram_size(pair.client, 1452)
    pair.client.send_stream_data(0, b"z" * 20000)
    assert max(len(d) for d, _ in pair.client.datagrams_to_send(now=pair.now)) == 1452


def test_declaring_in_flight_lost_queues_the_data_again_at_once(pair: Pair) -> None:
    pair.client.send_stream_data(0, b"w" * 3000)
    first = pair.client.datagrams_to_send(now=pair.now)  # sent into a dead path: never delivered
    assert first and pair.client.datagrams_to_send(now=pair.now) == []
    assert quic_private.declare_in_flight_lost(pair.client, pair.now, 1200) >= len(first)
    # resent within a few ms of pacing, where loss recovery would wait for its probe timer
    again = [d for ms in range(20) for d in pair.client.datagrams_to_send(now=pair.now + ms / 1000)]
    assert sum(len(d) for d, _ in again) >= 3000
    assert (pair.client.get_timer() or 0) - pair.now > 0.020  # the probe timer: not what resent it
    for data, _ in again:
        assert pair.server is not None
        pair.server.receive_datagram(data, PEER, now=pair.now + ONE_WAY)
    assert pair.server is not None
    received = b""
    while (event := pair.server.next_event()) is not None:
        received += getattr(event, "data", b"")
    assert received == b"w" * 3000


def test_pending_close_reports_the_peers_close_before_draining(pair: Pair) -> None:
    assert quic_private.pending_close(pair.client) is None
    assert pair.server is not None
    pair.server.close(error_code=0x1E, reason_phrase="ended")
    pair.deliver(pair.server, False)
    close = quic_private.pending_close(pair.client)
    assert close is not None and close.error_code == 0x1E and close.reason_phrase == "ended"


def test_the_least_round_trip_aioquic_uses_is_the_windowed_one(pair: Pair) -> None:
    assert pair.server is not None
    least = LeastRtt(window=1.0)
    least.sample(pair.now, 0.001)  # a round trip the path no longer has
    quic_private.window_min_rtt(pair.client, least)
    pair.now += 5.0  # both windows of the old sample are over
    pair.client.send_stream_data(0, b"v" * 100)
    pair.deliver(pair.client, True)
    assert quic_private.send_waiting_ack_now(pair.server, pair.now)
    pair.deliver(pair.server, False)
    assert least.value == pytest.approx(2 * ONE_WAY)
    assert pair.client._loss._rtt_min == least.value  # the variance and the ACK delay's check use it
