"""Traces of a ring of real stages of a tiny model, members joined in memory: every member records
its own stage and hops, and the head's request record gathers every hop as its sender's link
counted it (the in-memory channel encodes every message as a QUIC link would)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest

from kafila.api.service import Sampling
from kafila.engine.pace import Pace
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from kafila.obs.trace import RequestRecord, StageRecord, TraceLog, summarize_stages
from kafila.obs.tracefile import from_json
from kafila.proto import tensor as t
from kafila.session.channel import MemoryChannel
from kafila.session.ring.compute import ModelThread
from kafila.session.ring.head import RingHead, RingInfo
from kafila.session.ring.member import RingMember
from kafila.session.ring.origins import origin_of
from tests.session.ringkit import Ring, beat, build_ring

PROMPT = list(range(1, 14))  # 13 tokens: prefill chunks of 4, 4, 4, 1; the tiny model's answer has no EOS
SHORT = [17, 4, 200]
CHUNK = 4


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))


async def drain(gen, within: float = 60.0) -> list:
    async def events() -> list:
        return [ev async for ev in gen]

    return await asyncio.wait_for(events(), within)


def traced(ring: Ring) -> list[TraceLog]:
    logs = [TraceLog(None) for _ in range(len(ring.members) + 1)]
    ring.head.traces = logs[0]
    for m, log in zip(ring.members, logs[1:], strict=True):
        m.traces = log
    return logs


async def records(log: TraceLog, kind: type, rid: int, within: float = 5.0) -> list:
    """The records of request `rid` once written (they follow its free notice around the ring)."""
    for _ in range(int(within / 0.02)):
        found = [r for r in map(from_json, log.recent()) if isinstance(r, kind) and r.request_id == rid]
        if found:
            return found
        await asyncio.sleep(0.02)
    raise AssertionError(f"no {kind.__name__} for request {rid} within {within} s")


def header(timings: int) -> int:
    """Bytes of a one-request hidden frame that are not the tensor (after `timings` stages)."""
    empty = t.Hidden(0, t.DType.F32, (0, 1), (t.Entry(0, 0, 0),), b"", 0, (0,) * timings)
    return len(t.encode(empty, 1))


async def test_each_member_records_its_stage_and_the_head_every_hop(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)], chunk=CHUNK)
    logs = traced(ring)
    ring.head.info.edge_rtt_ms.update({"m0->m1": 1.5, "m1->m2": 2.5, "m2->m0": 3.5})  # as a plan prices them
    try:
        gen = await ring.members[0].submit(PROMPT, Sampling(max_tokens=9))  # asked at m1, not the head
        await drain(gen)
        [req] = await records(logs[0], RequestRecord, gen.request_id)
        stages = [(await records(log, StageRecord, gen.request_id))[0] for log in logs]
    finally:
        await ring.stop()
    steps, chunks = req.completion_tokens - 1, math.ceil(len(PROMPT) / CHUNK)
    rows = len(PROMPT) + steps
    row_bytes = ckpt.config.hidden_size * 4  # fp32 on the wire
    for i, (own, ring_view) in enumerate(zip(stages, req.stages, strict=True)):
        assert (own.member, own.index, own.decode_steps) == (f"m{i}", i, steps)
        assert len(own.prefill_ms) == chunks and own.decode_ms > 0
        assert own.wait_ms >= 0 and (i > 0 or own.wait_ms == 0)  # the head's steps do not arrive
        # the head's view of each stage is what that member measured (the frame carries it)
        assert ring_view.measured_ms == pytest.approx(own.decode_ms)
        assert ring_view.prefill_chunks == chunks
        assert ring_view.prefill_ms == pytest.approx(sum(own.prefill_ms), abs=0.01 * chunks)
    assert [h.name for h in req.hops] == ["m0->m1", "m1->m2", "m2->m0"]
    for i, hop in enumerate(req.hops):
        sender, receiver = stages[i], stages[(i + 1) % 3]
        assert hop == sender.hop_out  # the head records what the sender's link counted
        assert receiver.hop_in is not None and receiver.hop_in.bytes == hop.bytes  # the receiver agrees
        assert hop.messages == chunks + steps
        # counted on the wire: the tensor rows plus each frame's header with i+1 stage timings
        assert hop.bytes == rows * row_bytes + hop.messages * header(i + 1)
        assert hop.rtt_ms is None and hop.predicted_rtt_ms == pytest.approx(1.5 + i)
        assert req.stages[i].bytes_out == hop.bytes
    assert 0 < req.transit_ms < req.circuit_ms
    [m1] = summarize_stages([stages[1]])
    assert m1.bytes_in == stages[0].hop_out.bytes and m1.predicted_rtt_ms == 2.5


async def test_concurrent_requests_each_count_their_own_frames(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 2), (2, 5)], concurrency=2, chunk=CHUNK)
    logs = traced(ring)
    try:
        gens = [await ring.head.submit(p, Sampling(max_tokens=8)) for p in (PROMPT, SHORT)]
        await asyncio.gather(*(drain(g) for g in gens))
        reqs = [(await records(logs[0], RequestRecord, g.request_id))[0] for g in gens]
    finally:
        await ring.stop()
    row_bytes = ckpt.config.hidden_size * 4
    for prompt, r in zip((PROMPT, SHORT), reqs, strict=True):
        tensor = (len(prompt) + r.completion_tokens - 1) * row_bytes
        for i, hop in enumerate(r.hops):
            # its own rows, and each frame's header (shared with the other request when batched)
            assert tensor < hop.bytes <= tensor + hop.messages * header(i + 1)
            assert hop.messages == math.ceil(len(prompt) / CHUNK) + r.completion_tokens - 1


async def test_a_ring_of_one_records_at_once_without_hops(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 5)], chunk=CHUNK)
    [log] = traced(ring)
    try:
        gen = await ring.head.submit(PROMPT, Sampling(max_tokens=5))
        await drain(gen)
        recs = [from_json(d) for d in log.recent()]  # written as the last token was sampled
    finally:
        await ring.stop()
    own, req = recs
    assert isinstance(own, StageRecord) and own.hop_in is None and own.hop_out is None
    assert isinstance(req, RequestRecord) and req.hops == ()
    assert req.stages[0].measured_ms == pytest.approx(own.decode_ms)


async def test_a_ring_of_two_on_one_channel_counts_each_direction(ckpt: Checkpoint) -> None:
    """As host/join build a ring of two: one link (one channel) carries both directions."""
    async with two_roles(ckpt) as (_, member, logs):
        gen = await member.submit(PROMPT, Sampling(max_tokens=6))
        await drain(gen)
        [req] = await records(logs[0], RequestRecord, gen.request_id)
        [own] = await records(logs[1], StageRecord, gen.request_id)
    there, back = req.hops
    assert (there.name, back.name) == ("m0->m1", "m1->m0")
    assert own.hop_in is not None and own.hop_in.bytes == there.bytes
    assert back == own.hop_out and back.bytes > 0 and there.bytes > 0
    assert there.bytes != back.bytes  # the frames coming back carry one more stage timing each


async def with_a_slow_head(
    ckpt: Checkpoint, splits: list[tuple[int, int]], max_tokens: int
) -> tuple[RequestRecord, StageRecord]:
    """PROMPT's request and head stage records with the head slowed (an emulated 20x slower device,
    kafila.engine.pace), after a first request that compiles the kernels."""
    ring = build_ring(ckpt, splits, chunk=CHUNK)
    logs = traced(ring)
    try:
        await drain(await ring.head.submit(SHORT, Sampling(max_tokens=2)))
        ring.head.stage.pace = Pace(0.05)
        gen = await ring.head.submit(PROMPT, Sampling(max_tokens=max_tokens))
        await drain(gen)
        [req] = await records(logs[0], RequestRecord, gen.request_id)
        [head] = await records(logs[0], StageRecord, gen.request_id)
    finally:
        await ring.stop()
    return req, head


async def test_a_lone_requests_queue_ends_before_the_heads_own_prefill(ckpt: Checkpoint) -> None:
    """queue_s is the wait for a free slot; the head's computation of the first chunk is prefill.
    The head is slowed (an emulated 20x slower device, kafila.engine.pace) so its share is clear: at
    5x its first chunk took 1.9 ms, and a loop turn of 2.4 ms on a loaded machine failed the test."""
    req, head = await with_a_slow_head(ckpt, [(0, 2), (2, 5)], max_tokens=3)
    assert req.queue_s * 1e3 < head.prefill_ms[0] / 2  # a slot was free: no wait beyond a loop turn
    assert req.prefill_s * 1e3 >= sum(head.prefill_ms)  # every chunk the head computed is prefill
    assert req.ttft_s == pytest.approx(req.queue_s + req.prefill_s)


async def test_the_circuit_includes_the_heads_own_blocks(ckpt: Checkpoint) -> None:
    """A decode step's circuit runs from the head's blocks to the sampled token, as the plan's
    circuit sums every stage: the head is slowed (an emulated 20x slower device) so its blocks are
    most of it. Transit (hops and waits) is the circuit less every stage's compute."""
    req, _ = await with_a_slow_head(ckpt, [(0, 3), (3, 5)], max_tokens=6)
    head, member = req.stages
    assert head.measured_ms > 3 * member.measured_ms  # (the head's blocks and its logits)
    assert req.circuit_ms > head.measured_ms + member.measured_ms
    assert 0 < req.transit_ms < req.circuit_ms - head.measured_ms


