"""The signaling service end to end: real server on loopback, the member-side client, raw sockets."""

from __future__ import annotations

import asyncio
import gc
import json
import time
from typing import Any

import httpx
import pytest
import structlog
from websockets.asyncio.client import connect
from websockets.asyncio.server import ServerConnection, serve
from websockets.exceptions import ConnectionClosed

from kafila.net.signaling import SignalingClient, SignalingClosed, SignalingError
from kafila.proto import signaling as sig
from tests.rendezvous.conftest import Factory, open_protected, raw_join

pytestmark = pytest.mark.network
CAP = {"bandwidth_gbs": 20.0, "memory_gb": 16}


async def test_open_join_signal_update_leave(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    host = await SignalingClient.connect(server.url)
    opened, code = await open_protected(host, "smollm2-135m", 2, "laptop", CAP, nat={"class": "ordinary"})
    assert opened.member == 1 and opened.probe_port == server.udp.port
    assert opened.probe_alt_host == "127.0.0.2"
    member = await SignalingClient.connect(server.url)
    joined = await member.join(code, "desktop", {"memory_gb": 8})
    assert [(m.id, m.name, m.nat) for m in joined.members] == [
        (1, "laptop", {"class": "ordinary"}),
        (2, "desktop", None),
    ]
    event = await host.next_event(2.0)
    assert isinstance(event, sig.MemberJoined) and event.member.name == "desktop"

    await member.signal(1, {"kind": "candidates", "addrs": ["10.0.0.2:4000"]})
    assert await host.next_event(2.0) == sig.SignalFrom(2, {"kind": "candidates", "addrs": ["10.0.0.2:4000"]})
    await member.update(candidates=["203.0.113.5:4000"])
    for client in (host, member):
        upd = await client.next_event(2.0)
        assert isinstance(upd, sig.MemberUpdated) and upd.member.candidates == ["203.0.113.5:4000"]
    assert await member.heartbeat() < 2.0

    await member.close()
    assert await host.next_event(2.0) == sig.MemberLeft(2, "left")
    await host.close()
    await asyncio.sleep(0.1)
    assert server.registry is not None and server.registry.sessions == {}


async def test_wrong_code_and_rate_limit_surface_as_errors(start_rendezvous: Factory) -> None:
    server = await start_rendezvous(join_burst_per_address=2, join_rate_per_address=0.001)
    client = await SignalingClient.connect(server.url)
    for _ in range(2):
        with pytest.raises(SignalingError, match="unknown_session: no open session with code 9-zzzz"):
            await client.join("9-zzzz-tiger-lamp-ocean", "guesser", {})
    with pytest.raises(SignalingError, match="rate_limited") as info:
        await client.join("9-zzzz-tiger-lamp-ocean", "guesser", {})
    assert info.value.code == "rate_limited"
    await client.close()


async def test_malformed_and_oversized_frames_get_clear_errors(start_rendezvous: Factory) -> None:
    server = await start_rendezvous(max_bad_frames=3)
    async with connect(server.url) as ws:
        await ws.send("{not json")
        err = sig.decode_server(await ws.recv())
        assert isinstance(err, sig.Error) and err.code == "bad_message" and not err.fatal
        await ws.send(
            json.dumps({"v": sig.VERSION, "type": "signal", "to": 1, "payload": {"x": "y" * 70_000}})
        )
        err = sig.decode_server(await ws.recv())
        assert isinstance(err, sig.Error) and err.code == "too_large" and "65536" in err.message
        await ws.send(b"\x00binary")
        err = sig.decode_server(await ws.recv())
        assert isinstance(err, sig.Error) and "binary frames" in err.message and err.fatal
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008
    async with connect(server.url, max_size=None) as ws:  # beyond the transport limit: closed 1009
        await ws.send("x" * (4 * 65536 + 1))
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009


async def test_a_request_the_rendezvous_cannot_read_fails_at_once_not_by_timeout(
    start_rendezvous: Factory,
) -> None:
    server = await start_rendezvous()
    client = await SignalingClient.connect(server.url)
    started = time.monotonic()
    with pytest.raises(SignalingError, match="members_expected: 0 is below the minimum 1") as info:
        await client.open_session("m", 0, "host", CAP, timeout=30)
    assert info.value.code == "bad_message" and time.monotonic() - started < 5
    await client.close()


async def test_member_whose_socket_dies_is_reported_disconnected(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    host = await SignalingClient.connect(server.url)
    _opened, code = await open_protected(host, "m", 3, "host", CAP)
    ws = await connect(server.url)
    assert isinstance(await raw_join(ws, code, "doomed"), sig.Joined)
    ws.transport.abort()  # no close frame, no leave
    await host.next_event(2.0)  # member_joined
    assert await host.next_event(5.0) == sig.MemberLeft(2, "disconnected")
    await host.close()


async def test_member_that_goes_silent_is_timed_out(start_rendezvous: Factory) -> None:
    # the client beats every 0.1 s; 2 s leave the raw member time for its join key (scrypt)
    server = await start_rendezvous(heartbeat_s=0.1, heartbeat_timeout_s=2.0)
    host = await SignalingClient.connect(server.url)
    _opened, code = await open_protected(host, "m", 3, "host", CAP)
    # a raw member that never sends another frame (its TCP connection stays up)
    async with connect(server.url) as ws:
        assert isinstance(await raw_join(ws, code, "silent"), sig.Joined)
        await host.next_event(2.0)  # member_joined
        left = await host.next_event(5.0)
        assert left == sig.MemberLeft(2, "timed_out")
        err = sig.decode_server(await asyncio.wait_for(ws.recv(), 2.0))
        assert isinstance(err, sig.Error) and err.code == "timed_out" and err.fatal
    await host.close()


async def test_fatal_close_reaches_the_client_as_signaling_closed(start_rendezvous: Factory) -> None:
    server = await start_rendezvous(code_ttl_s=0.3)
    host = await SignalingClient.connect(server.url)
    await host.open_session("m", 2, "lonely", CAP)
    event = await host.next_event(5.0)
    assert isinstance(event, sig.Error) and event.code == "code_expired"
    with pytest.raises(SignalingClosed):
        await host.next_event(5.0)
    with pytest.raises(SignalingClosed):
        await host.signal(1, {})
    await host.close()


async def test_a_connection_refused_with_1013_fails_the_request_and_leaves_no_unretrieved_future(
    start_rendezvous: Factory,
) -> None:
    # The rendezvous refuses a connection over its limit with close code 1013; a request sent on it
    # failed twice (the send, and the reply's future set by the reader) and asyncio printed "Future
    # exception was never retrieved ... SignalingClosed" for the second.
    server = await start_rendezvous(max_connections=1)
    host = await SignalingClient.connect(server.url)
    _opened, code = await open_protected(host, "m", 2, "host", CAP)
    unhandled: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unhandled.append(context))
    for _ in range(3):
        refused = await SignalingClient.connect(server.url)
        with pytest.raises(SignalingClosed, match="1013"):
            await refused.join(code, "one too many", CAP)
        await refused.close()
        del refused
        gc.collect()
    assert [c.get("message") for c in unhandled] == []
    await host.close()


async def test_a_heartbeat_without_answer_is_logged_naming_the_timeout() -> None:
    # A rendezvous that stops answering (a partition) made the heartbeat time out with a
    # TimeoutError, whose text is empty: `heartbeat_failed error=` said nothing.
    async def mute(ws: ServerConnection) -> None:
        async for frame in ws:
            msg = sig.decode_client(frame)
            if isinstance(msg, sig.Open):
                await ws.send(sig.encode(sig.Opened("2-abcd", 1, 600.0, 0.05, ref=msg.ref)))

    async with serve(mute, "127.0.0.1", 0) as rdv:
        port = rdv.sockets[0].getsockname()[1]
        client = await SignalingClient.connect(f"ws://127.0.0.1:{port}/v1/signal")
        with structlog.testing.capture_logs() as logs:
            await client.open_session("m", 2, "host", CAP)
            await asyncio.sleep(0.3)
        await client.close()
    failed = [e for e in logs if e["event"] == "heartbeat_failed"]
    assert failed and failed[0]["error"] == "no heartbeat_ack within 0.1 s"


async def test_healthz_and_metrics(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    host = await SignalingClient.connect(server.url)
    _opened, code = await open_protected(host, "m", 3, "h", CAP)
    guest = await SignalingClient.connect(server.url)
    await guest.join(code, "g", CAP)
    with pytest.raises(SignalingError):
        await SignalingClient.join(guest, "9-zzzz-tiger-lamp-ocean", "g2", CAP)  # already in a session
    base = f"http://127.0.0.1:{server.http_port}"
    async with httpx.AsyncClient() as http:
        health = (await http.get(base + "/healthz")).json()
        text = (await http.get(base + "/metrics")).text
    assert health == {"status": "ok", "sessions": 1, "members": 2, "udp_port": server.udp.port}
    assert "kafila_rendezvous_sessions 1.0" in text
    assert "kafila_rendezvous_members 2.0" in text
    assert 'kafila_rendezvous_joins_total{outcome="ok"} 1.0' in text
    assert 'kafila_rendezvous_joins_total{outcome="already_in_session"} 1.0' in text
    assert "kafila_rendezvous_relay_channels 0.0" in text
    await guest.close()
    await host.close()


async def test_a_bug_in_the_core_is_reported_and_the_connection_survives(
    start_rendezvous: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Simulated bug: the registry raises on `update`; the member gets an `internal` error."""
    server = await start_rendezvous()
    assert server.registry is not None
    honest = server.registry.receive

    def broken(conn: int, msg: sig.ClientMessage, now: float) -> list:  # type: ignore[type-arg]
        if isinstance(msg, sig.Update):
            raise KeyError("simulated")
        return honest(conn, msg, now)

    monkeypatch.setattr(server.registry, "receive", broken)
    async with connect(server.url) as ws:
        await ws.send(sig.encode(sig.Update()))
        err = sig.decode_server(await ws.recv())
        assert isinstance(err, sig.Error) and err.code == "internal" and "'update'" in err.message
        await ws.send(sig.encode(sig.Heartbeat("still-here")))
        assert sig.decode_server(await ws.recv()) == sig.HeartbeatAck("still-here")


async def test_host_removes_a_member_who_is_closed_and_whose_place_takes_a_new_join(
    start_rendezvous: Factory,
) -> None:
    server = await start_rendezvous(max_members=3)  # formed at 3, so the cap is what is full
    host = await SignalingClient.connect(server.url)
    opened, code = await open_protected(host, "m", 3, "host", CAP)
    honest = await SignalingClient.connect(server.url)
    await honest.join(code, "honest", CAP)
    guesser = await SignalingClient.connect(server.url)
    await guesser.join(code, "guesser", CAP)
    late = await SignalingClient.connect(server.url)
    with pytest.raises(SignalingError, match="session_full"):
        await late.join(code, "late", CAP)
    unhandled: list[dict[str, Any]] = []
    asyncio.get_running_loop().set_exception_handler(lambda _loop, context: unhandled.append(context))
    for _ in range(2):
        await host.next_event(2.0)  # member_joined
    await honest.next_event(2.0)  # member_joined (the guesser)

    await host.remove(3, "wrong secret word")
    err = await guesser.next_event(2.0)
    assert err == sig.Error(
        "removed",
        f"the host removed this member from session {opened.session}: wrong secret word",
        fatal=True,
    )
    with pytest.raises(SignalingClosed, match="the host removed this member"):
        await guesser.next_event(2.0)
    why = await asyncio.wait_for(guesser.lost(), 2.0)
    assert (
        why.message
        == (  # it read "... (WebSocket close 1000: removed by the host) after error removed: ..."
            f"the host removed this member from session {opened.session}: wrong secret word "
            "(the rendezvous closed the connection)"
        )
    )
    with pytest.raises(SignalingClosed):
        await guesser.signal(1, {})
    assert await host.next_event(2.0) == sig.MemberLeft(3, "removed")
    assert await honest.next_event(2.0) == sig.MemberLeft(3, "removed")

    joined = await late.join(code, "late", CAP)  # the same code, a place free again
    assert [m.name for m in joined.members] == ["host", "honest", "late"]
    base = f"http://127.0.0.1:{server.http_port}"
    async with httpx.AsyncClient() as http:
        text = (await http.get(base + "/metrics")).text
    assert 'kafila_rendezvous_members_left_total{reason="removed"} 1.0' in text
    for client in (guesser, late, honest, host):
        await client.close()
    gc.collect()
    assert unhandled == []


async def test_only_the_host_may_remove_a_member(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    host = await SignalingClient.connect(server.url)
    _opened, code = await open_protected(host, "m", 3, "host", CAP)
    members = [await SignalingClient.connect(server.url) for _ in range(2)]
    for i, member in enumerate(members):
        await member.join(code, f"m{i}", CAP)
    await members[0].next_event(2.0)  # member_joined
    for _ in range(2):
        await host.next_event(2.0)

    await members[0].remove(3, "not the host")
    err = await members[0].next_event(2.0)
    assert isinstance(err, sig.Error) and err.code == "not_host" and not err.fatal
    for target in (1, 9):
        await host.remove(target, "x")
        err = await host.next_event(2.0)
        assert isinstance(err, sig.Error) and err.code == "unknown_member" and not err.fatal
    assert await members[1].heartbeat() < 2.0  # still connected
    assert server.registry is not None
    assert [sorted(s.members) for s in server.registry.sessions.values()] == [[1, 2, 3]]
    await host.remove(3, "a link error that names everything: " + "x" * 300)  # longer than the wire takes
    err = await members[1].next_event(2.0)
    assert isinstance(err, sig.Error) and err.code == "removed" and err.message.endswith("x…")
    for client in (*members, host):
        await client.close()


async def test_a_member_of_signaling_version_1_is_told_in_its_own_version_to_upgrade(
    start_rendezvous: Factory,
) -> None:
    server = await start_rendezvous()
    async with connect(server.url) as ws:
        await ws.send(
            json.dumps(
                {"v": 1, "type": "join", "session": "4-k7m2", "name": "old", "capability": {}, "ref": "r1"}
            )
        )
        said = json.loads(await ws.recv())
        with pytest.raises(ConnectionClosed) as closed:
            await ws.recv()
    assert said["v"] == 1 and said["type"] == "error" and said["code"] == "unsupported_version"
    assert said["fatal"] and said["ref"] == "r1"
    assert (
        "version 1 is not supported: this side speaks version 2; upgrade kafila on the member"
        in said["message"]
    )
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1002
