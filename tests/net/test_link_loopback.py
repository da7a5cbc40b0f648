"""Links over real UDP sockets on loopback: messages, authentication, closing and timeouts."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from kafila.net.auth import EdgeContext
from kafila.net.endpoint import Address, UdpEndpoint
from kafila.net.errors import LinkAuthError, LinkClosed, LinkEnded, LinkTimeout, PeerSilent
from kafila.net.link import (
    LinkConfig,
    PathKind,
    RebindReason,
    RecentDatagrams,
    copies,
    own_stall,
    relay_rebind_due,
)
from tests.net.conftest import direct_pair

pytestmark = pytest.mark.network


async def test_messages_arrive_in_order_with_kinds_and_sizes(linked) -> None:
    client, server = linked
    big = os.urandom(3 * 1024 * 1024 + 17)  # a tensor frame larger than one flow-control window
    sent = [(16, b""), (17, b"x" * 8192), (300, big), (16, b"last")]
    for kind, payload in sent:
        await client.send(kind, payload)
    got = [await server.recv(timeout=20) for _ in sent]
    assert got == sent
    await server.send(20, b"reply")
    assert await client.recv(timeout=5) == (20, b"reply")
    stats = client.stats()
    assert stats.path is PathKind.DIRECT
    assert stats.messages_sent == 4 and stats.bytes_sent == sum(len(p) for _, p in sent)
    assert stats.messages_received == 1 and stats.smoothed_rtt > 0
    assert server.stats().bytes_received == stats.bytes_sent


async def test_reserved_kinds_are_refused(linked) -> None:
    client, _ = linked
    with pytest.raises(ValueError, match="reserved"):
        await client.send(1, b"spoofed auth")


@pytest.mark.parametrize(
    ("client_view", "server_view"),
    [
        # a member with the wrong code
        (EdgeContext("S", "alice", "bob", b"secret-1"), EdgeContext("S", "alice", "bob", b"secret-2")),
        # a rendezvous that swapped identities: the server believes it links carol, not alice
        (EdgeContext("S", "alice", "bob", b"secret"), EdgeContext("S", "carol", "bob", b"secret")),
        # ... or the client was pointed at dave while it asked for bob
        (EdgeContext("S", "alice", "bob", b"secret"), EdgeContext("S", "alice", "dave", b"secret")),
        # the same secret used in another session
        (EdgeContext("S", "alice", "bob", b"secret"), EdgeContext("T", "alice", "bob", b"secret")),
    ],
)
async def test_link_fails_closed_without_matching_secret_and_identities(client_view, server_view) -> None:
    client, server, a, b = await direct_pair(client_view, server_view)
    try:
        results = await asyncio.gather(client.wait_ready(), server.wait_ready(), return_exceptions=True)
        assert all(isinstance(r, LinkAuthError) for r in results), results
        with pytest.raises(LinkAuthError):
            await client.send(16, b"never sent")
        with pytest.raises(LinkAuthError):
            await server.recv(timeout=1)
    finally:
        a.close()
        b.close()


async def test_close_surfaces_as_link_closed_on_both_sides(linked) -> None:
    client, server = linked
    await client.send(16, b"before close")
    await asyncio.sleep(0.2)
    await client.close("test is done")
    assert await server.recv(timeout=5) == (16, b"before close")  # delivered before the close
    with pytest.raises(LinkClosed, match="test is done"):
        await server.recv(timeout=5)
    with pytest.raises(LinkClosed):
        await server.send(16, b"after close")
    with pytest.raises(LinkClosed):
        await client.send(16, b"after close")


async def test_a_close_that_ends_the_session_reaches_the_peer_as_link_ended(linked) -> None:
    client, server = linked
    assert server.error is None
    await client.close("the host ended the session", ended=True)
    with pytest.raises(LinkEnded, match="closed by the peer: the host ended the session"):
        await server.recv(timeout=5)
    assert isinstance(server.error, LinkEnded) and isinstance(client.error, LinkEnded)


async def test_the_peer_s_close_is_noticed_when_it_arrives_not_after_draining(linked) -> None:
    """aioquic reports a received CONNECTION_CLOSE only after its draining period (3 PTOs: 0.1-0.7 s
    measured between members on this VM); the link fails as soon as the close is read."""
    from aioquic.quic.connection import QuicConnectionState

    client, server = linked
    await client.close("done", ended=True)
    for _ in range(200):
        if server.error is not None:
            break
        await asyncio.sleep(0.005)
    assert isinstance(server.error, LinkEnded)
    assert server._quic is not None and server._quic._state is QuicConnectionState.DRAINING


async def test_an_ordinary_close_is_not_an_ending(linked) -> None:
    client, server = linked
    await client.close("session ended")
    with pytest.raises(LinkClosed):
        await server.recv(timeout=5)
    assert not isinstance(server.error, LinkEnded)


async def test_recv_timeout_raises_link_timeout(linked) -> None:
    _, server = linked
    with pytest.raises(LinkTimeout, match=r"0\.2 s"):
        await server.recv(timeout=0.2)


async def test_handshake_with_nobody_answering_times_out() -> None:
    ctx = EdgeContext("S", "alice", "bob", b"secret")
    client, _server, a, b = await direct_pair(ctx, ctx, LinkConfig(handshake_timeout=0.5))
    b.close()  # the server's socket is gone: nothing ever answers
    try:
        with pytest.raises(LinkTimeout, match=r"not authenticated within 0\.5 s"):
            await client.wait_ready()
    finally:
        a.close()


async def test_a_peer_that_vanishes_surfaces_as_link_timeout_not_a_hang() -> None:
    ctx = EdgeContext("S", "alice", "bob", b"secret")
    config = LinkConfig(keepalive=0.1, dead_after=0.3, peer_timeout=0.6)
    client, server, a, b = await direct_pair(ctx, ctx, config)
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        b.close()  # bob's machine is gone without a word
        with pytest.raises(PeerSilent, match="nothing received on any path"):
            await client.recv(timeout=5)
        with pytest.raises(LinkClosed):  # PeerSilent is both a LinkTimeout and a LinkClosed
            await client.send(16, b"too late")
        assert client.closed
    finally:
        a.close()
        await server.close()


async def until(done, within: float = 5.0) -> bool:
    """Whether `done()` came true within `within` seconds (polled every 10 ms)."""
    for _ in range(int(within / 0.01)):
        if done():
            return True
        await asyncio.sleep(0.01)
    return bool(done())


async def packet_size(link, size: int, within: float = 5.0) -> None:
    """Until `link` builds packets of `size` bytes (its path probe has answered)."""
    if not await until(lambda: link.datagram_size == size, within):
        raise AssertionError(f"packets of {link.datagram_size} bytes, not {size}, after {within} s")


async def test_a_direct_path_on_one_machine_carries_the_largest_probed_packets(linked) -> None:
    client, server = linked
    await packet_size(client, 16000)
    await packet_size(server, 16000)
    before = client.stats().datagrams_direct
    payload = os.urandom(1 << 20)
    await client.send(16, payload)
    assert await server.recv(timeout=20) == (16, payload)
    sent = client.stats().datagrams_direct - before
    assert sent < len(payload) / 8000  # ~70 packets, where 1200-byte packets take ~900
    assert client.stats().datagram_size == 16000


async def test_without_probe_sizes_packets_stay_at_the_quic_minimum() -> None:
    ctx = EdgeContext("S-loop", "alice", "bob", b"correct horse")
    client, server, a, b = await direct_pair(ctx, ctx, LinkConfig(probe_sizes=()))
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        payload = os.urandom(1 << 20)
        await client.send(16, payload)
        assert await server.recv(timeout=20) == (16, payload)
        assert client.stats().datagrams_direct > len(payload) / 1200
        assert client.datagram_size == server.datagram_size == 1200
    finally:
        await client.close()
        await server.close()
        a.close()
        b.close()


async def test_a_lone_message_waits_for_its_ack_until_asked_and_a_second_one_is_acked_at_once() -> None:
    """RFC 9000 13.2: the ACK of one packet may wait (`ack_delay`, 25 ms; a ring stage asks for it
    once its output has left); a second ack-eliciting packet is acknowledged at once."""
    ctx = EdgeContext("S-loop", "alice", "bob", b"correct horse")
    quiet = LinkConfig(probe_sizes=(), keepalive=60.0)  # no probes or PINGs in between
    client, server, a, b = await direct_pair(ctx, ctx, quiet)
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        await asyncio.sleep(0.1)  # the handshake's and authentication's ACKs are done

        acks = server.stats().datagrams_direct
        await client.send(16, b"one frame")
        assert await server.recv(timeout=5) == (16, b"one frame")
        assert server.stats().datagrams_direct == acks  # its ACK waits
        assert client.unacknowledged() > 0
        server.acknowledge()
        assert server.stats().datagrams_direct == acks + 1  # sent now
        server.acknowledge()
        assert server.stats().datagrams_direct == acks + 1  # nothing more waited
        assert await until(lambda: client.unacknowledged() == 0)

        await client.send(16, b"first")
        await client.send(16, b"second")  # each send is its own packet
        assert [await server.recv(timeout=5) for _ in range(2)] == [(16, b"first"), (16, b"second")]
        assert server.stats().datagrams_direct == acks + 2  # one ACK for both, without being asked

        await client.send(16, b"alone")
        await server.recv(timeout=5)
        received = time.perf_counter()
        await asyncio.sleep(0.005)
        if time.perf_counter() - received < 0.02:  # (unless this machine stalled the loop meanwhile)
            assert server.stats().datagrams_direct == acks + 2  # aioquic alone would ACK after 1 ms
        assert await until(lambda: client.unacknowledged() == 0)  # unasked, the ACK comes after ack_delay
        assert server.stats().datagrams_direct == acks + 3
    finally:
        await client.close()
        await server.close()
        a.close()
        b.close()


def test_a_silent_relay_path_is_rebound_within_two_keepalives_not_at_the_next_refresh() -> None:
    # A NAT that forgets the relay leg's mapping sends from a new port, which the relay drops until
    # it binds; a re-bind only every relay_refresh (20 s) came after peer_timeout (15 s) had ended
    # the link. Times in seconds: now, last bound, last heard on the relay path.
    cfg = LinkConfig(keepalive=2.0, relay_refresh=20.0, peer_timeout=15.0)
    assert relay_rebind_due(100.0, 90.0, 99.0, True, cfg) is None  # heard 1 s ago
    assert relay_rebind_due(100.0, 90.0, 96.5, True, cfg) is None  # 3.5 s: under two keepalives
    assert relay_rebind_due(100.0, 90.0, 95.5, True, cfg) is RebindReason.SILENT  # 4.5 s
    assert relay_rebind_due(100.0, 99.0, 90.0, True, cfg) is None  # re-bound 1 s ago: once a keepalive
    assert relay_rebind_due(100.0, 98.0, 90.0, True, cfg) is RebindReason.SILENT  # still silent
    assert relay_rebind_due(100.0, 90.0, 80.0, False, cfg) is None  # the direct path carries the link
    assert relay_rebind_due(100.0, 80.0, 99.9, True, cfg) is RebindReason.REFRESH  # every 20 s anyway
    assert relay_rebind_due(100.0, 80.0, 99.9, False, cfg) is RebindReason.REFRESH
    # the first silent re-bind comes long before peer_timeout with the defaults
    defaults = LinkConfig()
    assert defaults.relay_silent_keepalives * defaults.keepalive + defaults.keepalive < defaults.peer_timeout


async def test_a_timed_message_leaves_out_the_time_its_receiver_held_the_ack() -> None:
    """`send(..., delivered)`: the seconds from sending a message to its ACK, less the ACK delay the
    receiver reported. The receiver holds a lone packet's ACK for `ack_delay` (25 ms), which the
    timing leaves out; a 3 MB message's time is the transfer of all its packets."""
    ctx = EdgeContext("S-loop", "alice", "bob", b"correct horse")
    quiet = LinkConfig(probe_sizes=(), keepalive=60.0)  # no probes or PINGs in between
    client, server, a, b = await direct_pair(ctx, ctx, quiet)
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        await asyncio.sleep(0.1)  # the handshake's and authentication's ACKs are done
        timed: list[tuple[float, float]] = []  # (transfer, wall time from send to the ACK)

        async def send_timed(payload: bytes) -> None:
            sent = asyncio.get_running_loop().time()
            done = asyncio.Event()

            def delivered(seconds: float) -> None:
                timed.append((seconds, asyncio.get_running_loop().time() - sent))
                done.set()

            await client.send(16, payload, delivered)
            assert (await server.recv(timeout=5))[1] == payload
            await asyncio.wait_for(done.wait(), 10)

        await send_timed(b"one frame")  # its ACK waits out the receiver's ack_delay
        transfer, wall = timed[-1]
        assert wall >= 0.02, f"the ACK came {wall * 1e3:.1f} ms after the send: it did not wait"
        assert 0 <= transfer <= wall - 0.02, (
            f"{transfer * 1e3:.1f} ms of {wall * 1e3:.1f} ms: the ACK's hold kept"
        )
        await send_timed(os.urandom(3 * 1024 * 1024))  # many packets, several flow-control windows
        transfer, wall = timed[-1]
        assert 0 < transfer <= wall
        assert len(timed) == 2  # each message delivered once
    finally:
        await client.close()
        await server.close()
        a.close()
        b.close()


