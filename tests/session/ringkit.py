"""Rings of real stages inside one test process, joined by in-memory channels (the transport is
the only thing that differs from a session across machines; tests/session/test_session_loopback
runs the same ring over QUIC links)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from dataclasses import dataclass

from kafila.engine.draft import DraftPolicy
from kafila.engine.draft_model import DraftModel
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from kafila.proto import tensor as t
from kafila.proto.ring import Cause
from kafila.session.channel import ChannelError, Heartbeat, MemoryChannel
from kafila.session.ring.compute import ModelThread
from kafila.session.ring.head import RingHead, RingInfo
from kafila.session.ring.member import RingMember


@dataclass
class Ring:
    head: RingHead
    members: list[RingMember]
    channels: list[Heartbeat]

    def kill(self, index: int) -> None:
        """Simulated death of member `index` (0: the head): its loops and its heartbeats stop,
        nothing is closed politely, as when the process is killed."""
        member = self.head if index == 0 else self.members[index - 1]
        for task in member._tasks:
            task.cancel()
        n = len(self.members) + 1
        for c in (self.channels[2 * index], self.channels[2 * ((index - 1) % n) + 1]):
            if c._task is not None:
                c._task.cancel()

    async def stop(self) -> None:
        await self.head.stop()
        for m in self.members:
            await m.stop()
        for c in self.channels:
            await c.close()
        for model in [self.head.model, *(m.model for m in self.members)]:
            model.close()


def build_ring(
    ckpt: Checkpoint,
    splits: list[tuple[int, int]],
    context: int = 64,
    concurrency: int = 1,
    chunk: int = 4,
    dead_after: float = 5.0,
    lanes: int | None = None,  # decode lanes at the head; default one per stage
    dtypes: list[str] | None = None,  # each stage's dtype; default fp32 everywhere
    max_queue: int | None = None,
    draft: DraftPolicy | None = None,  # the head drafts (speculative decoding); None: plain
    tie_margin: float | None = None,
    drafter: DraftModel | None = None,  # with `draft`: a draft model drafts instead of prompt lookup
    hop_s: float = 0.0,  # a simulated one-way delay on every hop (0: none)
) -> Ring:
    names = tuple(f"m{i}" for i in range(len(splits)))
    info = RingInfo(
        session="test",
        model="tiny",
        division="test",
        order=names,
        blocks={n: s for n, s in zip(names, splits, strict=True)},
        predicted_ms={n: 1.0 for n in names},
        edges={f"{a}->{b}": "local" for a, b in zip(names, names[1:] + names[:1], strict=True)},
    )
    kinds = dtypes or ["fp32"] * len(splits)
    stages = [
        Stage.load(ckpt, range(a, b), i == 0, "torch", kinds[i], context=context, concurrency=concurrency)
        for i, (a, b) in enumerate(splits)
    ]
    n = len(splits)
    # channel i: member i -> member i+1; ends[i] = (sender end at i, receiver end at i+1)
    pairs = [DelayedChannel.pair(names[i], names[(i + 1) % n]) for i in range(n)] if n > 1 else []
    for a, b in pairs:
        a.delay_s = b.delay_s = hop_s
    hb = [(beat(a, dead_after), beat(b, dead_after)) for a, b in pairs]
    eos = ckpt.config.eos_token_id
    ways = {"concurrency": concurrency, "chunk": chunk, "lanes": lanes or n, "max_queue": max_queue}
    ways |= {"draft": draft, "tie_margin": tie_margin, "drafter": drafter}
    if n == 1:
        head = RingHead(stages[0], ModelThread(names[0]), info, None, None, eos, **ways)
        return Ring(head.start(), [], [])
    head = RingHead(stages[0], ModelThread(names[0]), info, hb[0][0], hb[-1][1], eos, **ways)
    members = [
        RingMember(i, stages[i], ModelThread(names[i]), info, hb[i][0], hb[i - 1][1]) for i in range(1, n)
    ]
    return Ring(head.start(), [m.start() for m in members], [c for p in hb for c in p])


class DelayedChannel(MemoryChannel):
    """An in-memory channel end whose messages arrive `delay_s` after they are sent: a simulated
    one-way hop delay (every message waits the same, so order is kept)."""

    delay_s = 0.0

    async def send(self, msg: t.Message) -> None:
        if self.delay_s <= 0:
            await super().send(msg)
            return
        loop = asyncio.get_running_loop()
        loop.call_later(self.delay_s, lambda: asyncio.ensure_future(self._arrive(msg)))

    async def _arrive(self, msg: t.Message) -> None:
        with contextlib.suppress(ChannelError):  # closed while the message was on its way
            await MemoryChannel.send(self, msg)


def beat(channel: MemoryChannel, dead_after: float) -> Heartbeat:
    """Every member of an in-process ring is up from the start: no grace for a loading peer."""
    return Heartbeat(channel, dead_after, first_within=dead_after).start()


def recovers_from_losing(ring: Ring, member: str) -> None:
    """Every role holds its requests (state "replanning") when `member` is lost, as the runtime's
    re-plan (kafila.session.forming.epochs) has them do."""
    for role in (ring.head, *ring.members):
        role.recovers = lambda b: b.member == member and b.cause in (Cause.SILENT, Cause.CLOSED)


async def replanning(ring: Ring, *roles: int, within: float = 10.0) -> None:
    """Wait until the head and the members at `roles` hold their requests for a re-plan."""
    held = [ring.head, *(ring.members[i - 1] for i in roles)]
    for _ in range(int(within / 0.01)):
        if all(r.state == "replanning" for r in held):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not re-planning after {within:g} s: {[r.state for r in held]}")


async def replan_without_m1(
    ring: Ring, ckpt: Checkpoint, new: list[tuple[int, int]], context: int = 64, concurrency: int = 2
) -> tuple[Heartbeat, int]:
    """Epoch 2 of a ring of three after m1 was lost: the head (m0) holds `new[0]`, m2 `new[1]`,
    one channel pair of epoch 2 between them; the head prefills its requests again and sends.
    Returns the head's channel (to close) and how many requests the head carried on."""
    head, m2 = ring.head, ring.members[1]
    await head.pause()
    await m2.pause()
    info = dataclasses.replace(
        head.info,
        order=("m0", "m2"),
        blocks={"m0": new[0], "m2": new[1]},
        edges={"m0->m2": "local", "m2->m0": "local"},
    )
    stages = [
        Stage.load(ckpt, range(a, b), i == 0, "torch", "fp32", context=context, concurrency=concurrency)
        for i, (a, b) in enumerate(new)
    ]
    at_head, at_m2 = MemoryChannel.pair("m0", "m2", epoch=2)
    c0, c2 = beat(at_head, 5.0), beat(at_m2, 5.0)
    carried = head.resume(2, stages[0], info, c0, c0, lanes=2)
    m2.resume(2, 1, stages[1], info, c2, c2)
    for role in (head, m2):
        role.changed("serving", "m1 was lost (silent)")
    head.go()
    return c0, carried
