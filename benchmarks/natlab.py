"""NAT lab benchmark (root): Table III equivalent and link figures, through real Linux netfilter.

Builds the NAT lab (tests/natlab/lab.py: a rendezvous with two public addresses, members behind
permissive / ordinary (port- and address-restricted, and port-restricted with open WAN input) /
restrictive routers), starts the real
rendezvous inside it (`kafila rendezvous` in its own process, or `--in-process`), and for every
ordered class pair forms an edge `--trials` times from a fresh socket: the classes each member
measured, the pair rule's prediction (paper rule and Linux rule), the path achieved and the time
to an authenticated link (connect_edge called on both ends until both are ready; session setup
and classification excluded, and timed separately).

Then link figures on one direct edge (ordinary <-> ordinary) and one relayed edge (restrictive <->
restrictive), side by side with path MTU probing off (1200-byte QUIC packets everywhere) and on
(the direct edge probes its path and settles on 1452 bytes, the lab's 1500-byte MTU): time to
link, one-way latency (median of sequential sends on an idle link; both ends live in this process
so they share a clock) and throughput (back-to-back messages, MB/s of payload) for 8 KiB and
1 MiB messages. Both ends of every link run in this one Python process on shared CPUs, so
throughput is a floor and figures are noisy; MB per CPU-second of this process is printed too,
as a figure less sensitive to other load (it covers both link ends, and the relay too with
--in-process).

    sudo python3 benchmarks/natlab.py [--trials N] [--table-only] [--count-8k N] [--count-1m N]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kafila.net.edge import EdgeOptions, connect_edge
from kafila.net.link import Link, LinkConfig
from kafila.planner.reachability import LINUX_RULE, PAPER_RULE
from kafila.rendezvous.server import RendezvousServer
from tests.natlab.lab import KINDS, OPEN_KIND, RDV_ADDRS, Lab, Site, missing_requirements, netns
from tests.net.harness import Pair, RendezvousAt, open_pair, start_rendezvous

PROBE_TIMEOUT = 0.1


async def _pair(lab: Lab, rdv, a: Site, b: Site, probe: bool = True) -> tuple[Pair, float]:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    pair = await open_pair(
        rdv,
        lab.udp_socket(a.host, a.lan),
        lab.udp_socket(b.host, b.lan),
        lambda: netns(a.host),
        lambda: netns(b.host),
        probe_timeout=PROBE_TIMEOUT,
        config=LinkConfig() if probe else LinkConfig(probe_sizes=()),
    )
    return pair, time.perf_counter() - start


async def _link(pair: Pair, predicted: bool) -> tuple[Link, Link, float]:
    opts = EdgeOptions(predicted_direct=predicted)
    start = time.perf_counter()
    client, server = await asyncio.gather(
        connect_edge(pair.a, pair.b.member, True, opts), connect_edge(pair.b, pair.a.member, False, opts)
    )
    return client, server, time.perf_counter() - start


async def table_iii(lab: Lab, rdv, sites: dict[str, list[Site]], trials: int) -> None:  # type: ignore[no-untyped-def]
    print("\nTable III equivalent: ordered class pairs through Linux netfilter NATs")
    print(
        f"{'client':<17} {'server':<17} {'classes (measured)':<27} {'paper':<7} {'linux':<7} "
        f"{'achieved':<14} {'link s (median)':>15}"
    )
    wrong_way = 0
    for ka, kb in itertools.product((*KINDS, OPEN_KIND), (*KINDS, OPEN_KIND)):
        achieved, times, classes = [], [], ""
        paper = linux = False
        for _ in range(trials):
            pair, _ = await _pair(lab, rdv, sites[ka][0], sites[kb][1])
            assert pair.a.nat and pair.b.nat
            na, nb = pair.a.nat.nat, pair.b.nat.nat
            classes = f"{_short(na)} {_short(nb)}"
            paper, linux = PAPER_RULE(na, nb), LINUX_RULE(na, nb)
            client, server, took = await _link(pair, linux)
            await client.send(16, b"x")
            await server.recv(timeout=10)
            achieved.append(client.path.value if client.path else "none")
            times.append(took)
            wrong_way += int(linux and client.path is not None and client.path.value != "direct")
            await client.close()
            await server.close()
            await pair.close()
        outcome = "/".join(sorted(set(achieved)))
        if len(set(achieved)) > 1:
            outcome += f" ({achieved.count('direct')}/{trials} direct)"
        print(
            f"{ka:<17} {kb:<17} {classes:<27} {_dr(paper):<7} {_dr(linux):<7} {outcome:<14} "
            f"{statistics.median(times):>15.3f}"
        )
    print(f"edges predicted direct (linux rule) that relayed: {wrong_way}")


ABBREV = {"endpoint-independent": "EI", "address-dependent": "AD", "address-and-port-dependent": "APD"}


def _short(nat) -> str:  # type: ignore[no-untyped-def]
    """class[mapping/filtering], e.g. ordi[EI/APD]; `+open` when the router takes unsolicited input."""
    behaviour = f"{ABBREV.get(nat.mapping or '', '?')}/{ABBREV.get(nat.filtering or '', '?')}"
    return f"{nat.cls.value[:4]}[{behaviour}]{'+open' if nat.open_input else ''}"


def _dr(direct: bool) -> str:
    return "direct" if direct else "relay"


async def link_figures(lab: Lab, rdv, a: Site, b: Site, label: str, args, probe: bool) -> None:  # type: ignore[no-untyped-def]
    pair, setup = await _pair(lab, rdv, a, b, probe)
    assert pair.a.nat and pair.b.nat
    predicted = LINUX_RULE(pair.a.nat.nat, pair.b.nat.nat)
    client, server, took = await _link(pair, predicted)
    await asyncio.sleep(1.0)  # both ends' path probes have answered (or given up) by now
    packets = f"{client.datagram_size}-byte QUIC packets (path MTU probing {'on' if probe else 'off'})"
    print(
        f"\n{label}, {packets}: {a.kind} <-> {b.kind}, path {client.path}, "
        f"time to link {took:.3f} s (session join + both classifications {setup:.2f} s)"
    )
    for size, count in ((8192, args.count_8k), (1 << 20, args.count_1m)):
        payload = os.urandom(size)
        lat = []
        for _ in range(min(count, 30)):
            t0 = time.perf_counter()
            await client.send(16, payload)
            await server.recv(timeout=30)
            lat.append(time.perf_counter() - t0)
        t0, c0 = time.perf_counter(), time.process_time()

        async def produce(p: bytes = payload, n: int = count) -> None:
            for _ in range(n):
                await client.send(16, p)

        producer = asyncio.create_task(produce())
        for _ in range(count):
            await server.recv(timeout=60)
        await producer
        dt, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(
            f"  {size // 1024:>5} KiB: one-way latency median {statistics.median(lat) * 1000:8.2f} ms, "
            f"throughput {count * size / dt / 1e6:7.2f} MB/s ({count} messages in {dt:.2f} s; "
            f"{count * size / cpu / 1e6:.2f} MB per CPU-second of this process)"
        )
    s = client.stats()
    print(
        f"  smoothed RTT {s.smoothed_rtt * 1000:.2f} ms, datagrams direct {s.datagrams_direct} relay "
        f"{s.datagrams_relay}"
    )
    await client.close()
    await server.close()
    await pair.close()


RDV_PORT = 8470
RELAXED = [
    "--join-rate-per-address", "100", "--join-burst-per-address", "1000",
    "--failed-proof-rate-per-session", "100", "--failed-proof-burst-per-session", "1000",
    "--open-rate-per-address", "100", "--open-burst-per-address", "1000",
]  # fmt: skip


@contextlib.asynccontextmanager
async def rendezvous(lab: Lab, own_process: bool) -> AsyncIterator[RendezvousServer | RendezvousAt]:
    """The real rendezvous inside the lab: `kafila rendezvous` in its own process (as deployed), or
    in this process's event loop (as the tests run it)."""
    if not own_process:
        with netns(lab.rdv):
            server = await start_rendezvous(RDV_ADDRS[0], RDV_ADDRS[1])
        try:
            yield server
        finally:
            await server.stop()
        return
    cmd = ["ip", "netns", "exec", lab.rdv, sys.executable, "-m", "kafila", "rendezvous"]
    cmd += ["--host", RDV_ADDRS[0], "--port", str(RDV_PORT), "--udp-alt-host", RDV_ADDRS[1], *RELAXED]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        await _wait_listening(lab, proc)
        yield RendezvousAt(f"ws://{RDV_ADDRS[0]}:{RDV_PORT}/v1/signal", RDV_ADDRS[0])
    finally:
        proc.terminate()
        proc.wait(10)


