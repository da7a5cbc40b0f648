"""Cache recovery in one process: a ring of real stages of a tiny model loses a member mid-answer;
the head and the survivor move to the next plan epoch in place (new stages, new channels of that
epoch), the head prefills each request's prompt and tokens again, and every answer is the one an
uninterrupted run gives (the roles' part of kafila.session.forming.epochs, without processes)."""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import pytest

from kafila.api.service import GenerationError, Sampling, TokenEvent
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from kafila.session.channel import Heartbeat, MemoryChannel
from kafila.session.ring.generation import QueueGeneration
from kafila.session.ring.info import RingInfo
from kafila.session.ring.member import RingMember
from kafila.session.ring.origins import origin_of
from kafila.session.ring.promote import promoted
from tests.session.ringkit import beat, build_ring, recovers_from_losing, replan_without_m1, replanning

PROMPTS = [[17, 40, 200, 99, 4, 64, 18, 250, 7], [17, 4, 200], [200, 100, 50, 25]]  # answers of 24 tokens
TOKENS = 24


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))


async def collect(gen) -> list[int]:
    return [t for ev in [e async for e in gen] if isinstance(ev, TokenEvent) for t in ev.tokens]


async def test_a_lost_member_is_planned_around_and_every_answer_goes_on_unchanged(ckpt: Checkpoint) -> None:
    splits = [(0, 2), (2, 3), (3, 5)]
    ring = build_ring(ckpt, splits, concurrency=2)  # two admitted, one queued
    try:
        expected = [await collect(await ring.head.submit(p, Sampling(max_tokens=TOKENS))) for p in PROMPTS]
        longest = max(range(len(PROMPTS)), key=lambda i: len(expected[i]))
        assert len(expected[longest]) > 8  # long enough to be cut in the middle (random weights)
    finally:
        await ring.stop()

    ring = build_ring(ckpt, splits, dead_after=3.0, concurrency=2)
    head = ring.head
    recovers_from_losing(ring, "m1")
    c0 = None
    try:
        gens = [await head.submit(p, Sampling(max_tokens=TOKENS)) for p in PROMPTS]
        jobs = [asyncio.ensure_future(collect(g)) for g in gens]
        first = head._reqs[gens[longest].request_id]
        while first.generated < 3 and not jobs[longest].done():  # mid-answer (the tiny model is fast)
            await asyncio.sleep(0)
        ring.kill(1)
        await replanning(ring, 2)
        with pytest.raises(GenerationError) as refused:  # a new client meanwhile: 503 with Retry-After
            await head.submit(PROMPTS[1], Sampling(max_tokens=2))
        assert refused.value.code == "replanning"
        assert head.describe()["state"] == "replanning" and head.describe()["error"] is None
        # epoch 2: m0 [0, 3) + head, m2 [3, 5); one channel pair of epoch 2 (a ring of two)
        c0, carried = await replan_without_m1(ring, ckpt, [(0, 3), (3, 5)])
        assert carried >= 1 and 3 <= first.generated < len(expected[longest])
        old_sent = [c.counters.messages_sent for c in ring.channels]  # epoch 1's, every end
        got = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        assert got == expected
        await asyncio.sleep(3 * max(c.interval for c in ring.channels))  # beats they would have sent
        assert [c.counters.messages_sent for c in ring.channels] == old_sent, (
            "an old epoch's channel beats on"
        )
        assert all(c._task is not None and c._task.done() for c in ring.channels)
        assert head.describe()["epoch"] == 2 and head.describe()["state"] == "serving"
        assert isinstance(head.info, RingInfo) and head.info.order == ("m0", "m2")
    finally:
        if c0 is not None:
            await c0.close()
        await ring.stop()


