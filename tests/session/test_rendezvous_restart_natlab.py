"""A session across the NAT lab (root: real netfilter in namespaces) whose edge between two
restrictive members goes through the relay, while the rendezvous restarts quickly with the same
kept secret on the same addresses and ports: the relayed edge carries on (the restarted relay
takes its channel back), every member registers the session again, and a member at the far end of
the relayed edge still answers through the ring."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kafila.rendezvous.server import RendezvousServer, ServerConfig
from tests.natlab.lab import RDV_ADDRS, Lab, netns
from tests.net.harness import LAB_LIMITS
from tests.session.test_session_natlab import asks_paris, spawn, stop, wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.network]
API = "127.0.0.1:11434"


async def _serve(config: ServerConfig, ns: str) -> RendezvousServer:
    server = RendezvousServer(config)
    with netns(ns):
        await server.start()
    return server


async def test_a_relayed_edge_across_nats_serves_on_across_a_quick_rendezvous_restart(
    natlab: Lab, smollm2_path, tmp_path
) -> None:
    config = ServerConfig(
        host=RDV_ADDRS[0], port=0, udp_port=0, udp_alt_port=0, udp_alt_host=RDV_ADDRS[1], limits=LAB_LIMITS,
        relay_secret=bytes(range(32)),
    )  # fmt: skip
    rdv = await _serve(config, natlab.rdv)
    again_config = replace(config, port=rdv.http_port, udp_port=rdv.udp.port, udp_alt_port=rdv.udp.alt_port)
    sites = [natlab.add_site("permissive"), natlab.add_site("restrictive"), natlab.add_site("restrictive")]
    names = ["alpha", "beta", "gamma"]
    logs = [tmp_path / f"{n}.log" for n in names]
    code_file = tmp_path / "code"
    common = ["--rendezvous", rdv.url, "--api", API]
    hosting = ["host", "--model", "smollm2-135m", "--members", "3", "--name", "alpha", "--context", "512"]
    procs = [spawn(sites[0].host, [*hosting, "--code-file", str(code_file), *common], logs[0])]
    again: RendezvousServer | None = None
    try:
        await wait_for(code_file.exists, 120, "session code", procs)
        code = code_file.read_text().strip()
        for site, name, log in zip(sites[1:], names[1:], logs[1:], strict=True):
            procs.append(spawn(site.host, ["join", code, "--name", name, *common], log))
        await wait_for(lambda: "session ready" in logs[0].read_text(), 300, "session ready", procs)
        assert ": relay" in "".join(log.read_text() for log in logs), "no edge went through the relay"
        await rdv.stop()
        await asyncio.sleep(0.5)  # the restart's gap: the relayed edge is silent meanwhile
        again = await _serve(again_config, natlab.rdv)
        back = "kafila: back at the rendezvous after "
        await wait_for(lambda: all(back in log.read_text() for log in logs), 60, "registered again", procs)
        assert again.relay.totals.recovered >= 1
        for site in sites[1:]:  # the two ends of the relayed edge answer through the ring
            await asks_paris(site.host)
        text = "".join(log.read_text() for log in logs)
        assert "the ring is broken" not in text
    finally:
        stop(procs)
        if again is not None:
            await again.stop()
