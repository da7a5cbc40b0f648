"""The same session across the NAT lab (real Linux netfilter in network namespaces; root): three
`kafila` member processes behind a permissive and two restrictive (symmetric) routers, so the edge
between the two restrictive members cannot punch and goes through the rendezvous's relay. The
session forms, one edge is relayed, and a member that is not the head answers through the ring."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from kafila.rendezvous.server import RendezvousServer
from tests.natlab.lab import RDV_ADDRS, Lab, netns
from tests.natlab.members import API, form, spawn, stop, wait_for
from tests.net.harness import start_rendezvous

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.network]
ASK = f"""
import httpx, json
question = [{{"role": "user", "content": "What is the capital of France?"}}]
body = {{"model": "smollm2-135m", "messages": question, "max_tokens": 20, "temperature": 0}}
r = httpx.post("http://{API}/v1/chat/completions", json=body, timeout=120)
print(json.dumps(r.json()))
"""


@pytest_asyncio.fixture
async def rdv(natlab: Lab) -> AsyncIterator[RendezvousServer]:
    with netns(natlab.rdv):
        server = await start_rendezvous(RDV_ADDRS[0], RDV_ADDRS[1])
    yield server
    await server.stop()


async def asks_paris(ns: str) -> None:
    """The member in namespace `ns` answers the capital question through its own API."""
    asked = await asyncio.to_thread(
        subprocess.run,
        ["ip", "netns", "exec", ns, sys.executable, "-c", ASK],
        capture_output=True,
        timeout=180,
    )
    answer = json.loads(asked.stdout)
    assert "Paris" in answer["choices"][0]["message"]["content"], answer


async def test_session_across_nats_with_a_relayed_edge(natlab: Lab, rdv, smollm2_path, tmp_path) -> None:
    sites = [natlab.add_site("permissive"), natlab.add_site("restrictive"), natlab.add_site("restrictive")]
    names = ["alpha", "beta", "gamma"]
    logs = [tmp_path / f"{n}.log" for n in names]
    code_file = tmp_path / "code"
    common = ["--rendezvous", rdv.url, "--api", API, "--context", "512"]
    procs = [spawn(sites[0].host, ["host", "--model", "smollm2-135m", "--members", "3", "--name", "alpha",
                                   "--code-file", str(code_file), *common], logs[0])]  # fmt: skip
    try:
        await wait_for(code_file.exists, 120, "session code", procs)
        code = code_file.read_text().strip()
        for site, name, log in zip(sites[1:], names[1:], logs[1:], strict=True):
            join = ["join", code, "--name", name, *[a for a in common if a != "--context" and a != "512"]]
            procs.append(spawn(site.host, join, log))
        await wait_for(lambda: "session ready" in logs[0].read_text(), 300, "session ready", procs)
        text = "".join(log.read_text() for log in logs)
        assert ": relay" in text, "no edge went through the relay"
        assert ": direct" in text
        await asks_paris(sites[1].host)
    finally:
        stop(procs)


async def test_a_direct_edge_cut_mid_session_goes_on_over_the_relay_before_the_ring_gives_up(
    natlab: Lab, rdv, smollm2_path, tmp_path
) -> None:
    """Two members behind permissive routers link directly; then both routers drop the direct path
    (simulated: nft rules, as a route or NAT change would). The link must fall back to the relay
    within the ring's default bound (--lost-after, 3 s): it used to take 7.2 s and the request failed."""
    sites = [natlab.add_site("permissive"), natlab.add_site("permissive")]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        logs = await form(sites, rdv, tmp_path, procs)
        assert "link alpha <-> beta: direct" in logs[0].read_text()
        natlab.block_direct(sites[0], sites[1])
        await asks_paris(sites[1].host)
        text = "".join(log.read_text() for log in logs)
        assert "direct path silent for" in text and "ring is broken" not in text
    finally:
        natlab.unblock_all()
        stop(procs)


def session_doc(ns: str) -> dict:  # type: ignore[type-arg]
    """The /session document of the member in namespace `ns`."""
    code = f"import httpx; print(httpx.get('http://{API}/session', timeout=10).text)"
    got = subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-c", code], capture_output=True, timeout=60
    )
    return json.loads(got.stdout)  # type: ignore[no-any-return]


async def test_a_member_to_member_edge_that_moves_to_the_relay_while_serving_is_priced_so_by_the_host(
    natlab: Lab, rdv, smollm2_path, tmp_path
) -> None:
    """Three members behind permissive routers, every edge direct; then the two that are not the
    host lose their direct path (simulated: nft rules, as a route change would). Their link rides
    on the relay; once that has held past the settle time (kafila.session.forming.paths), they tell
    the host, which re-prices the ring with it (three members: no order avoids the edge, so the
    plan is corrected, not re-planned) and shows the edge relayed in its /session. Unblocked, the
    link re-punches and the host hears it is direct again. Before this, the host only ever knew
    its own links' paths."""
    sites = [natlab.add_site("permissive") for _ in range(3)]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        logs = await form(sites, rdv, tmp_path, procs)
        assert all(link["path"] == "direct" for link in session_doc(sites[0].host)["links"])
        natlab.block_direct(sites[1], sites[2])
        cut = time.monotonic()
        said = "plan corrected with the measured paths: "
        relayed = ("beta->gamma runs through the relay", "gamma->beta runs through the relay")
        await wait_for(
            lambda: any(said + r in logs[0].read_text() for r in relayed), 40, "relay priced", procs
        )
        print(f"host re-priced the edge {time.monotonic() - cut:.1f} s after the cut")
        doc = session_doc(sites[0].host)
        link = next(k for k in doc["links"] if set(k["edge"].split("->")) == {"beta", "gamma"})
        assert link["path"] == "relay" and link["measured_by"] in ("beta", "gamma"), doc["links"]
        chosen = doc["plan"]["chosen"]["edges"]
        assert not next(e for e in chosen if {e["src"], e["dst"]} == {"beta", "gamma"})["direct"], chosen
        await asks_paris(sites[2].host)  # served over the relayed edge
        natlab.unblock_all()
        again = ("beta->gamma runs direct again", "gamma->beta runs direct again")
        await wait_for(lambda: any(r in logs[0].read_text() for r in again), 60, "direct again", procs)
        links = session_doc(sites[0].host)["links"]
        assert next(k for k in links if k["edge"] == link["edge"])["path"] == "direct", links
    finally:
        natlab.unblock_all()
        stop(procs)
