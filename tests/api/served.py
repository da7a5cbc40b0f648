"""A two-member ring of the real default model inside this process, each member serving the API
with uvicorn on loopback (the member that is not the head forwards around the ring)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from kafila.api.app import create_app
from kafila.api.server import ApiServer
from kafila.api.state import Api, ModelFacts
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from kafila.obs.trace import TraceLog
from kafila.session.ring.textcodec import TokenizerCodec
from tests.session.ringkit import Ring, build_ring

MODEL = "smollm2-135m"


@dataclass
class Served:
    ring: Ring
    head: ApiServer
    member: ApiServer
    head_api: Api  # what the head's app serves (to build another app on it)


@contextlib.asynccontextmanager
async def serve_ring(model: Path, traces: Path, concurrency: int) -> AsyncIterator[Served]:
    """Blocks [0, 12) + head at m0, [12, 30) at m1; each member's trace file in `traces`."""
    ckpt = Checkpoint.open(model)
    ring = build_ring(ckpt, [(0, 12), (12, 30)], context=256, concurrency=concurrency, chunk=64)
    codec = TokenizerCodec(Tokenizer.from_checkpoint(ckpt))
    ring.head.traces, ring.members[0].traces = TraceLog(traces / "m0.jsonl"), TraceLog(traces / "m1.jsonl")
    facts = ModelFacts.of(ckpt.config, ckpt.stored_dtype)
    m1, head_api = ring.members[0], Api(ring.head, codec, MODEL, facts, ring.head.traces)
    head = await ApiServer(create_app(head_api)).start()
    member = await ApiServer(create_app(Api(m1, codec, MODEL, facts, m1.traces))).start()
    try:
        yield Served(ring, head, member, head_api)
    finally:
        await head.stop()
        await member.stop()
        await ring.stop()
        await asyncio.sleep(0.2)  # let closed connections' transports finish closing before the loop ends
