"""A request whose ring broke for good leaves the head's /session "active" (and its slot), also one
whose step was still in the ring when it broke: no `free` comes round for it any more."""

from __future__ import annotations

import asyncio
import threading

import pytest

from kafila.api.service import GenerationError, Sampling
from kafila.models.checkpoint import Checkpoint
from kafila.proto.ring import Cause
from tests.session.ringkit import build_ring

PROMPT = [17, 4, 200, 9]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))


async def test_a_request_with_a_step_in_the_ring_when_it_broke_leaves_active(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 2), (2, 5)])
    head, m1, gate = ring.head, ring.members[0], threading.Event()
    try:
        gen = await head.submit(PROMPT, Sampling(max_tokens=40))
        seen = 0
        async for ev in gen:
            seen += len(ev.tokens)
            if seen == 2:
                break
        held = asyncio.ensure_future(m1.model.run(gate.wait))  # m1's next step waits: it stays in the ring
        for _ in range(500):
            if m1.model._calls.qsize():
                break
            await asyncio.sleep(0.01)
        assert len(head.describe()["active"]) == 1
        head.lose("m1", Cause.DISCONNECTED, "member m1 lost its connection (disconnected)")
        with pytest.raises(GenerationError, match="m1 lost its connection"):
            async for _ in gen:
                pass
        doc = head.describe()
        assert doc["state"] == "broken" and doc["active"] == [] and doc["queued"] == 0
        gate.set()
        await held
    finally:
        gate.set()
        await ring.stop()
