"""A session that serves one request at a time (concurrency 1): a waiting Ollama stream is told its
queue position (and the official ollama client still parses the stream), and every member's API
serves the trace records that member measured.

The session is a two-member ring of the real default model inside this process (members joined
in memory, as in test_api_clients); requests go through the member that is not the head.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import ollama
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from tests.api.served import MODEL, Served, serve_ring

pytestmark = [pytest.mark.network, pytest.mark.asyncio(loop_scope="module")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
OPTIONS = {"temperature": 0, "num_predict": 32}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(smollm2_path, tmp_path_factory) -> AsyncIterator[Served]:
    async with serve_ring(smollm2_path, tmp_path_factory.mktemp("traces"), concurrency=1) as s:
        yield s


async def ndjson(http: httpx.AsyncClient, url: str, body: dict[str, Any], first: asyncio.Event | None = None):
    """Every line of a streamed Ollama answer; sets `first` when the first text arrives."""
    lines = []
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200
        async for raw in r.aiter_lines():
            if raw:
                lines.append(json.loads(raw))
                if first is not None and lines[-1]["message"]["content"]:
                    first.set()
    return lines


def text(lines: list[dict[str, Any]]) -> str:
    return "".join(d["message"]["content"] for d in lines)


async def running_then(served: Served, second) -> tuple[list[dict[str, Any]], Any]:
    """Start one streamed chat, and once its first text is out (it holds the only slot) run `second`."""
    body = {"model": MODEL, "messages": QUESTION, "options": OPTIONS}
    first = asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as http:
        running = asyncio.ensure_future(ndjson(http, f"{served.member.url}/api/chat", body, first))
        await asyncio.wait_for(first.wait(), 60)
        assert served.ring.head.schedule.active  # the first request is being served
        later = await second()
        return await running, later


async def test_waiting_ollama_stream_is_told_its_position(served: Served) -> None:
    body = {"model": MODEL, "messages": QUESTION, "options": OPTIONS}
    async with httpx.AsyncClient(timeout=120) as http:
        alone = (await http.post(f"{served.member.url}/api/chat", json=body | {"stream": False})).json()
        assert "Paris" in alone["message"]["content"]

        async def second() -> list[dict[str, Any]]:
            return await ndjson(http, f"{served.member.url}/api/chat", body)

        first_lines, second_lines = await running_then(served, second)
    assert second_lines[0]["queue_position"] == 1 and second_lines[0]["message"]["content"] == ""
    assert second_lines[0]["done"] is False
    assert not any("queue_position" in d for d in first_lines)  # the first never waited
    for lines in (first_lines, second_lines):
        assert text(lines) == alone["message"]["content"]
        assert lines[-1]["done"] and lines[-1]["done_reason"] == alone["done_reason"]


async def test_a_request_past_a_full_queue_gets_429_busy_at_the_head_and_through_a_member(
    served: Served,
) -> None:
    """This session queues nothing (as `kafila host --queue 0`) while its one slot is taken."""
    chat = {"model": MODEL, "messages": QUESTION}
    before = await refused_count(served)
    served.ring.head.schedule.max_queue = 0
    try:
        async with httpx.AsyncClient(timeout=60) as http:

            async def refused() -> list[httpx.Response]:
                return [
                    await http.post(f"{served.head.url}/v1/chat/completions", json=chat | {"stream": True}),
                    await http.post(f"{served.member.url}/v1/chat/completions", json=chat),
                    await http.post(f"{served.member.url}/api/chat", json=chat | {"stream": False}),
                    # streamed through a member: it used to send 200 and the refusal in the stream
                    await http.post(f"{served.member.url}/v1/chat/completions", json=chat | {"stream": True}),
                    await http.post(f"{served.member.url}/api/chat", json=chat),
                ]

            first_lines, answers = await running_then(served, refused)
    finally:
        served.ring.head.schedule.max_queue = None
    assert [r.status_code for r in answers] == [429] * 5
    assert [r.headers.get("retry-after") for r in answers] == ["1"] * 5  # openai's client waits that long
    openai_error = answers[1].json()["error"]
    assert openai_error["code"] == "busy" and "queues no request; try again later" in openai_error["message"]
    assert "all 1 slot of this session are busy" in answers[2].json()["error"]
    assert "Paris" in text(first_lines)  # the one being served was not disturbed
    assert await refused_count(served) == before + 5  # one registry per process: counted from before


async def refused_count(served: Served) -> float:
    async with httpx.AsyncClient() as http:
        exported = (await http.get(f"{served.head.url}/metrics")).text
    line = 'kafila_requests_total{finished_reason="refused"'  # then the session's labels, if any
    return sum(float(x.split()[-1]) for x in exported.splitlines() if x.startswith(line))


def client_stream(url: str) -> tuple[str, list[str], bool]:
    """The official client's streamed generate: (joined text, every chunk's text, last chunk done)."""
    with ollama.Client(host=url, timeout=120) as client:
        chunks = list(client.generate(model=MODEL, prompt="What is the capital of France?", stream=True,
                                      options=OPTIONS))  # fmt: skip
    return "".join(c.response for c in chunks), [c.response for c in chunks], bool(chunks[-1].done)


async def test_official_ollama_client_parses_a_waiting_stream(served: Served) -> None:
    alone, _, _ = await asyncio.to_thread(client_stream, served.member.url)
    first_lines, (waited, chunks, done) = await running_then(
        served, lambda: asyncio.to_thread(client_stream, served.member.url)
    )
    assert "Paris" in alone and waited == alone and done
    assert chunks[0] == ""  # the queue line, an ordinary empty chunk to the client
    assert "Paris" in text(first_lines)


async def traces_when(http: httpx.AsyncClient, url: str, ok, within: float = 10.0) -> list[dict[str, Any]]:
    for _ in range(int(within / 0.05)):
        traces = (await http.get(f"{url}/traces")).json()["traces"]
        if ok(traces):
            return traces
        await asyncio.sleep(0.05)
    raise AssertionError(f"{url}/traces did not get the expected records within {within} s")


async def test_every_member_serves_what_it_measured(served: Served) -> None:
    body = {"model": MODEL, "messages": QUESTION, "options": OPTIONS, "stream": False}
    async with httpx.AsyncClient(timeout=120) as http:
        await http.post(f"{served.member.url}/api/chat", json=body)
        # the records follow the answer: written when the request's free notice passes each member
        rid = served.ring.members[0].ids.next() - 1  # the id the member gave that request

        def has(kind: str):
            return lambda ts: any(d["type"] == kind and d.get("request_id") == rid for d in ts)

        mine = await traces_when(http, served.member.url, has("stage"))
        ring = await traces_when(http, served.head.url, has("request"))
        metrics = (await http.get(f"{served.member.url}/metrics")).text
    [stage] = [d for d in mine if d.get("request_id") == rid]
    assert stage["member"] == "m1" and stage["index"] == 1 and stage["decode_ms"] > 0
    assert stage["decode_steps"] > 0 and len(stage["prefill_ms"]) >= 1
    assert not [d for d in mine if d["type"] == "request"]  # the ring's view is the head's
    [request] = [d for d in ring if d["type"] == "request" and d["request_id"] == stage["request_id"]]
    back = request["hops"][1]  # m1 -> m0, counted by m1's link
    assert (back["src"], back["dst"]) == ("m1", "m0")
    assert back["bytes"] == stage["hop_out"]["bytes"] > 0
    assert request["stages"][1]["measured_ms"] == pytest.approx(stage["decode_ms"])
    hops = [s.labels for f in text_string_to_metric_families(metrics) for s in f.samples
            if s.name == "kafila_hop_bytes_total"]  # fmt: skip
    assert {"hop": "m1->m0", "path": "local"}.items() <= next(h for h in hops if h["hop"] == "m1->m0").items()


async def test_an_answer_ended_by_a_stop_string_is_recorded_as_stopped(served: Served) -> None:
    """The API ends the answer on the stop string (the head would decode on): the head records it
    as finished "stop", not as a request the client abandoned (it used to write no record)."""
    body = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 32, "stop": ["Paris"]}
    async with httpx.AsyncClient(timeout=120) as http:
        r = await http.post(f"{served.member.url}/v1/chat/completions", json=body)
        rid = served.ring.members[0].ids.next() - 1  # the id the member gave that request
        ring = await traces_when(
            http,
            served.head.url,
            lambda ts: any(d.get("request_id") == rid for d in ts if d["type"] == "request"),
        )
    [choice] = r.json()["choices"]
    assert choice["finish_reason"] == "stop" and "Paris" not in choice["message"]["content"]
    [request] = [d for d in ring if d["type"] == "request" and d["request_id"] == rid]
    assert request["finish"] == "stop" and request["completion_tokens"] >= 1