async def _wait_listening(lab: Lab, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(200):
        if proc.poll() is not None:
            raise RuntimeError(f"kafila rendezvous exited with {proc.returncode}")
        with netns(lab.rdv):
            probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        with probe:
            if probe.connect_ex((RDV_ADDRS[0], RDV_PORT)) == 0:
                return
        await asyncio.sleep(0.05)
    raise RuntimeError("kafila rendezvous did not start listening within 10 s")


async def main(args: argparse.Namespace) -> None:
    with Lab() as lab:
        sites = {kind: [lab.add_site(kind), lab.add_site(kind)] for kind in (*KINDS, OPEN_KIND)}
        async with rendezvous(lab, not args.in_process) as rdv:
            print(f"rendezvous: {'in this process' if args.in_process else 'kafila rendezvous, own process'}")
            await table_iii(lab, rdv, sites, args.trials)
            for probe in () if args.table_only else (False, True):
                for kind, label in (("ordinary", "direct edge"), ("restrictive", "relayed edge")):
                    a, b = sites[kind]
                    await link_figures(lab, rdv, a, b, label, args, probe)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=3, help="links formed per ordered class pair")
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="run the rendezvous in this process's event loop instead of `kafila rendezvous` in its own",
    )
    parser.add_argument("--table-only", action="store_true", help="the class-pair table, no link figures")
    parser.add_argument("--count-8k", type=int, default=400, help="8 KiB messages in the throughput run")
    parser.add_argument("--count-1m", type=int, default=20, help="1 MiB messages in the throughput run")
    reason = missing_requirements()
    if reason:
        sys.exit(f"natlab benchmark: {reason}")
    os.environ.setdefault("KAFILA_LOG_LEVEL", "warning")
    from kafila.obs.log import configure_logging

    configure_logging(level="warning")
    asyncio.run(main(parser.parse_args()))
