"""One ring edge in virtual time: two real aioquic connections whose datagrams cross a simulated
edge (a one-way delay, order-keeping jitter, Bernoulli loss; no sockets, no clock). The receiver
acknowledges a message when its stage's output would have left (`Setup.hold` after it arrived), as
a ring stage does (kafila.net.link, "ACKs"), and a second packet at once; the sender sends a small
flight twice as a link does (kafila.net.link.copies). Used by tests/net/test_congestion.py and
benchmarks/quic_loss.py.
"""

from __future__ import annotations

import heapq
import random
import ssl
from dataclasses import dataclass, field

from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import pull_quic_header

from kafila.net import congestion, quic_private
from kafila.net.certs import make_identity
from kafila.net.link import LinkConfig, copies

ADDR = ("edge", 1)
TICK = 1e-6  # a timer due now fires this much later (aioquic may leave a due ACK to the pacer at `now`)


@dataclass(frozen=True)
class Setup:
    loss: float
    delay: float
    jitter: float  # up to this much more per packet, in order (each end's own time to read it)
    mss: int
    cc: str
    copy_flight: int
    steps: int
    step_bytes: int
    circuit: float
    hold: float
    prefill_bytes: int


@dataclass
class Edge:
    """The two connections and the datagrams in flight between them, in virtual time. `setup` may
    be replaced between messages (a path whose delay or loss changed)."""

    setup: Setup
    rng: random.Random
    client: QuicConnection
    server: QuicConnection
    now: float = 0.0
    wire: list[tuple[float, int, bool, bytes]] = field(default_factory=list)  # (due, seq, to server, data)
    seq: int = 0
    received: int = 0
    acks_due: list[float] = field(default_factory=list)
    arrived: list[float] = field(default_factory=list)  # when the server held every byte sent so far
    wanted: int = 0
    last_due: dict[bool, float] = field(default_factory=dict)  # per direction: packets stay in order
    stream: int = 0

    def put(self, conn: QuicConnection, times: int = 1) -> None:
        to_server = conn is self.client
        for data, _ in conn.datagrams_to_send(now=self.now):
            for _ in range(times):
                if self.rng.random() >= self.setup.loss:
                    self.seq += 1
                    due = self.now + self.setup.delay + self.setup.jitter * self.rng.random()
                    due = self.last_due[to_server] = max(due, self.last_due.get(to_server, 0.0))
                    heapq.heappush(self.wire, (due, self.seq, to_server, data))

    def deliver(self, to_server: bool, data: bytes) -> None:
        conn = self.server if to_server else self.client
        pending = quic_private.ack_waiting(conn)
        conn.receive_datagram(data, ADDR, now=self.now)
        if pending:  # a second packet is acknowledged at once, as a link does
            quic_private.send_waiting_ack_now(conn, self.now)
        while (event := conn.next_event()) is not None:
            if isinstance(event, events.StreamDataReceived) and to_server:
                self.received += len(event.data)
                if self.received >= self.wanted:
                    self.arrived.append(self.now)
                    self.acks_due.append(self.now + self.setup.hold)
        self.put(conn)

    def run_until(self, until: float, done: int | None = None) -> None:
        """Advance to `until`, or until the server holds `done` arrivals."""
        while done is None or len(self.arrived) < done:
            timers = [t for t in (self.client.get_timer(), self.server.get_timer()) if t is not None]
            wire = [self.wire[0][0]] if self.wire else []
            due = min([*timers, *wire, *self.acks_due[:1]], default=None)
            if due is None or due > until:
                self.now = until
                return
            self.now = max(self.now, due)
            if self.acks_due and self.acks_due[0] <= self.now:
                self.acks_due.pop(0)
                if quic_private.send_waiting_ack_now(self.server, self.now):
                    self.put(self.server)
            elif self.wire and self.wire[0][0] <= self.now:
                _, _, to_server, data = heapq.heappop(self.wire)
                self.deliver(to_server, data)
            else:
                self.now += TICK
                for conn in (self.client, self.server):
                    timer = conn.get_timer()
                    if timer is not None and timer <= self.now:
                        conn.handle_timer(self.now)
                        self.put(conn)

    def send(self, size: int) -> float:
        """One message from the client; seconds until the server held all of it."""
        start, self.wanted = self.now, self.wanted + size
        self.client.send_stream_data(self.stream, bytes(size))
        unacked = quic_private.unacked_stream_bytes(self.client, self.stream)
        self.put(self.client, copies(unacked, self.setup.copy_flight))
        self.run_until(start + 60.0, done=len(self.arrived) + 1)
        return self.arrived[-1] - start

    def decode(self, steps: int) -> list[float]:
        """`steps` decode steps, one activation each circuit; each one's seconds to arrive."""
        times = []
        for _ in range(steps):
            start = self.now
            times.append(self.send(self.setup.step_bytes))
            self.run_until(start + self.setup.circuit)
        return times


def connect(setup: Setup, seed: int) -> Edge:
    """An edge whose handshake is done, its loss drawn from `seed`."""
    identity = make_identity()

    def config(is_client: bool) -> QuicConfiguration:
        return QuicConfiguration(
            is_client=is_client,
            alpn_protocols=["kafila-link/1"],
            max_datagram_size=setup.mss,
            congestion_control_algorithm=setup.cc,
            max_data=64 << 20,
            max_stream_data=32 << 20,
            idle_timeout=60.0,
        )

    client_config, server_config = config(True), config(False)
    client_config.verify_mode = ssl.CERT_NONE
    server_config.certificate, server_config.private_key = identity.certificate, identity.private_key
    client = QuicConnection(configuration=client_config)
    client.connect(ADDR, now=0.0)
    first = client.datagrams_to_send(now=0.0)
    header = pull_quic_header(Buffer(data=first[0][0]), host_cid_length=8)
    server = QuicConnection(
        configuration=server_config, original_destination_connection_id=header.destination_cid
    )
    for conn in (client, server):
        quic_private.set_ack_delay(conn, LinkConfig().ack_delay)  # as a link does
        quic_private.window_min_rtt(conn, congestion.LeastRtt())
    edge = Edge(setup, random.Random(seed), client, server)
    for data, _ in first:
        edge.seq += 1
        heapq.heappush(edge.wire, (setup.delay, edge.seq, True, data))
    edge.run_until(1.0)  # the handshake
    edge.stream = client.get_next_available_stream_id()
    return edge
