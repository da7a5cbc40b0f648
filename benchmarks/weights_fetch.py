"""Fetch one member's share of the default model over a real QUIC link on loopback; the same link's
raw throughput (host -> member, 4 MiB messages) is measured right after, side by side. Both are
measured twice in one run: with path MTU probing off (1200-byte QUIC packets) and on (a path on one
machine carries 16000-byte packets).

    python3 benchmarks/weights_fetch.py A:B [--head]    # blocks [A, B), e.g. 20:30

With `--wan MS,MS,...` (root) the fetch runs instead between two members behind home routers in
the WAN lab (tests/natlab/wanlab.py), once per one-way delay on the edge, `--runs` times each,
optionally with the edge capped at `--rate` MB/s:

    python3 benchmarks/weights_fetch.py 10:20 --wan 0,40,100 --runs 3 [--rate 5]
"""

import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kafila.models.checkpoint import Checkpoint
from kafila.models.registry import resolve
from kafila.net.auth import EdgeContext
from kafila.net.certs import make_identity
from kafila.net.endpoint import UdpEndpoint
from kafila.net.link import Link, LinkConfig
from kafila.obs.log import configure_logging
from kafila.session.channel import LinkChannel
from kafila.session.weights.fetch import DEFAULT_WINDOW, ShardResult, fetch_shard
from kafila.session.weights.server import WeightServer
from tests.natlab.delayline import Shape
from tests.natlab.lab import Site, sh
from tests.natlab.wanlab import WanLab


async def linked(config: LinkConfig) -> tuple[Link, Link, UdpEndpoint, UdpEndpoint]:
    ctx = EdgeContext("S-bench", "member", "host", b"bench")
    ea = await UdpEndpoint.open(local=("127.0.0.1", 0))
    eb = await UdpEndpoint.open(local=("127.0.0.1", 0))
    member, host = Link(ea, ctx, make_identity(), True, config), Link(eb, ctx, make_identity(), False, config)
    host.add_direct(ea.local_address)
    member.add_direct(eb.local_address)
    host.start()
    member.start()
    await asyncio.gather(member.wait_ready(), host.wait_ready())
    await asyncio.sleep(0.5)  # the path probes have answered
    return member, host, ea, eb


async def fetch(
    ws: WeightServer, member: Link, host: Link, blocks: range, head: bool, cache: Path
) -> tuple[ShardResult, float]:
    serving = asyncio.ensure_future(ws.serve(LinkChannel(host, "member")))
    t0 = time.perf_counter()
    r = await fetch_shard(LinkChannel(member, "host"), blocks, head, cache=cache, local=[], progress=False)
    dt = time.perf_counter() - t0
    await serving
    return r, dt


async def raw(member: Link, host: Link, n: int = 16, size: int = 4 << 20) -> float:
    payload = bytes(size)

    async def send() -> None:
        for _ in range(n):
            await host.send(40, payload)

    t0 = time.perf_counter()
    sender = asyncio.ensure_future(send())
    for _ in range(n):
        await member.recv(120)
    await sender
    return n * size / (time.perf_counter() - t0)


async def wan_linked(
    lab: WanLab, sites: list[Site], config: LinkConfig
) -> tuple[Link, Link, UdpEndpoint, UdpEndpoint]:
    """A link between the members behind two permissive routers of the WAN lab (port-preserving
    NATs: each dials the other's router address at its own port)."""
    ctx = EdgeContext("S-bench", "member", "host", b"bench")
    socks = [lab.udp_socket(sites[1].host), lab.udp_socket(sites[0].host)]
    for sock, other, site in ((socks[0], socks[1], sites[0]), (socks[1], socks[0], sites[1])):
        sock.sendto(b"\x00", (site.wan, other.getsockname()[1]))  # a punch: opens this side's NAT
    await asyncio.sleep(0.5)
    for sock in socks:
        with contextlib.suppress(BlockingIOError):
            sock.recv(64)
    ea, eb = await UdpEndpoint.open(socks[0]), await UdpEndpoint.open(socks[1])
    member, host = Link(ea, ctx, make_identity(), True, config), Link(eb, ctx, make_identity(), False, config)
    host.add_direct((sites[1].wan, ea.local_address[1]))
    member.add_direct((sites[0].wan, eb.local_address[1]))
    host.start()
    member.start()
    await asyncio.gather(member.wait_ready(), host.wait_ready())
    await asyncio.sleep(1.0)  # the path probes have answered
    return member, host, ea, eb


