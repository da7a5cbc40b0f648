"""A member's signaling client after the rendezvous restarted (a real rendezvous, in process, stopped
and started again on the same port): the host re-opens its session under the same code, members
take their places back under the same ids, and new members join it afterwards."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from kafila.net.signaling import SignalingClient, SignalingError
from kafila.proto import signaling as sig
from kafila.proto.codes import SessionCode, new_code
from kafila.rendezvous.server import RendezvousServer, ServerConfig
from tests.net.harness import LAB_LIMITS

pytestmark = pytest.mark.network
SECRET = bytes(range(32))


async def _start(config: ServerConfig) -> RendezvousServer:
    server = RendezvousServer(config)
    await server.start()
    return server


async def _restart(rdv: RendezvousServer, secret: bytes | None = SECRET) -> RendezvousServer:
    """The same rendezvous (ports, and the kept secret unless `secret` differs) after a restart."""
    await rdv.stop()
    await asyncio.sleep(0.1)  # the UDP sockets close on the loop's next turn
    port = rdv.http_port
    again = replace(
        rdv.config, port=port, udp_port=rdv.udp.port, udp_alt_port=rdv.udp.alt_port, relay_secret=secret
    )
    return await _start(again)


async def _session_of_two() -> tuple[
    RendezvousServer, SignalingClient, SignalingClient, SessionCode, sig.Opened, sig.Joined
]:
    """A rendezvous that outlives restarts, a host "h" that opened a protected session for two, and
    a member "j" that joined it."""
    rdv = await _start(
        ServerConfig(
            host="127.0.0.1", port=0, udp_port=0, udp_alt_port=0, limits=LAB_LIMITS, relay_secret=SECRET
        )
    )
    host = await SignalingClient.connect(rdv.url)
    opened = await host.open_session("m", 2, "h", {"role": "host"})
    code = new_code(opened.session)
    await host.protect(code)
    member = await SignalingClient.connect(rdv.url)
    joined = await member.join(code, "j", {"role": "member"})
    return rdv, host, member, code, opened, joined


async def _event(client: SignalingClient, kind: type) -> sig.ServerMessage:
    while True:
        event = await client.next_event(timeout=10)
        if isinstance(event, kind):
            return event


async def test_host_and_member_register_again_with_their_ids_and_a_new_member_joins_after() -> None:
    rdv, host, member, code, opened, joined = await _session_of_two()
    assert await _event(host, sig.MemberJoined)
    try:
        rdv = await _restart(rdv)
        for client in (host, member):
            lost = await asyncio.wait_for(client.lost(), 10)
            assert lost.code == "closed"
        # the member comes back first: its session is not there until the host re-opened it
        with pytest.raises(SignalingError, match="has not re-registered it") as early:
            await member.reconnect()
        assert early.value.code == "unknown_session"
        assert host.outlives_restart is True
        await host.reconnect()
        assert (host.session, host.member) == (opened.session, opened.member)
        await member.reconnect()
        assert (member.session, member.member) == (opened.session, joined.member)
        back = await _event(host, sig.MemberUpdated)  # a member back, not a new one
        assert back.member.id == joined.member and back.member.name == "j"  # type: ignore[attr-defined]
        # signaling works again both ways, and heartbeats run on the new connection
        await member.signal(host.member, {"hello": 1})
        got = await _event(host, sig.SignalFrom)
        assert got == sig.SignalFrom(joined.member, {"hello": 1})
        assert await host.heartbeat() < 5
        # a new member joins the re-opened session with the same code, and the host hears of it
        late = await SignalingClient.connect(rdv.url)
        again = await late.join(str(code), "late", {})
        assert again.member == 3 and sorted(m.name for m in again.members) == ["h", "j", "late"]
        arrived = await _event(host, sig.MemberJoined)
        assert arrived.member.name == "late"  # type: ignore[attr-defined]
        await late.close()
    finally:
        for client in (host, member):
            await client.close()
        await rdv.stop()


async def test_a_restart_without_the_kept_secret_is_refused_and_said_so() -> None:
    rdv = await _start(ServerConfig(host="127.0.0.1", port=0, udp_port=0, udp_alt_port=0, limits=LAB_LIMITS))
    host = await SignalingClient.connect(rdv.url)
    opened = await host.open_session("m", 1, "h", {})
    await host.protect(new_code(opened.session))
    try:
        assert host.outlives_restart is False
        rdv = await _restart(rdv, secret=None)
        await asyncio.wait_for(host.lost(), 10)
        with pytest.raises(
            SignalingError, match=r"no --relay-secret-file\), so no session outlives"
        ) as refused:
            await host.reconnect()
        assert refused.value.code == "bad_ticket"
        with pytest.raises(SignalingError):  # still lost; another try is refused the same way
            await host.reconnect()
        with pytest.raises(SignalingError):
            await host.signal(1, {})
    finally:
        await host.close()
        await rdv.stop()


async def test_reconnect_while_connected_is_a_mistake_and_an_unreachable_rendezvous_raises() -> None:
    rdv = await _start(
        ServerConfig(
            host="127.0.0.1", port=0, udp_port=0, udp_alt_port=0, limits=LAB_LIMITS, relay_secret=SECRET
        )
    )
    host = await SignalingClient.connect(rdv.url)
    opened = await host.open_session("m", 1, "h", {})
    await host.protect(new_code(opened.session))
    try:
        with pytest.raises(RuntimeError, match="not lost"):
            await host.reconnect()
        await rdv.stop()
        await asyncio.wait_for(host.lost(), 10)
        with pytest.raises(OSError):
            await host.reconnect()  # nothing listens on the port now
    finally:
        await host.close()


async def test_a_member_that_took_over_from_the_lost_host_reopens_the_session_after_a_restart() -> None:
    """The host leaves; a member takes its place (`succeed`), gets the session's ticket, and after
    a restart re-opens the session as its host; the old host cannot, and a member joins through
    the new host with the same code."""
    rdv, host, member, code, opened, joined = await _session_of_two()
    try:
        with pytest.raises(SignalingError, match="is still connected") as present:
            await member.succeed(code)
        assert present.value.code == "member_present"
        await host.close()  # killed: its connection closes
        await _event(member, sig.MemberLeft)
        took = await member.succeed(code)
        assert [(m.id, m.host) for m in took.members] == [(joined.member, True)]
        assert member.place is not None and member.place.host and member.place.ticket is not None
        rdv = await _restart(rdv)
        await asyncio.wait_for(member.lost(), 10)
        await member.reconnect()  # as the host: re-opens the session
        assert (member.session, member.member) == (opened.session, joined.member)
        late = await SignalingClient.connect(rdv.url)
        again = await late.join(str(code), "late", {})
        assert [m.name for m in again.members if m.host] == ["j"]
        await late.close()
    finally:
        await member.close()
        await rdv.stop()
