"""A channel of one plan epoch drops the frames of another, counts them, and logs once per epoch.

In-process pairs and a real QUIC link on loopback; the re-plan is played by opening a channel of
the next epoch on the same transport while the old epoch's frames are still in it.
"""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from kafila.obs import metrics
from kafila.proto import tensor as t
from kafila.session.channel import ChannelDead, Heartbeat, LinkChannel, MemoryChannel

FRAME = t.Hidden(step=1, dtype=t.DType.F32, shape=(1, 2), entries=(t.Entry(9, 0, 1),), data=b"\0" * 8)


def stale_count(peer: str) -> float:
    """The counter for `peer`, whatever session and model labels an earlier in-process session left."""
    return sum(
        s.value
        for m in metrics.REGISTRY.collect()
        for s in m.samples
        if s.name == "kafila_ring_stale_frames_total" and s.labels.get("peer") == peer
    )


async def test_memory_channel_of_the_next_epoch_drops_the_old_epochs_frames() -> None:
    a, b = MemoryChannel.pair("alpha", "beta", epoch=1)
    assert (a.epoch, b.epoch) == (1, 1)
    for _ in range(3):
        await a.send(FRAME)  # in flight when the re-plan happens
    b2, a2 = b.renewed(2), a.renewed(2)
    await a2.send(t.Control("after"))
    before = stale_count("alpha")
    with capture_logs() as logs:
        assert await b2.recv(1.0) == t.Control("after")
    assert stale_count("alpha") - before == 3
    events = [e for e in logs if e["event"] == "ring_stale_frames"]
    assert len(events) == 1  # one per peer and stale epoch, not one per frame
    assert (events[0]["peer"], events[0]["epoch"], events[0]["frame_epoch"]) == ("alpha", 2, 1)
    assert b2.counters.messages_received == 1  # a dropped frame is not counted as received


async def test_stale_frames_do_not_stretch_the_wait_past_its_deadline() -> None:
    """A peer still on the old epoch keeps sending beats; the new epoch's channel hears nothing."""
    a, b = MemoryChannel.pair("alpha", "beta", epoch=1)
    hb_old = Heartbeat(a, 10.0, interval=0.05).start()  # alpha, left behind on epoch 1
    listener = Heartbeat(b.renewed(2), 0.5, interval=10.0, first_within=0.5)
    try:
        with pytest.raises(ChannelDead, match="member alpha stopped answering"):
            await asyncio.wait_for(listener.recv(), 5)
    finally:
        await hb_old.close()


async def test_link_channel_drops_an_old_epochs_frames_on_a_real_link() -> None:
    from kafila.net.auth import EdgeContext
    from tests.net.conftest import direct_pair

    ctx = EdgeContext("S-epoch", "alice", "bob", b"secret")
    client, server, ea, eb = await direct_pair(ctx, ctx)
    try:
        await asyncio.gather(client.wait_ready(), server.wait_ready())
        old, new = LinkChannel(client, "bob", epoch=1), LinkChannel(client, "bob", epoch=2)
        at_bob = LinkChannel(server, "alice", epoch=2)
        assert (old.epoch, new.epoch, at_bob.epoch) == (1, 2, 2)
        before = stale_count("alice")
        await old.send(FRAME)
        await new.send(FRAME)
        assert await at_bob.recv(5.0) == FRAME
        assert stale_count("alice") - before == 1
        assert at_bob.counters.messages_received == 1
    finally:
        await client.close()
        await server.close()
        ea.close()
        eb.close()
