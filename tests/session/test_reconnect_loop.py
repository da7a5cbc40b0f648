"""The loop that takes a formed member back to a rendezvous it lost (kafila.session.forming.reconnect),
with real signaling clients and a real rendezvous stopped and started again in process: retries
until registered (a member whose host comes back later), and gives up, saying why, on a refusal
no retry mends (a rendezvous restarted without its kept secret)."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest

from kafila.net.backoff import Backoff
from kafila.net.signaling import SignalingClient
from kafila.proto.codes import new_code
from kafila.rendezvous.server import RendezvousServer, ServerConfig
from kafila.session.forming import reconnect
from tests.net.harness import LAB_LIMITS

pytestmark = pytest.mark.network
FAST = Backoff(0.02, 0.2)


async def _rendezvous(secret: bytes | None, like: RendezvousServer | None = None) -> RendezvousServer:
    config = ServerConfig(host="127.0.0.1", port=0, udp_port=0, udp_alt_port=0, limits=LAB_LIMITS)
    if like is not None:  # the same one restarted: its ports
        config = replace(
            like.config, port=like.http_port, udp_port=like.udp.port, udp_alt_port=like.udp.alt_port
        )
    server = RendezvousServer(replace(config, relay_secret=secret))
    await server.start()
    return server


async def _session(rdv: RendezvousServer) -> tuple[SignalingClient, SignalingClient]:
    host = await SignalingClient.connect(rdv.url)
    code = new_code((await host.open_session("m", 2, "h", {})).session)
    await host.protect(code)
    member = await SignalingClient.connect(rdv.url)
    await member.join(code, "j", {})
    return host, member


async def test_a_member_retries_until_its_host_has_re_opened_and_says_one_line_each_way(monkeypatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(reconnect, "say", said.append)
    secret = bytes(range(32))
    rdv = await _rendezvous(secret)
    host, member = await _session(rdv)
    await rdv.stop()
    await asyncio.sleep(0.1)
    for client in (host, member):
        await asyncio.wait_for(client.lost(), 10)
    again = await _rendezvous(secret, like=rdv)
    status: dict[str, Any] = {"url": rdv.url, "state": "connected"}
    try:
        back = asyncio.ensure_future(reconnect.back_to_rendezvous(member, status, "it went", {}, FAST))
        for _ in range(200):  # the member's tries meet a rendezvous that does not know its session yet
            if "has not re-registered it" in str(status.get("reason")):
                break
            await asyncio.sleep(0.02)
        assert status["state"] == "reconnecting" and status["attempt"] >= 1, status
        assert status["reason"].endswith("(unknown_session)"), status
        host_status: dict[str, Any] = {}
        assert await reconnect.back_to_rendezvous(host, host_status, "it went", {}, FAST)
        assert await asyncio.wait_for(back, 10)
        assert (
            status["state"] == "connected" and status["reconnects"] == 1 and status["last_lost"] == "it went"
        )
        assert "attempt" not in status and "reason" not in status
        assert all(line.startswith("lost the rendezvous: it went.") for line in said[:2]), said
        assert all(line.startswith("back at the rendezvous after ") for line in said[2:]), said
        assert len(said) == 4  # lost, lost, back, back: not one line per attempt
    finally:
        for client in (host, member):
            await client.close()
        await again.stop()


async def test_a_host_refused_for_good_stops_and_says_why(monkeypatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(reconnect, "say", said.append)
    rdv = await _rendezvous(None)  # a new secret at each start
    host, member = await _session(rdv)
    await rdv.stop()
    await asyncio.sleep(0.1)
    await asyncio.wait_for(host.lost(), 10)
    again = await _rendezvous(None, like=rdv)
    status: dict[str, Any] = {}
    try:
        assert not await reconnect.back_to_rendezvous(host, status, "it went", {}, FAST)
        assert status["state"] == "lost" and status["reason"].endswith("(bad_ticket)"), status
        assert said[-1].startswith("the rendezvous would not take this member back: cannot re-open session")
        assert "no --relay-secret-file" in said[-1] and "this member no longer reconnects" in said[-1]
    finally:
        for client in (host, member):
            await client.close()
        await again.stop()
