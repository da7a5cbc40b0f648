"""Heartbeat silence against a member that was itself stopped (in-process pair).

A simulated stall: the event loop is blocked by `time.sleep` past the deadline while the peer's
message "arrives" (a timer puts it in the channel, as the socket reader would on the loop's first
turn after the stall). The real Heartbeat code decides what the silence means.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from kafila.proto import tensor as t
from kafila.session.channel import ChannelDead, Heartbeat, MemoryChannel

DEAD_AFTER = 0.5


def listening() -> tuple[MemoryChannel, Heartbeat]:
    a, b = MemoryChannel.pair("alpha", "beta")
    return a, Heartbeat(b, DEAD_AFTER, interval=10.0, first_within=DEAD_AFTER)  # no beats of its own


def stall(seconds: float, then_arrives: t.Message | None, a: MemoryChannel) -> None:
    loop = asyncio.get_running_loop()
    loop.call_later(0.05, time.sleep, seconds)  # the whole process stops: nothing of it runs
    if then_arrives is not None:  # sent by the peer during the stall, read on the first turn after it
        loop.call_later(0.1, a._out.put_nowait, t.encode(then_arrives, a.epoch))


async def test_simulated_stall_of_this_member_does_not_blame_a_peer_whose_message_waits_unread() -> None:
    a, hb = listening()
    stall(2.5, t.Control("hello"), a)
    assert await asyncio.wait_for(hb.recv(), 10) == t.Control("hello")


async def test_simulated_stall_then_real_silence_names_the_stall_not_only_the_peer() -> None:
    a, hb = listening()
    stall(2.5, None, a)
    with pytest.raises(
        ChannelDead, match=r"this member stalled for 2\.\d s .* heard nothing from member alpha"
    ):
        await asyncio.wait_for(hb.recv(), 10)


async def test_a_silent_peer_without_a_stall_is_named() -> None:
    _, hb = listening()
    with pytest.raises(ChannelDead, match="member alpha stopped answering"):
        await asyncio.wait_for(hb.recv(), 10)


async def test_a_link_closed_by_its_own_silence_check_is_named_as_such_not_as_the_rings_wait() -> None:
    """The link gave up on a vanished peer after its peer_timeout; the ring's channel said "stopped
    answering (nothing for 20 s)", the ring's --dead-after, which had not passed."""
    from kafila.net.auth import EdgeContext
    from kafila.net.link import LinkConfig
    from kafila.session.channel import ChannelClosed, LinkChannel
    from tests.net.conftest import direct_pair

    ctx = EdgeContext("S", "alice", "bob", b"secret")
    config = LinkConfig(keepalive=0.1, dead_after=0.3, peer_timeout=0.6)
    client, server, a, b = await direct_pair(ctx, ctx, config)
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        hb = Heartbeat(LinkChannel(client, "bob"), dead_after=20.0, interval=10.0, first_within=20.0)
        b.close()  # bob's machine is gone without a word
        with pytest.raises(ChannelClosed, match=r"link to bob: .*nothing received on any path for 0\.\d s"):
            await asyncio.wait_for(hb.recv(), 10)
    finally:
        a.close()
        await server.close()


async def test_a_link_the_peer_closed_as_ended_breaks_the_channel_as_ended_not_as_a_lost_member() -> None:
    """The neighbour ended because the host ended the session: the ring's break says "ended", so a
    member whose own link to the host closes later does not ask for a new plan or say it broke."""
    from kafila.net.auth import EdgeContext
    from kafila.net.link import LinkConfig
    from kafila.proto.ring import Cause
    from kafila.session.channel import ChannelClosed, LinkChannel
    from tests.net.conftest import direct_pair

    ctx = EdgeContext("S", "alice", "bob", b"secret")
    client, server, a, b = await direct_pair(ctx, ctx, LinkConfig())
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        channel = LinkChannel(client, "bob")
        await server.close("the host ended the session", ended=True)
        with pytest.raises(ChannelClosed, match="the host ended the session") as err:
            await asyncio.wait_for(channel.recv(), 10)
        assert err.value.cause is Cause.ENDED
        with pytest.raises(ChannelClosed) as err:
            await channel.send(t.Control("after the end"))
        assert err.value.cause is Cause.ENDED
    finally:
        a.close()
        b.close()