async def test_a_request_forwarded_by_the_lost_member_is_dropped_not_carried_on(ckpt: Checkpoint) -> None:
    """The head carries on its own clients' requests but not one that m1 forwarded: no answer could
    reach m1's client through the new ring, so computing it would only keep the others waiting."""
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)], dead_after=3.0, concurrency=2)
    head, m1 = ring.head, ring.members[0]
    recovers_from_losing(ring, "m1")
    c0 = None
    try:
        mine = await head.submit(PROMPTS[0], Sampling(max_tokens=TOKENS))
        theirs = await m1.submit(PROMPTS[2], Sampling(max_tokens=TOKENS))  # admitted at the head
        job = asyncio.ensure_future(collect(mine))
        assert theirs.request_id in head._reqs and mine.request_id in head._reqs
        ring.kill(1)
        await replanning(ring, 2)
        c0, carried = await replan_without_m1(ring, ckpt, [(0, 3), (3, 5)])
        assert theirs.request_id not in head._reqs and carried == len(head._reqs) <= 1
        assert len(await asyncio.wait_for(job, 60)) > 0
    finally:
        if c0 is not None:
            await c0.close()
        await ring.stop()


async def _until(done, within: float = 30.0) -> None:
    for _ in range(int(within / 0.005)):
        if done():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"not reached within {within:g} s")


async def test_a_sampling_turn_a_replan_cut_off_on_a_held_model_thread_costs_no_token(
    ckpt: Checkpoint,
) -> None:
    """The head's model thread is held (simulated: a call waiting on an event) when a decode step
    comes back, so the step's sampling turn waits behind it; the ring then breaks and the head's
    pause cancels the task awaiting that turn, which still runs on the model thread and moves the
    request's sampler on by a token nobody receives. Carried into epoch 2, the answer is still the
    uninterrupted one to its last token (the sampler's count used to end it one early, "length")."""
    splits = [(0, 2), (2, 3), (3, 5)]
    ring = build_ring(ckpt, splits)
    try:
        expected = await collect(await ring.head.submit(PROMPTS[2], Sampling(max_tokens=TOKENS)))
    finally:
        await ring.stop()
    assert len(expected) == TOKENS  # it ends by length: one token short would show

    ring = build_ring(ckpt, splits, dead_after=3.0)
    head, m2 = ring.head, ring.members[1]
    recovers_from_losing(ring, "m1")
    at_head, at_m2 = threading.Event(), threading.Event()
    c0 = None
    try:
        gen = await head.submit(PROMPTS[2], Sampling(max_tokens=TOKENS))
        job = asyncio.ensure_future(collect(gen))
        req, rid = head._reqs[gen.request_id], gen.request_id
        await _until(lambda: req.generated >= 3)
        held_m2 = asyncio.ensure_future(m2.model.run(at_m2.wait, 30))
        await _until(lambda: m2.model._calls.qsize() > 0)  # a step of it waits at m2
        held_head = asyncio.ensure_future(head.model.run(at_head.wait, 30))
        at_m2.set()
        await held_m2
        # back at the head, its sampling turn waits behind the held call
        await _until(lambda: head.schedule.idle(rid) and head.model._calls.qsize() > 0)
        cut_at, old = req.generated, req.sampler
        ring.kill(1)
        await replanning(ring, 2)
        await head.pause()  # as the re-plan does: the task awaiting the turn is cancelled
        at_head.set()
        await held_head
        await head.model.run(lambda: None)  # queued after the cut turn: it has run now
        assert old.generated == cut_at + 1 and req.generated == cut_at, "no turn was cut: nothing tested"
        c0, carried = await replan_without_m1(ring, ckpt, [(0, 3), (3, 5)])
        assert carried == 1
        assert await asyncio.wait_for(job, 60) == expected
    finally:
        at_head.set()
        at_m2.set()
        if c0 is not None:
            await c0.close()
        await ring.stop()


async def _answer_started(member: RingMember, gen: QueueGeneration, job: asyncio.Future[list[int]]) -> None:
    """Until `member`'s client has had 3 tokens of `gen` (or its answer ended)."""
    while len(member._delivered.get(gen.request_id, ())) < 3 and not job.done():
        await asyncio.sleep(0)


