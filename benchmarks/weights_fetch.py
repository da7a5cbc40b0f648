"""Fetch one member's share of the default model over a real QUIC link on loopback; the same link's
raw throughput (host -> member, 4 MiB messages) is measured right after, side by side."""

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
from kafila.net.link import Link
from kafila.obs.log import configure_logging
from kafila.session.channel import LinkChannel
from kafila.session.weights import WeightServer, fetch_shard


async def linked() -> tuple[Link, Link, UdpEndpoint, UdpEndpoint]:
    ctx = EdgeContext("S-bench", "member", "host", b"bench")
    ea = await UdpEndpoint.open(local=("127.0.0.1", 0))
    eb = await UdpEndpoint.open(local=("127.0.0.1", 0))
    member, host = Link(ea, ctx, make_identity(), True), Link(eb, ctx, make_identity(), False)
    host.add_direct(ea.local_address)
    member.add_direct(eb.local_address)
    host.start()
    member.start()
    await asyncio.gather(member.wait_ready(), host.wait_ready())
    return member, host, ea, eb


async def fetch(ws: WeightServer, member: Link, host: Link, blocks: range, head: bool, cache: Path):
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
    member, host, ea, eb = await linked()
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        ws = WeightServer(folder, cache=Path(tmp) / "host")
        await ws.prepare()
        prep = time.perf_counter() - t0
        t0 = time.perf_counter()
        await WeightServer(folder, cache=Path(tmp) / "host").prepare()
        prep2 = time.perf_counter() - t0
        r, dt = await fetch(ws, member, host, blocks, head, Path(tmp) / "m")
        r2, dt2 = await fetch(ws, member, host, blocks, head, Path(tmp) / "m")
    rate = r.bytes_fetched / dt
    raw_rate = await raw(member, host)
    print(
        f"smollm2-135m blocks [{blocks.start}, {blocks.stop}) head={head}: share {share / 1e6:.1f} MB; "
        f"fetched {r.tensor_bytes / 1e6:.1f} MB tensors + {r.meta_bytes / 1e6:.2f} MB headers/small files "
        f"in {dt:.1f} s = {rate / 1e6:.2f} MB/s\n"
        f"same link, raw 4 MiB messages: {raw_rate / 1e6:.2f} MB/s; fetch/raw = {rate / raw_rate:.2f}\n"
        f"restart: {r2.bytes_fetched} bytes fetched in {dt2:.2f} s; host manifest: {prep:.2f} s "
        f"(hashing), {prep2:.2f} s (digests remembered)"
    )
    for link in (member, host):
        await link.close()
    ea.close()
    eb.close()


if __name__ == "__main__":
    configure_logging(level="warning")
    a, b = (int(x) for x in sys.argv[1].split(":"))
    asyncio.run(main(range(a, b), "--head" in sys.argv))
