"""The WAN lab (root): packets between sites and the rendezvous held for each edge's one-way delay
by the user-space TUN router, and a three-member session across it: the round trips it measures,
and greedy answers identical to those with no delay."""

from __future__ import annotations

import json
import select
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import pytest_asyncio

from kafila.rendezvous.server import RendezvousServer
from tests.natlab.delayline import Shape
from tests.natlab.lab import RDV_ADDRS, SO_RCVBUFFORCE, netns
from tests.natlab.wanlab import WanLab
from tests.net.harness import start_rendezvous
from tests.session.test_session_natlab import API, form, stop

pytestmark = [pytest.mark.root, pytest.mark.network]


def udp_rtts(lab: WanLab, ns: str, n: int = 15) -> list[float]:
    """Round trips (ms) of 100-byte UDP datagrams from namespace `ns` to an echo at the rendezvous."""
    echo = lab.udp_socket(lab.rdv, RDV_ADDRS[0])
    client = lab.udp_socket(ns)
    out = []
    try:
        for _ in range(n):
            t0 = time.monotonic()
            client.sendto(bytes(100), echo.getsockname())
            for sock in (echo, client):
                assert select.select([sock], [], [], 2.0)[0], "a datagram was lost with no loss set"
                data, peer = sock.recvfrom(2048)
                if sock is echo:
                    echo.sendto(data, peer)
            out.append((time.monotonic() - t0) * 1000)
    finally:
        echo.close()
        client.close()
    return out


def test_each_edge_holds_its_packets_for_its_one_way_delay(wanlab: WanLab) -> None:
    site = wanlab.sites[0] if wanlab.sites else wanlab.add_site("permissive")
    wanlab.shape(Shape())
    udp_rtts(wanlab, site.host, 2)  # ARP and NAT mappings
    assert statistics.median(udp_rtts(wanlab, site.host)) < 5.0
    wanlab.shape(Shape(delay=0.020))
    rtts = udp_rtts(wanlab, site.host)
    assert min(rtts) >= 40.0 and statistics.median(rtts) < 40.0 + 5.0, rtts
    wanlab.shape(Shape(delay=0.005), {(f"s{site.index}", "rdv"): Shape(delay=0.030)})  # one direction
    rtts = udp_rtts(wanlab, site.host)
    assert min(rtts) >= 35.0 and statistics.median(rtts) < 35.0 + 5.0, rtts
    wanlab.shape(Shape())


def test_loss_drops_its_share_of_packets_on_the_edge(wanlab: WanLab) -> None:
    site = wanlab.sites[0] if wanlab.sites else wanlab.add_site("permissive")
    wanlab.shape(Shape(loss=0.2))
    sink = wanlab.udp_socket(wanlab.rdv, RDV_ADDRS[1])
    sink.setsockopt(socket.SOL_SOCKET, SO_RCVBUFFORCE, 8 << 20)  # holds all 1000
    client = wanlab.udp_socket(site.host)
    before = wanlab.counts().get(f"s{site.index}->rdv", {"lost": 0, "passed": 0})
    for _ in range(1000):
        client.sendto(bytes(50), sink.getsockname())
    time.sleep(0.3)
    got = 0
    while select.select([sink], [], [], 0)[0]:
        sink.recv(64)
        got += 1
    after = wanlab.counts()[f"s{site.index}->rdv"]
    wanlab.shape(Shape())
    sink.close()
    client.close()
    lost = after["lost"] - before["lost"]
    assert got == after["passed"] - before["passed"] == 1000 - lost
    assert 130 <= lost <= 270, lost  # 20% of 1000; 5 sigma is about +-63


@pytest_asyncio.fixture
async def rdv(wanlab: WanLab) -> AsyncIterator[RendezvousServer]:
    with netns(wanlab.rdv):
        server = await start_rendezvous(RDV_ADDRS[0], RDV_ADDRS[1])
    yield server
    await server.stop()


def member_get(ns: str, path: str) -> dict:  # type: ignore[type-arg]
    code = f"import httpx; print(httpx.get('http://{API}{path}', timeout=30).text)"
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", code]
    got = subprocess.run(cmd, capture_output=True, timeout=60)
    return json.loads(got.stdout)


ASK = f"""
import httpx, json
question = [{{"role": "user", "content": "Name three colours of the rainbow."}}]
body = {{"model": "smollm2-135m", "messages": question, "max_tokens": 24, "temperature": 0}}
print(json.dumps(httpx.post("http://{API}/v1/chat/completions", json=body, timeout=300).json()))
"""


def ask(ns: str) -> str:
    cmd = ["ip", "netns", "exec", ns, sys.executable, "-c", ASK]
    got = subprocess.run(cmd, capture_output=True, timeout=300)
    return json.loads(got.stdout)["choices"][0]["message"]["content"]


@pytest.mark.slow
async def test_a_three_member_ring_at_20_ms_one_way_answers_as_without_delay(
    wanlab: WanLab, rdv: RendezvousServer, smollm2_path: Path, tmp_path: Path
) -> None:
    """Formed with no delay (the weights come at the machine's rate), then every edge is held 20 ms
    one way: QUIC's round trip on every ring hop is 40 ms give or take a few, a decode step's circuit
    crosses three such hops, and the greedy answer is the same text as before."""
    wanlab.shape(Shape())
    sites = [wanlab.add_site("permissive") for _ in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        await form(sites, rdv, tmp_path, procs)
        plain = ask(sites[0].host)
        wanlab.shape(Shape(delay=0.020))
        ask(sites[0].host)  # QUIC's smoothed RTT takes a few samples to settle on the new delay
        delayed = ask(sites[0].host)
        assert delayed == plain and plain.strip()
        record = member_get(sites[0].host, "/traces")["traces"][-1]
        rtts = {f"{h['src']}->{h['dst']}": h["rtt_ms"] for h in record["hops"]}
        assert len(rtts) == 3 and all(38.0 <= r <= 40.0 + 8.0 for r in rtts.values()), rtts
        per_token = record["decode_s"] * 1000 / (record["completion_tokens"] - 1)
        print(
            f"20 ms one way: circuit {record['circuit_ms']:.1f} ms, {per_token:.1f} ms per token, "
            f"{per_token / record['circuit_ms']:.2f} circuits per token, hop RTTs {rtts}"
        )
        assert record["circuit_ms"] >= 3 * 20.0, record["circuit_ms"]
    finally:
        stop(procs)