async def congestion(link: Link) -> str:
    """The sender's congestion state while it runs (largest window, slow-start threshold, RTT)."""
    most, rtt, ssthresh, lost = 0, 0.0, None, [0]
    conn = link._quic
    assert conn is not None
    cc = conn._loss._cc
    counted = cc.on_packets_lost

    def count(*, now: float, packets: Any) -> None:  # packets the sender declared lost
        packets = list(packets)
        lost[0] += len(packets)
        counted(now=now, packets=packets)

    cc.on_packets_lost = count  # type: ignore[method-assign]
    t0, tick = time.perf_counter(), 0.0
    with contextlib.suppress(asyncio.CancelledError):
        while True:
            if TIMELINE and time.perf_counter() - t0 >= tick:
                rtt_now = conn._loss._rtt_smoothed * 1e3
                print(f"    {tick:4.0f} s: cwnd {cc.congestion_window / 1e3:.0f} kB, in flight "
                      f"{cc.bytes_in_flight / 1e3:.0f} kB, RTT {rtt_now:.0f} ms, lost {lost[0]}")  # fmt: skip
                tick += 2.0
            most, ssthresh = max(most, cc.congestion_window), cc.ssthresh
            rtt = conn._loss._rtt_smoothed
            await asyncio.sleep(0.05)
    return (
        f"largest congestion window {most / 1e3:.0f} kB, slow-start threshold {ssthresh}, "
        f"RTT {rtt * 1e3:.0f} ms, {lost[0]} packets lost"
    )


TIMELINE = "--timeline" in sys.argv


def drops(lab: WanLab, sites: list[Site]) -> str:
    """Packets dropped by the kernel on the way: the TUN device's queue, the members' sockets."""
    tun = sh("ip", "-n", lab.inet, "-s", "-j", "link", "show", "tun0")
    tx = json.loads(tun)[0]["stats64"]["tx"]["dropped"]
    rcv = []
    for site in sites:
        snmp = sh("ip", "netns", "exec", site.host, "cat", "/proc/net/snmp").splitlines()
        udp = [line.split() for line in snmp if line.startswith("Udp:")]
        rcv.append(dict(zip(udp[0], udp[1], strict=True))["RcvbufErrors"])
    return f"TUN queue drops {tx}, socket buffer drops (host, member) {rcv}"


async def wan_main(
    blocks: range, head: bool, delays: list[float], runs: int, rate: float | None, config: LinkConfig
) -> None:
    folder = resolve("smollm2-135m", progress=False)
    with tempfile.TemporaryDirectory() as tmp, WanLab() as lab:
        sites = [lab.add_site("permissive"), lab.add_site("permissive")]
        ws = WeightServer(folder, cache=Path(tmp) / "host")
        await ws.prepare()
        # runs alternate the delays (0, 40, 100, 0, 40, 100, ...) so the machine's load falls on each alike
        times: dict[float, list[float]] = {ms: [] for ms in delays}
        loads: dict[float, list[float]] = {ms: [] for ms in delays}
        size, packet = 0, 0
        for i in range(runs):
            for ms in delays:
                # a rate cap with a queue of 50 ms at that rate (a home router's buffer)
                cap = {} if rate is None else {"rate": rate, "queue": int(rate * 0.05)}
                lab.shape(Shape(delay=ms / 1000, **cap))  # type: ignore[arg-type]
                member, host, ea, eb = await wan_linked(lab, sites, config)
                watch = asyncio.ensure_future(congestion(host))
                r, dt = await fetch(ws, member, host, blocks, head, Path(tmp) / f"m-{ms}-{i}")
                watch.cancel()
                print(
                    f"  {ms:g} ms, run {i + 1}: {dt:.1f} s; host's sender: {await watch}; "
                    f"{drops(lab, sites)}",
                    flush=True,
                )
                times[ms].append(dt)
                loads[ms].append(os.getloadavg()[0])
                size, packet = r.bytes_fetched, member.datagram_size
                for link in (member, host):
                    await link.close()
                ea.close()
                eb.close()
        base = statistics.median(times[delays[0]])
        for ms in delays:
            med = statistics.median(times[ms])
            print(
                f"one-way {ms:g} ms: {size / 1e6:.1f} MB in median {med:.1f} s (runs {min(times[ms]):.1f}-"
                f"{max(times[ms]):.1f} s, n={runs}) = {size / med / 1e6:.1f} MB/s, "
                f"{med / base:.2f}x the first delay; {packet}-byte packets; "
                f"load average {min(loads[ms]):.2f}-{max(loads[ms]):.2f}",
                flush=True,
            )


