"""Fetch one member's share of the default model over a real QUIC link on loopback; the same link's
raw throughput (host -> member, 4 MiB messages) is measured right after, side by side. Both are
measured twice in one run: with path MTU probing off (1200-byte QUIC packets) and on (a path on one
machine carries 16000-byte packets).

    python3 benchmarks/weights_fetch.py A:B [--head]    # blocks [A, B), e.g. 20:30
"""

import asyncio
import sys
import tempfile
import time
from pathlib import Path

from kafila.models.checkpoint import Checkpoint
from kafila.models.registry import resolve
from kafila.net.auth import EdgeContext
from kafila.net.certs import make_identity
from kafila.net.endpoint import UdpEndpoint
from kafila.net.link import Link, LinkConfig
from kafila.obs.log import configure_logging
from kafila.session.channel import LinkChannel
from kafila.session.weights.fetch import ShardResult, fetch_shard
from kafila.session.weights.server import WeightServer


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
    r = await fetch_shard(LinkChannel(member, "host"), blocks, head, cache=cache, local=[])
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
    asyncio.run(main(range(a, b), "--head" in sys.argv))
