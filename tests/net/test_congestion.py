"""The loss-tolerant congestion controller: a lossy path's random loss leaves the window as it is,
a queue's (a grown round trip) or loss above 2% halves it as Reno does."""

from __future__ import annotations

import dataclasses

import pytest
from aioquic.quic.congestion.base import create_congestion_control
from aioquic.quic.packet import QuicPacketType
from aioquic.quic.packet_builder import QuicSentPacket

from kafila.net.congestion import NAME, LeastRtt, LossTolerantReno, random_loss
from kafila.net.link import LinkConfig
from tests.net.simulated_edge import Edge, Setup, connect

MSS = 1452


def packet(number: int, sent_at: float) -> QuicSentPacket:
    return QuicSentPacket(
        epoch=3,
        in_flight=True,
        is_ack_eliciting=True,
        is_crypto_packet=False,
        packet_number=number,
        packet_type=QuicPacketType.ONE_RTT,
        sent_time=sent_at,
        sent_bytes=MSS,
    )


def grown(cc: LossTolerantReno, packets: int, rtt: float) -> float:
    """Send and acknowledge `packets` packets at round trip `rtt`; the time after."""
    now = 1.0
    for n in range(packets):
        sent = packet(n, now)
        cc.on_packet_sent(packet=sent)
        now += 0.001
        cc.on_rtt_measurement(now=now, rtt=rtt)
        cc.on_packet_acked(now=now, packet=sent)
    return now


def test_the_rule_tolerates_loss_below_two_percent_with_no_queue() -> None:
    assert random_loss(lost=1, sent=1000, rtt=0.042, least_rtt=0.040)
    assert random_loss(lost=20, sent=1000, rtt=0.069, least_rtt=0.040)  # 1.25x and 20 ms of jitter
    assert random_loss(lost=2, sent=10, rtt=0.040, least_rtt=0.040)  # early: 2% of at least 100
    assert not random_loss(lost=21, sent=1000, rtt=0.040, least_rtt=0.040)  # over 2%
    assert not random_loss(lost=1, sent=1000, rtt=0.071, least_rtt=0.040)  # a queue: past 1.25x + 20 ms
    assert not random_loss(lost=1, sent=1000, rtt=float("inf"), least_rtt=float("inf"))  # no sample yet


def test_a_lossy_path_keeps_its_window_and_a_queue_halves_it() -> None:
    cc = create_congestion_control(NAME, max_datagram_size=MSS)
    assert isinstance(cc, LossTolerantReno)
    now = grown(cc, 300, rtt=0.040)
    window = cc.congestion_window
    lost = packet(1000, now)
    cc.on_packet_sent(packet=lost)
    cc.on_packets_lost(now=now + 0.05, packets=[lost])
    assert cc.congestion_window == window and cc.tolerated == 1
    assert cc.bytes_in_flight == 0  # the lost packet left the flight

    cc.on_rtt_measurement(now=now + 0.06, rtt=0.080)  # the round trip doubled: a queue
    queued = packet(1001, now + 0.06)
    cc.on_packet_sent(packet=queued)
    cc.on_packets_lost(now=now + 0.1, packets=[queued])
    assert cc.congestion_window == window // 2 and cc.tolerated == 1


def test_loss_above_two_percent_is_congestion_whatever_the_round_trip() -> None:
    cc = create_congestion_control(NAME, max_datagram_size=MSS)
    now = grown(cc, 200, rtt=0.040)
    window = cc.congestion_window
    burst = [packet(1000 + n, now) for n in range(5)]  # 5 of 205 recent packets: 2.4%
    for p in burst:
        cc.on_packet_sent(packet=p)
    cc.on_packets_lost(now=now + 0.05, packets=burst)
    assert cc.congestion_window == window // 2 and cc.tolerated == 0