async def test_a_lost_head_moves_to_a_member_and_the_forwarded_answers_go_on_unchanged(
    ckpt: Checkpoint,
) -> None:
    """A ring of four loses its head (m0) mid-answer. Epoch 2 makes m1 the head: m1's own clients'
    requests become the new head's, m2's are sent to it carried (prompt and the tokens streamed),
    and every answer is the one an uninterrupted ring gives, with no token repeated or missed."""
    splits = [(0, 2), (2, 3), (3, 4), (4, 5)]
    asks = [(1, PROMPTS[0]), (2, PROMPTS[1]), (2, PROMPTS[2])]  # (member, prompt)
    ring = build_ring(ckpt, splits, concurrency=2)  # two admitted, one queued
    try:
        expected = [
            await collect(await ring.members[i - 1].submit(p, Sampling(max_tokens=TOKENS))) for i, p in asks
        ]
        assert max(len(e) for e in expected) > 8
    finally:
        await ring.stop()

    ring = build_ring(ckpt, splits, dead_after=3.0, concurrency=2)
    m1, m2, m3 = ring.members
    recovers_from_losing(ring, "m0")
    channels: list[Heartbeat] = []
    head = None
    try:
        gens = [await ring.members[i - 1].submit(p, Sampling(max_tokens=TOKENS)) for i, p in asks]
        jobs = [asyncio.ensure_future(collect(g)) for g in gens]
        longest = max(range(len(asks)), key=lambda i: len(expected[i]))
        await _answer_started(ring.members[asks[longest][0] - 1], gens[longest], jobs[longest])
        ring.kill(0)
        for _ in range(1000):
            if all(m.state == "replanning" for m in ring.members):
                break
            await asyncio.sleep(0.01)
        assert [m.state for m in ring.members] == ["replanning"] * 3
        streamed = [
            len(ring.members[i - 1]._delivered.get(g.request_id, ()))
            for (i, _), g in zip(asks, gens, strict=True)
        ]
        assert 3 <= streamed[longest] < len(expected[longest])  # cut mid-answer
        for m in ring.members:
            await m.pause()
        new = [(0, 3), (3, 4), (4, 5)]  # m1 [0, 3) + head, m2 [3, 4), m3 [4, 5)
        info = dataclasses.replace(
            m1.info,
            order=("m1", "m2", "m3"),
            blocks=dict(zip(("m1", "m2", "m3"), new, strict=True)),
            edges={"m1->m2": "local", "m2->m3": "local", "m3->m1": "local"},
        )
        stages = [
            Stage.load(ckpt, range(a, b), i == 0, "torch", "fp32", context=64, concurrency=2)
            for i, (a, b) in enumerate(new)
        ]
        pairs = [MemoryChannel.pair(a, b, epoch=2) for a, b in (("m1", "m2"), ("m2", "m3"), ("m3", "m1"))]
        channels = [beat(c, 5.0) for pair in pairs for c in pair]
        eos = ckpt.config.eos_token_id
        with pytest.raises(ValueError, match="origin tag 1"):  # m1 numbers its requests under tag 1
            promoted(m1, stages[0], info, channels[0], channels[5], 3, eos, 2, 4, None, {"m1": 5, "m2": 2})
        origins = {"m0": 0, "m1": 1, "m2": 2, "m3": 3}  # as ringkit's members were tagged
        head = promoted(m1, stages[0], info, channels[0], channels[5], 3, eos, 2, 4, None, origins)
        head.epoch = 2
        assert head.asked_by == {tag: name for name, tag in origins.items()}
        m2.resume(2, 1, stages[1], info, channels[2], channels[1])
        m3.resume(2, 2, stages[2], info, channels[4], channels[3])
        assert head.carrying() == 1 and head.name == "m1"  # m1's own request; m2's come over the ring
        for role in (head, m2, m3):
            role.changed("serving", "m0 was lost (silent)")
        head.go()
        got = await asyncio.wait_for(asyncio.gather(*jobs), 60)
        assert got == expected
        assert head.describe()["me"] == "m1" and head.describe()["state"] == "serving"
        again = await collect(await m2.submit(PROMPTS[0], Sampling(max_tokens=TOKENS)))  # the new ring serves
        assert again == expected[0]
        own = await head.submit(PROMPTS[1], Sampling(max_tokens=TOKENS))  # m1's tag, its count going on
        assert origin_of(own.request_id) == 1 and own.request_id not in {g.request_id for g in gens}
        assert await collect(own) == expected[1]
    finally:
        if head is not None:
            await head.stop()
            head.model.close()
        for c in channels:
            await c.close()
        await ring.stop()
