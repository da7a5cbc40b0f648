"""One ring edge's QUIC under loss, in virtual time: two real aioquic connections whose datagrams
cross a simulated edge (a one-way delay, order-keeping jitter, Bernoulli loss; no sockets, no
clock), the client sending a decode step's activation every circuit and, after the decode
steps, one prefill message. The receiver acknowledges a step when its stage's output would have
left (`--hold` after it arrived), as a ring stage does (kafila.net.link, "ACKs"). Per congestion
control and with or without the link's copies of small flights (kafila.net.link.copies), over
`--seeds` seeds of the loss:

- step ms: the activation's send -> its last byte received (median, 95th and 99th percentile, max);
- window: the congestion window in packets when each step left (median, smallest);
- prefill ms: the (last) prefill message's send -> its last byte received; `--rounds R` makes R
  requests of `--steps` decode steps and a prefill each, as a session serving one user does.

    python3 benchmarks/quic_loss.py [--loss 0.01] [--delay-ms 20] [--jitter-ms 0] [--steps 400]
                                    [--seeds 10] [--rounds 1]
"""

from __future__ import annotations

import argparse
import heapq
import random
import ssl
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

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
    """The two connections and the datagrams in flight between them, in virtual time."""

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

    def send(self, stream: int, size: int) -> float:
        """One message from the client; seconds until the server held all of it."""
        start, self.wanted = self.now, self.wanted + size
        self.client.send_stream_data(stream, bytes(size))
        unacked = quic_private.unacked_stream_bytes(self.client, stream)
        self.put(self.client, copies(unacked, self.setup.copy_flight))
        self.run_until(start + 60.0, done=len(self.arrived) + 1)
        return self.arrived[-1] - start


def connect(setup: Setup, seed: int) -> Edge:
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
        quic_private.set_ack_delay(conn, LinkConfig().ack_delay)
    edge = Edge(setup, random.Random(seed), client, server)
    for data, _ in first:
        edge.seq += 1
        heapq.heappush(edge.wire, (setup.delay, edge.seq, True, data))
    edge.run_until(1.0)  # the handshake
    return edge


def one_run(setup: Setup, seed: int, rounds: int) -> dict[str, float]:
    """`rounds` requests, each its decode steps, then the next one's prefill; its last prefill's time."""
    edge = connect(setup, seed)
    stream = edge.client.get_next_available_stream_id()
    steps, windows = [], []
    for _ in range(rounds):
        for _ in range(setup.steps):
            start = edge.now
            steps.append(edge.send(stream, setup.step_bytes))
            windows.append(edge.client._loss.congestion_window / setup.mss)
            edge.run_until(start + setup.circuit)
        prefill = edge.send(stream, setup.prefill_bytes)
    steps.sort()
    ms = [1000 * s for s in steps]
    return {
        "step p50": statistics.median(ms),
        "step p95": ms[int(0.95 * len(ms))],
        "step p99": ms[int(0.99 * len(ms))],
        "step max": ms[-1],
        "window median": statistics.median(windows),
        "window least": min(windows),
        "prefill ms": 1000 * prefill,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--loss", type=float, default=0.01)
    p.add_argument("--delay-ms", type=float, default=20.0)
    p.add_argument("--jitter-ms", type=float, default=0.0, help="up to this much more per packet, in order")
    p.add_argument("--steps", type=int, default=400, help="decode steps before the prefill")
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--rounds", type=int, default=1, help="requests: each its decode steps, then a prefill")
    p.add_argument("--step-bytes", type=int, default=2330, help="one activation (576 float32 and the header)")
    p.add_argument("--prefill-bytes", type=int, default=350_000, help="a 150-token prompt's activations")
    p.add_argument("--circuit-ms", type=float, default=110.0, help="one decode step's time around the ring")
    p.add_argument("--hold-ms", type=float, default=10.0, help="the stage's compute before its ACK")
    p.add_argument("--mss", type=int, default=1452)
    args = p.parse_args()
    print(f"benchmarks/quic_loss.py {' '.join(sys.argv[1:])}")
    print(
        "| congestion control | copies | step ms p50 / p95 / p99 / max | window median / least | prefill ms |"
    )
    print("|---|---|---|---|---|")
    for cc in ("reno", "cubic", congestion.NAME):
        for copy_flight in (0, LinkConfig().copy_flight):
            setup = Setup(
                args.loss, args.delay_ms / 1000, args.jitter_ms / 1000, args.mss, cc, copy_flight,
                args.steps, args.step_bytes, args.circuit_ms / 1000, args.hold_ms / 1000, args.prefill_bytes,
            )  # fmt: skip
            runs = [one_run(setup, seed, args.rounds) for seed in range(1, args.seeds + 1)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            low = {k: min(r[k] for r in runs) for k in runs[0]}
            high = {k: max(r[k] for r in runs) for k in runs[0]}
            copied = "yes" if copy_flight else "no"
            print(
                f"| {cc} | {copied} | {med['step p50']:.0f} / {med['step p95']:.0f} / "
                f"{med['step p99']:.0f} / {med['step max']:.0f} | {med['window median']:.0f} / "
                f"{med['window least']:.0f} | {med['prefill ms']:.0f} ({low['prefill ms']:.0f}-"
                f"{high['prefill ms']:.0f}) |"
            )


if __name__ == "__main__":
    main()
