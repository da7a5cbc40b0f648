"""Streaming clients keep their connection while the ring re-plans: a ring of three stages of the
default model in this process (roles joined in memory, kafila.session.ring as in a session), the
head serving the API with uvicorn on loopback; m1 dies mid-answer, the head and m2 hold their
requests for seconds, and meanwhile each stream gets a keep-alive its client skips: an SSE comment
`: replanning` (OpenAI) and an empty chunk marked `"replanning": true` (Ollama's NDJSON). The
official `openai` and `ollama` clients read the held streams to the same answers as before."""

from __future__ import annotations

import asyncio
import gc
import json
import warnings

import httpx
import ollama
import openai
import pytest

from kafila.api.app import create_app
from kafila.api.server import ApiServer
from kafila.api.state import Api, ModelFacts
from kafila.api.stream import KEEPALIVE_S
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from kafila.session.ring.textcodec import TokenizerCodec
from tests.session.ringkit import build_ring, recovers_from_losing, replan_without_m1, replanning

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m"
ASK = [{"role": "user", "content": "Count from 1 to 40, separated by commas."}]
TOKENS = 40


async def sse_lines(url: str) -> list[str]:
    body = {"model": MODEL, "messages": ASK, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    async with (
        httpx.AsyncClient(timeout=120) as http,
        http.stream("POST", f"{url}/v1/chat/completions", json=body) as r,
    ):
        assert r.status_code == 200
        return [line async for line in r.aiter_lines() if line]


def sse_text(lines: list[str]) -> str:
    chunks = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
    return "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])


async def openai_text(url: str) -> str:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    stream = await client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        max_tokens=TOKENS,
        temperature=0,
        stream=True,  # type: ignore[arg-type]
    )
    return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])


async def ollama_chunks(url: str) -> list[ollama.ChatResponse]:
    opts = {"num_predict": TOKENS, "temperature": 0}
    async with ollama.AsyncClient(host=url, timeout=120) as client:
        return [c async for c in await client.chat(model=MODEL, messages=ASK, stream=True, options=opts)]


def ollama_text(chunks: list[ollama.ChatResponse]) -> str:
    return "".join(c.message.content or "" for c in chunks)


async def test_streams_held_by_a_replan_get_keepalives_and_end_as_uninterrupted(smollm2_path) -> None:
    ckpt = Checkpoint.open(smollm2_path)
    ring = build_ring(
        ckpt, [(0, 10), (10, 20), (20, 30)], context=256, concurrency=3, chunk=64, dead_after=2.0
    )
    recovers_from_losing(ring, "m1")
    facts = ModelFacts.of(ckpt.config, ckpt.stored_dtype)
    codec = TokenizerCodec(Tokenizer.from_checkpoint(ckpt))
    server = await ApiServer(create_app(Api(ring.head, codec, MODEL, facts))).start()
    c0 = None
    try:
        expected = sse_text(await sse_lines(server.url))
        assert len(expected) > 20
        jobs = (
            asyncio.ensure_future(sse_lines(server.url)),
            asyncio.ensure_future(openai_text(server.url)),
            asyncio.ensure_future(ollama_chunks(server.url)),
        )
        while len(ring.head._reqs) < 3 or min(r.generated for r in ring.head._reqs.values()) < 3:
            assert not any(j.done() for j in jobs), "an answer ended before the member was lost"
            await asyncio.sleep(0.005)
        ring.kill(1)
        await replanning(ring, 2)
        await asyncio.sleep(2.5 * KEEPALIVE_S)  # the re-plan takes its time: two keep-alives each
        assert not any(j.done() for j in jobs)
        c0, _ = await replan_without_m1(ring, ckpt, [(0, 15), (15, 30)], context=256, concurrency=3)
        lines, oai_text, chunks = await asyncio.wait_for(asyncio.gather(*jobs), 120)
        assert lines.count(": replanning") >= 2 and lines[-1] == "data: [DONE]"
        assert sse_text(lines) == oai_text == ollama_text(chunks) == expected
        held = [c for c in chunks if not c.done and not c.message.content]
        assert len(held) >= 2 and chunks[-1].done and chunks[-1].done_reason in ("stop", "length")
    finally:
        await server.stop()
        if c0 is not None:
            await c0.close()
        await ring.stop()
        await asyncio.sleep(0.2)  # let closed connections' transports finish closing before the loop ends
        with warnings.catch_warnings():  # a client connection one of the three clients leaves to the GC
            warnings.simplefilter("ignore", ResourceWarning)  # (source not found yet): not the next test's
            gc.collect()