def test_a_keepalive_that_wakes_late_measures_this_process_s_own_stall() -> None:
    assert own_stall(10.0, 2.0, 12.05) == 0.0  # an ordinary wake-up
    assert own_stall(10.0, 2.0, 12.9) == 0.0  # a busy loop, under a second late
    assert own_stall(10.0, 2.0, 27.0) == pytest.approx(15.0)  # frozen for 15 s (SIGSTOP)


async def test_a_simulated_stall_of_this_process_is_not_the_peer_s_silence() -> None:
    """A message the peer sent just before this process stalled (its loop blocked here for 4x
    peer_timeout, as a frozen host's is) is read on waking: neither end counts the time it did not
    run as the other's silence and closes the link before reading what waits in its socket."""
    ctx = EdgeContext("S", "alice", "bob", b"secret")
    config = LinkConfig(keepalive=0.1, dead_after=0.3, peer_timeout=0.6)
    client, server, a, b = await direct_pair(ctx, ctx, config)
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        await server.send(16, b"replaced")
        time.sleep(2.4)  # the whole process stalls (both ends of this loopback pair)
        assert await client.recv(timeout=5) == (16, b"replaced")
        await asyncio.sleep(0.5)  # keepalives after the stall: both ends hear each other again
        assert not client.closed and not server.closed
    finally:
        await client.close()
        await server.close()
        a.close()
        b.close()