async def test_cancelled_and_stopped_requests_are_recorded_as_such(ckpt: Checkpoint) -> None:
    """A request cancelled mid-answer crossed every hop: the head records it ("cancelled"), as the
    members record their stages; one the API ends on a stop string is a finished "stop"."""
    from kafila.api.service import STOP_STRING
    from kafila.obs import metrics

    ring = build_ring(ckpt, [(0, 2), (2, 5)], chunk=CHUNK)
    logs = traced(ring)
    before = {f: metrics.REQUESTS.labels(f)._value.get() for f in ("cancelled", "stop")}
    try:
        finishes = {}
        for reason in ("client disconnected", STOP_STRING):
            gen = await ring.members[0].submit(PROMPT, Sampling(max_tokens=20))  # forwarded to the head
            async for ev in gen:
                if ev.tokens:
                    gen.cancel(reason)  # after its first token, as a client that has read enough
                    break
            [req] = await records(logs[0], RequestRecord, gen.request_id)
            [own] = await records(logs[1], StageRecord, gen.request_id)
            assert [h.bytes for h in req.hops] == [own.hop_in.bytes, own.hop_out.bytes]
            finishes[reason] = req.finish
    finally:
        await ring.stop()
    assert finishes == {"client disconnected": "cancelled", STOP_STRING: "stop"}
    after = {f: metrics.REQUESTS.labels(f)._value.get() for f in before}
    assert after == {"cancelled": before["cancelled"] + 1, "stop": before["stop"] + 1}


