"""Rendezvous capacity: relay forwarding rate and signaling with 500 concurrent members.

The rendezvous runs as its own process (`kafila rendezvous`, limits raised so the benchmark is
not rate-limited: every client comes from 127.0.0.1). This process plays the members.

1. Relay: two loopback UDP legs of one channel; leg A sends datagrams of SIZE bytes as fast as
   it can for DURATION seconds (a thread), leg B counts what the relay forwarded. Prints packets/s
   and MB/s forwarded, and the loss (sender outran the relay or socket buffers).
2. Signaling: MEMBERS concurrent WebSocket members (sessions of --per-session, host included)
   open/join and stay connected. Prints the join latency (join sent -> joined received,
   p50/p95/max) and the rendezvous's resident memory per member (RSS after - RSS before, / MEMBERS).

    python3 benchmarks/rendezvous.py [--members 500] [--per-session 5] [--duration 3]

Figures on a shared 2-core machine are noisy: the sender, the receiver and the relay compete
for the same cores.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

from kafila.demo.fleet import free_port
from kafila.net.signaling import SignalingClient
from kafila.proto import udp
from kafila.proto.codes import SessionCode, new_code

WINDOW_BYTES = 128 * 1024  # relay bytes in flight


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class Server:
    def __init__(self) -> None:
        self.port = free_port(socket.SOCK_STREAM)
        self.udp_port = free_port(socket.SOCK_DGRAM)
        args = [
            sys.executable, "-m", "kafila", "rendezvous", "--host", "127.0.0.1", "--port", str(self.port),
            "--udp-port", str(self.udp_port), "--udp-alt-port", str(free_port(socket.SOCK_DGRAM)),
            "--join-burst-per-address", "1000000", "--open-burst-per-address", "1000000",
            "--failed-proof-burst-per-session", "1000000", "--max-connections", "100000",
            "--max-connections-per-address", "100000",
            "--relay-session-bytes-per-s", "0", "--heartbeat-timeout-s", "600",
        ]  # fmt: skip
        env = {**os.environ, "KAFILA_LOG": "json", "KAFILA_LOG_LEVEL": "warning"}
        self.proc = subprocess.Popen(args, env=env, stderr=subprocess.DEVNULL)
        self.url = f"ws://127.0.0.1:{self.port}/v1/signal"

    def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=1.0).raise_for_status()
                return
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError(f"rendezvous did not answer /healthz within {timeout:.0f} s")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(10)


# ------------------------------------------------------------------ relay


async def relay_channel(server: Server) -> tuple[SignalingClient, SignalingClient, int, bytes, bytes]:
    host = await SignalingClient.connect(server.url)
    opened = await host.open_session("bench", 2, "leg-a", {})
    code = new_code(opened.session)
    await host.protect(code)
    guest = await SignalingClient.connect(server.url)
    await guest.join(code, "leg-b", {})
    mine = await guest.request_relay(1)
    while True:
        event = await host.next_event(5.0)
        if getattr(event, "channel", None) == mine.channel:
            return host, guest, mine.channel, bytes.fromhex(event.token), bytes.fromhex(mine.token)  # type: ignore[union-attr]


def bound_leg(relay: tuple[str, int], channel: int, token: bytes) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(2.0)
    sock.sendto(udp.encode(udp.RelayBind(channel, token)), relay)
    reply = udp.decode(sock.recv(2048))
    assert isinstance(reply, udp.RelayBindAck), reply
    return sock


def windowed(
    a: socket.socket, b: socket.socket, relay: tuple[str, int], datagram: bytes, duration: float
) -> tuple[int, int, float]:
    """Leg A keeps up to WINDOW_BYTES in flight through the relay, leg B receives them (one
    thread, so the sender cannot starve the relay). Returns (sent, received, seconds)."""
    window = max(4, WINDOW_BYTES // len(datagram))
    sent = received = written_off = 0
    b.settimeout(0.05)
    start = time.perf_counter()
    end = start + duration
    while time.perf_counter() < end:
        while sent - received - written_off < window:
            a.sendto(datagram, relay)
            sent += 1
        try:
            while sent - received - written_off > window // 2:
                b.recv(65536)
                received += 1
        except TimeoutError:
            written_off = sent - received  # silent for 50 ms: what is still in flight is lost
    try:
        while True:
            b.recv(65536)
            received += 1
    except TimeoutError:
        pass
    return sent, received, time.perf_counter() - start - 0.05


async def bench_relay(server: Server, size: int, duration: float) -> None:
    host, guest, channel, token_a, token_b = await relay_channel(server)
    relay = ("127.0.0.1", server.udp_port)
    a = bound_leg(relay, channel, token_a)
    b = bound_leg(relay, channel, token_b)
    datagram = udp.encode(udp.RelayData(channel, b"\xc3" + os.urandom(size - udp.RELAY_HEADER_BYTES - 1)))
    sent, got, elapsed = await asyncio.to_thread(windowed, a, b, relay, datagram, duration)
    print(
        f"relay {size:5d} B datagrams: {got / elapsed:8.0f} packets/s {got * size / elapsed / 1e6:6.1f} MB/s "
        f"forwarded ({WINDOW_BYTES // 1024} KiB in flight, loss {100 * (1 - got / max(sent, 1)):.2f}%)"
    )
    a.close()
    b.close()
    await guest.close()
    await host.close()


# ------------------------------------------------------------------ signaling


async def bench_signaling(server: Server, members: int, per_session: int) -> None:
    await asyncio.sleep(0.5)
    before = rss_bytes(server.proc.pid)
    clients: list[SignalingClient] = []
    latencies: list[float] = []
    start = time.perf_counter()
    for _ in range(members // per_session):
        host = await SignalingClient.connect(server.url)
        opened = await host.open_session(
            "bench", per_session, "host", {"memory_gb": 16, "bandwidth_gbs": 20.0}
        )
        clients.append(host)
        session_code = new_code(opened.session)
        await host.protect(session_code)

        async def one(i: int, code: SessionCode = session_code) -> SignalingClient:
            client = await SignalingClient.connect(server.url)
            t0 = time.perf_counter()  # a join's latency includes its key (scrypt, ~50 ms of CPU)
            await client.join(code, f"member-{i}", {"memory_gb": 8, "bandwidth_gbs": 10.0})
            latencies.append(time.perf_counter() - t0)
            return client

        clients += await asyncio.gather(*(one(i) for i in range(per_session - 1)))
    total = time.perf_counter() - start
    await asyncio.sleep(1.0)
    after = rss_bytes(server.proc.pid)
    health = httpx.get(f"http://127.0.0.1:{server.port}/healthz").json()
    q = statistics.quantiles(latencies, n=20)
    members_line = f"{health['members']} members in {health['sessions']} sessions"
    print(
        f"signaling {members_line}, registered in {total:.1f} s; "
        f"join latency p50 {statistics.median(latencies) * 1e3:.1f} ms, p95 {q[18] * 1e3:.1f} ms, "
        f"max {max(latencies) * 1e3:.1f} ms"
    )
    print(
        f"signaling memory: rendezvous RSS {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB, "
        f"{(after - before) / len(clients) / 1024:.1f} KiB per member"
    )
    await asyncio.gather(*(c.close() for c in clients))


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--members", type=int, default=500, help="concurrent members to register")
    parser.add_argument("--per-session", type=int, default=5, help="members per session, host included")
    parser.add_argument("--duration", type=float, default=3.0, help="seconds of relay traffic per size")
    parser.add_argument("--sizes", default="1200,8000", help="relay datagram sizes in bytes, header included")
    args = parser.parse_args()
    server = Server()
    try:
        server.wait_ready()
        for size in (int(s) for s in args.sizes.split(",")):
            await bench_relay(server, size, args.duration)
        await bench_signaling(server, args.members, args.per_session)
    finally:
        server.stop()


if __name__ == "__main__":
    asyncio.run(main())