async def main(blocks: range, head: bool) -> None:
    folder = resolve("smollm2-135m", progress=False)
    ckpt = Checkpoint.open(folder)
    share = sum(ckpt.tensors[n].nbytes for n in ckpt.names_for(blocks, head))
    print(f"smollm2-135m blocks [{blocks.start}, {blocks.stop}) head={head}: share {share / 1e6:.1f} MB")
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ws = WeightServer(folder, cache=Path(tmp) / "host")
        await ws.prepare()
        prep = time.perf_counter() - t0
        t0 = time.perf_counter()
        await WeightServer(folder, cache=Path(tmp) / "host").prepare()
        prep2 = time.perf_counter() - t0
        rates = {}
        for probe in (False, True):
            member, host, ea, eb = await linked(LinkConfig() if probe else LinkConfig(probe_sizes=()))
            cache = Path(tmp) / f"m-{probe}"
            r, dt = await fetch(ws, member, host, blocks, head, cache)
            r2, dt2 = await fetch(ws, member, host, blocks, head, cache)
            rates[probe] = rate = r.bytes_fetched / dt
            raw_rate = await raw(member, host)
            print(
                f"{member.datagram_size}-byte packets (path MTU probing {'on' if probe else 'off'}): fetched "
                f"{r.tensor_bytes / 1e6:.1f} MB tensors + {r.meta_bytes / 1e6:.2f} MB headers/small files in "
                f"{dt:.1f} s = {rate / 1e6:.2f} MB/s; same link, raw 4 MiB messages: "
                f"{raw_rate / 1e6:.2f} MB/s (fetch/raw {rate / raw_rate:.2f}); "
                f"restart: {r2.bytes_fetched} bytes fetched in {dt2:.2f} s"
            )
            for link in (member, host):
                await link.close()
            ea.close()
            eb.close()
    print(f"fetch rate, probing on / off: {rates[True] / rates[False]:.2f}x")
    print(f"host manifest: {prep:.2f} s (hashing), {prep2:.2f} s (digests remembered)")


if __name__ == "__main__":
    configure_logging(level="warning")
    a, b = (int(x) for x in sys.argv[1].split(":"))
    if "--wan" in sys.argv:
        delays = [float(x) for x in sys.argv[sys.argv.index("--wan") + 1].split(",")]
        runs = int(sys.argv[sys.argv.index("--runs") + 1]) if "--runs" in sys.argv else 1
        rate = float(sys.argv[sys.argv.index("--rate") + 1]) * 1e6 if "--rate" in sys.argv else None
        cc = sys.argv[sys.argv.index("--cc") + 1] if "--cc" in sys.argv else LinkConfig().congestion_control
        config = LinkConfig(congestion_control=cc)
        print(f"congestion control {cc}; fetch window {DEFAULT_WINDOW} requests", flush=True)
        asyncio.run(wan_main(range(a, b), "--head" in sys.argv, delays, runs, rate, config))
    else:
        asyncio.run(main(range(a, b), "--head" in sys.argv))