async def test_a_one_token_request_leaves_the_last_decode_figures(ckpt: Checkpoint) -> None:
    """The "last request" gauges keep the last request that decoded: one that ended at its first
    token measured no decode step and used to set every stage and the circuit to 0."""
    from kafila.obs import metrics

    ring = build_ring(ckpt, [(0, 2), (2, 5)], chunk=CHUNK)
    metrics.observe_ring(ring.head.describe())  # the series describe this ring (as a scrape would set)
    logs = traced(ring)
    try:
        decoded = await ring.head.submit(PROMPT, Sampling(max_tokens=5))
        await drain(decoded)
        await records(logs[0], RequestRecord, decoded.request_id)
        figures = metrics.CIRCUIT._value.get(), metrics.STAGE_MEASURED.labels("m1", "1", "1")._value.get()
        one = await ring.head.submit(SHORT, Sampling(max_tokens=1))
        await drain(one)
        await records(logs[0], RequestRecord, one.request_id)
    finally:
        await ring.stop()
    assert figures[0] > 0 and figures[1] > 0
    assert (
        metrics.CIRCUIT._value.get(),
        metrics.STAGE_MEASURED.labels("m1", "1", "1")._value.get(),
    ) == figures


async def test_the_head_names_the_member_that_asked_by_its_origin_tag(ckpt: Checkpoint) -> None:
    """Tags as a host gives them (kafila.session.ring.origins), not ring indexes: m1 at ring index
    1 has tag 7, and 1 is the head's own tag; the record names m1, whose request id carries 7."""
    async with two_roles(ckpt, origins={"m0": 1, "m1": 7}) as (head, member, logs):
        asked = await member.submit(PROMPT, Sampling(max_tokens=4))
        local = await head.submit(PROMPT, Sampling(max_tokens=4))
        await asyncio.wait_for(asyncio.gather(drain(asked), drain(local)), 60)
        [req] = await records(logs[0], RequestRecord, asked.request_id)
        [own] = await records(logs[0], RequestRecord, local.request_id)
    assert (origin_of(asked.request_id), req.member) == (7, "m1")
    assert (origin_of(local.request_id), own.member) == (1, "m0")


@asynccontextmanager
async def two_roles(
    ckpt: Checkpoint, origins: dict[str, int] | None = None
) -> AsyncIterator[tuple[RingHead, RingMember, list[TraceLog]]]:
    """A ring of two as host/join build it: m0 (the head, blocks 0-1) and m1 (blocks 2-4) on one
    in-memory channel that carries both directions, each recording its traces; `origins` are the
    tags a host gives (kafila.session.ring.origins), else the ring's defaults. Stopped on exit."""
    names = ("m0", "m1")
    info = RingInfo("test", "tiny", "test", names, {"m0": (0, 2), "m1": (2, 5)}, {"m0": 1.0, "m1": 1.0})
    stages = [
        Stage.load(ckpt, range(a, b), i == 0, backend="torch", dtype="fp32", context=64)
        for i, (a, b) in enumerate(info.blocks.values())
    ]
    to_m1, to_m0 = (beat(c, 5.0) for c in MemoryChannel.pair("m0", "m1"))
    eos = ckpt.config.eos_token_id
    head = RingHead(stages[0], ModelThread("m0"), info, to_m1, to_m1, eos, 1, CHUNK, origins=origins)
    tag = None if origins is None else origins["m1"]
    member = RingMember(1, stages[1], ModelThread("m1"), info, to_m0, to_m0, origin=tag)
    logs = [TraceLog(None), TraceLog(None)]
    head.traces, member.traces = logs
    head.start()
    member.start()
    try:
        yield head, member, logs
    finally:
        await _stop((head, member), (to_m1, to_m0))


async def _stop(services: tuple[Any, ...], channels: tuple[Any, ...]) -> None:
    """Stop the ring's roles, close their models, then the channels between them."""
    for service in services:
        await service.stop()
        service.model.close()
    for c in channels:
        await c.close()
