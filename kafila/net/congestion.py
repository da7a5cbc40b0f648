"""A congestion controller that tells a home link's random loss from a queue's (aioquic's "kafila").

Reno (aioquic's default) halves its window at every loss. On a path that drops 1% of its packets
whatever the load (Wi-Fi, a long cable line), that holds the throughput near
MSS / RTT x 1.22 / sqrt(loss): about 420 kB/s at a 42 ms round trip, so a ring edge carries a
prompt's 390 kB prefill in 0.7 s against 22 ms with no loss, and the first token waits for that on
every edge (benchmarks/quic_loss.py --rounds). BBRv2 meets this by tolerating loss below 2%; this
controller does that on top of Reno: a loss is a congestion event when the path's round trip has
grown (a queue: the latest sample over `QUEUE_RTT` times the least seen plus `QUEUE_SLACK_S`, the
ends' own varying time to read a packet) or when more than
`LOSS_SHARE` of the recent packets were lost; else the lost packets leave the flight and the window
stays. A bottleneck that queues raises the round trip first and is met by Reno's halving; one
that drops without queueing passes 2% soon and is too. Persistent congestion (RFC 9002 7.6)
resets the window as in Reno.

The least round trip is that of the last `LEAST_WINDOW_S` to twice that (`LeastRtt`, BBR's min_rtt
filter), not of the connection's whole life: a path whose delay grew for good (a route change, or
the WAN lab shaping links a session formed on without delay) would otherwise read as a standing
queue, every random loss would halve the window as in plain Reno, and a prefill would crawl (a
ring formed at 0.2 ms took 0.3-1.2 s per 350 kB edge at 20 ms and 1% loss against 0.06-0.07 s,
benchmarks/quic_loss.py --formed-ms). A queue that stands that long without growing is taken for the
path; one that grows still shows within the window.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from aioquic.quic.congestion.base import register_congestion_control
from aioquic.quic.congestion.reno import RenoCongestionControl
from aioquic.quic.packet_builder import QuicSentPacket

NAME = "kafila"
LOSS_SHARE = 0.02  # more of the recent packets lost than this: congestion (BBRv2's threshold)
QUEUE_RTT = 1.25  # a round trip this many times the least seen, and QUEUE_SLACK_S more: a queue
# each end's own time to read a packet, which varies by 10-20 ms on a loaded machine (a Python
# loop beside a model's compute) without any queue on the path: within it, a loss is not a queue's
QUEUE_SLACK_S = 0.020
LEAST_WINDOW_S = 10.0  # the least round trip is kept for this long to twice this (BBR's min_rtt filter)
RECENT = 1000  # packets the loss share is taken over (the counts halve past it)
LEAST = 100  # the share is taken over at least this many packets (early losses are few)


def random_loss(lost: int, sent: int, rtt: float, least_rtt: float) -> bool:
    """Whether `lost` of `sent` recent packets, lost with the latest round trip `rtt` against the
    least `least_rtt`, are a lossy path's and not a queue's."""
    if not math.isfinite(rtt):  # no round trip measured yet: Reno's rule
        return False
    return rtt <= least_rtt * QUEUE_RTT + QUEUE_SLACK_S and lost <= LOSS_SHARE * max(sent, LEAST)


class LeastRtt:
    """The least round trip of the last `window` to 2 x `window` seconds (pure: samples and their
    time in). Two windows' minima: the current one's and the one before, so the least is never a
    single fresh sample; a window with no sample lets its minimum go."""

    def __init__(self, window: float = LEAST_WINDOW_S) -> None:
        self.window = window
        self._started = -math.inf  # when the current window began
        self._current = math.inf
        self._previous = math.inf

    def reset(self) -> None:
        """Forget every sample (a new path): the next one is the least."""
        self._started, self._current, self._previous = -math.inf, math.inf, math.inf

    def sample(self, now: float, rtt: float) -> None:
        age = now - self._started
        if age >= self.window:
            self._previous = self._current if age < 2 * self.window else math.inf
            self._current, self._started = rtt, now
        else:
            self._current = min(self._current, rtt)

    @property
    def value(self) -> float:
        """Seconds; inf before the first sample."""
        return min(self._current, self._previous)


class LossTolerantReno(RenoCongestionControl):
    def __init__(self, *, max_datagram_size: int) -> None:
        super().__init__(max_datagram_size=max_datagram_size)
        self.least = LeastRtt()
        self.latest_rtt = float("inf")  # no sample yet: every loss is congestion
        self.sent = 0  # recent packets sent and lost (halved together past RECENT)
        self.lost = 0
        self.tolerated = 0  # packets lost without a congestion event, in all

    def on_packet_sent(self, *, packet: QuicSentPacket) -> None:
        super().on_packet_sent(packet=packet)
        self.sent += 1
        if self.sent > RECENT:
            self.sent, self.lost = self.sent // 2, self.lost // 2

    def on_rtt_measurement(self, *, now: float, rtt: float) -> None:
        super().on_rtt_measurement(now=now, rtt=rtt)
        self.least.sample(now, rtt)
        self.latest_rtt = rtt

    def on_packets_lost(self, *, now: float, packets: Iterable[QuicSentPacket]) -> None:
        packets = list(packets)
        self.lost += len(packets)
        if random_loss(self.lost, self.sent, self.latest_rtt, self.least.value):
            self.on_packets_expired(packets=packets)  # out of the flight; the window stays
            self.tolerated += len(packets)
            return
        super().on_packets_lost(now=now, packets=packets)


register_congestion_control(NAME, LossTolerantReno)