def test_the_least_round_trip_is_the_last_ten_to_twenty_seconds_and_never_one_fresh_sample() -> None:
    least = LeastRtt(window=10.0)
    assert least.value == float("inf")
    least.sample(0.0, 0.001)  # formed on a path with no delay
    least.sample(9.0, 0.040)  # then the path's delay grew
    assert least.value == 0.001
    least.sample(12.0, 0.042)  # a new window: the one before still counts
    assert least.value == 0.001
    least.sample(22.0, 0.045)  # two windows on: the old path's round trip is gone
    assert least.value == 0.042
    least.sample(55.0, 0.050)  # after a silence past both windows, only what came since
    assert least.value == 0.050
    least.reset()  # a new path
    assert least.value == float("inf")
    least.sample(56.0, 0.090)
    assert least.value == 0.090


def test_a_path_whose_delay_grew_for_good_tolerates_random_loss_again_within_two_windows() -> None:
    cc = create_congestion_control(NAME, max_datagram_size=MSS)
    assert isinstance(cc, LossTolerantReno)
    grown(cc, 300, rtt=0.001)  # formed at 1 ms (aioquic's least sample)
    now = 30.0
    for _ in range(300):  # 20 ms one way from now on, for longer than two windows
        now += 0.1
        cc.on_rtt_measurement(now=now, rtt=0.040)
    window = cc.congestion_window
    lost = packet(5000, now)
    cc.on_packet_sent(packet=lost)
    cc.on_packets_lost(now=now + 0.05, packets=[lost])
    assert cc.congestion_window == window and cc.tolerated == 1


LOSSY = Setup(
    loss=0.01, delay=0.020, jitter=0.0, mss=1452, cc=NAME, copy_flight=LinkConfig().copy_flight,
    steps=24, step_bytes=2330, circuit=0.110, hold=0.010, prefill_bytes=350_000,
)  # fmt: skip


def formed_without_delay(lossy: Setup, seed: int) -> Edge:
    """A simulated edge in the WAN lab's order: the session forms on unshaped links (a round trip
    of 0.2 ms) and serves a request, then every edge gets `lossy`'s delay and loss."""
    edge = connect(dataclasses.replace(lossy, delay=0.0001, loss=0.0), seed)
    edge.decode(lossy.steps)
    edge.send(lossy.prefill_bytes)
    edge.run_until(edge.now + 20.0)  # the lab shapes its edges between requests
    edge.setup = lossy
    return edge


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_simulated_edge_formed_without_delay_carries_each_prefill_at_20_ms_and_1_percent_loss_in_time(
    seed: int,
) -> None:
    """Each 350 kB prefill after the change takes 0.06-0.11 s (no loss: 0.024 s); with the least
    round trip of the whole connection, the grown one read as a queue, every loss halved the window
    and the third prefill took 0.23-0.58 s."""
    edge = formed_without_delay(LOSSY, seed)
    prefills = []
    for _ in range(3):
        edge.decode(LOSSY.steps)
        prefills.append(edge.send(LOSSY.prefill_bytes))
    assert max(prefills) < 0.15, f"prefills took {[round(p, 3) for p in prefills]} s"


@pytest.mark.parametrize("seed", [1, 3])
def test_a_simulated_edge_formed_without_delay_waits_for_a_lost_last_packet_a_probe_timeout_of_the_path_now(
    seed: int,
) -> None:
    """Without copies a decode step whose last packet is lost waits for QUIC's probe timeout
    (srtt + 4 x RTT variance + 25 ms). After the change that is 0.066 s at 20 ms one way; with
    aioquic's least round trip of the connection's life (1 ms) its variance became the 39 ms the path
    grew by, the timeout 0.22 s, and such a step took 0.24 s."""
    edge = formed_without_delay(dataclasses.replace(LOSSY, copy_flight=0), seed)
    steps = edge.decode(200)
    assert edge.client._loss.get_probe_timeout() < 0.08
    assert max(steps) < 0.2, f"the slowest step took {max(steps):.3f} s"