def test_a_small_flight_is_sent_twice_and_bulk_once() -> None:
    assert copies(2330, 32 * 1024) == 2  # a decode step's activation
    assert copies(32 * 1024, 32 * 1024) == 2
    assert copies(32 * 1024 + 1, 32 * 1024) == 1  # a prefill, a shard
    assert copies(0, 32 * 1024) == 1  # nothing queued: nothing to copy
    assert copies(100, 0) == 1  # copies turned off


def test_a_datagram_that_came_before_is_known_until_it_is_old() -> None:
    recent = RecentDatagrams(keep=3)
    assert not recent.seen(b"a") and recent.seen(b"a")
    for other in (b"b", b"c", b"d"):
        assert not recent.seen(other)
    assert not recent.seen(b"a")  # three newer ones pushed it out


def dropping_first(endpoint: UdpEndpoint) -> list[int]:
    """Simulated loss: the endpoint's next datagram is dropped on the wire; returns the sizes of
    what it sent from then on (the dropped one first)."""
    sent: list[int] = []
    real = endpoint.sendto

    def sendto(data: bytes, addr: Address) -> None:
        sent.append(len(data))
        if len(sent) > 1:
            real(data, addr)

    endpoint.sendto = sendto  # type: ignore[method-assign]
    return sent


@pytest.mark.parametrize("copy_flight", [32 * 1024, 0])
async def test_a_lone_message_with_simulated_loss_of_one_packet_is_carried_by_its_copy(
    copy_flight: int,
) -> None:
    """A decode step's lone message whose first datagram is lost: with copies, the second copy
    carries it at once and QUIC never learns of a loss (nothing resent, nothing more sent); without,
    it waits for QUIC's probe timeout (over 25 ms: max_ack_delay is part of it) and is resent."""
    ctx = EdgeContext("S-loop", "alice", "bob", b"correct horse")
    quiet = LinkConfig(probe_sizes=(), keepalive=60.0, copy_flight=copy_flight)
    client, server, a, b = await direct_pair(ctx, ctx, quiet)
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        await asyncio.sleep(0.1)  # the handshake's and authentication's ACKs are done
        sent = dropping_first(a)
        started = time.perf_counter()
        await client.send(16, b"one activation")
        assert await server.recv(timeout=5) == (16, b"one activation")
        took = time.perf_counter() - started
        server.acknowledge()
        assert await until(lambda: client.unacknowledged() == 0)
        await asyncio.sleep(0.05)  # a resend, if QUIC had found a loss, would have left by now
        if copy_flight:
            assert len(sent) == 2 and client.stats().datagrams_copied == 1, sent
            assert server.stats().copies_received == 0  # the only copy that came was the first
        else:
            assert len(sent) >= 2 and client.stats().datagrams_copied == 0, sent
            assert took >= 0.025, took  # the probe timeout holds max_ack_delay
    finally:
        await client.close()
        await server.close()
        a.close()
        b.close()


async def test_a_copy_that_arrives_is_dropped_before_quic_and_does_not_hurry_the_ack() -> None:
    """Both copies arrive: the second is dropped before QUIC, so the lone message's ACK still
    waits for `acknowledge` (a second *packet* would be acknowledged at once)."""
    ctx = EdgeContext("S-loop", "alice", "bob", b"correct horse")
    quiet = LinkConfig(probe_sizes=(), keepalive=60.0)
    client, server, a, b = await direct_pair(ctx, ctx, quiet)
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        await asyncio.sleep(0.1)
        acks = server.stats().datagrams_direct
        await client.send(16, b"one activation")
        assert await server.recv(timeout=5) == (16, b"one activation")
        assert await until(lambda: server.stats().copies_received == 1)
        assert server.stats().datagrams_direct == acks  # its ACK waits
        server.acknowledge()
        assert server.stats().datagrams_direct == acks + 1
        assert await until(lambda: client.unacknowledged() == 0)
        big = os.urandom(256 * 1024)  # bulk: sent once
        await client.send(17, big)
        assert await server.recv(timeout=10) == (17, big)
        assert client.stats().datagrams_copied == 1
    finally:
        await client.close()
        await server.close()
        a.close()
        b.close()
