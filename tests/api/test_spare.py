"""A spare's API relays every request over a real QUIC link on loopback to its host, whose API
answers it through the host's ring role (kafila.api.spare, kafila.session.ring.relay). The ring is
two members of the real default model in this process (tests/api/served.py); the host is the
member that is not the head, so a relayed request travels: spare -> host's link -> host's ring role
-> head, and back. The spare's clients get what the host's would (text, streams, status codes),
the head's records name the spare as the member that asked, and once the link is gone the spare
answers 503 saying so."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import pytest_asyncio

from kafila.api.forming import FormingStatus
from kafila.api.server import ApiServer
from kafila.api.spare import SpareRelay, spare_app
from kafila.net.auth import EdgeContext
from kafila.net.link import Link
from kafila.session.ring.relay import SpareAsks, relay_app
from tests.api.served import MODEL, Served, serve_ring
from tests.net.conftest import direct_pair

pytestmark = [pytest.mark.network, pytest.mark.asyncio(loop_scope="module")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 16}


@dataclass
class Spared:
    served: Served
    spare: ApiServer  # the spare's API, relaying to the host m1
    status: FormingStatus
    spare_link: Link  # the spare's end of its control link
    host_link: Link


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def spared(smollm2_path, tmp_path_factory) -> AsyncIterator[Spared]:
    async with serve_ring(smollm2_path, tmp_path_factory.mktemp("traces"), concurrency=1) as served:
        ctx = EdgeContext("S-loop", "s", "m1", b"correct horse")
        spare_link, host_link, a, b = await direct_pair(ctx, ctx)
        await asyncio.gather(spare_link.wait_ready(), host_link.wait_ready())
        m1 = served.ring.members[0]
        SpareAsks("s", host_link, relay_app(served.head_api, lambda: m1, "s"))  # m1's API, naming s
        status = FormingStatus("member", name="s", step="waiting for the host's plan", spare="why", host="m1")
        spare = await ApiServer(spare_app(status, SpareRelay(spare_link, "m1"))).start()
        try:
            yield Spared(served, spare, status, spare_link, host_link)
        finally:
            await spare.stop()
            await spare_link.close()
            await host_link.close()
            a.close()
            b.close()


async def sse_text(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> str:
    out = []
    async with http.stream("POST", url, json=body | {"stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                out += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
    return "".join(out)


async def test_a_spare_answers_every_route_as_its_host_and_the_head_names_it(spared: Spared) -> None:
    host, spare = spared.served.member.url, spared.spare.url
    ollama = {"model": MODEL, "messages": QUESTION, "options": {"temperature": 0, "num_predict": 16}}
    async with httpx.AsyncClient(timeout=120) as http:
        direct = (await http.post(f"{host}/v1/chat/completions", json=GREEDY)).json()
        relayed = await http.post(f"{spare}/v1/chat/completions", json=GREEDY)
        streamed = await sse_text(http, f"{spare}/v1/chat/completions", GREEDY)
        collected = (await http.post(f"{spare}/api/chat", json=ollama | {"stream": False})).json()
        async with http.stream("POST", f"{spare}/api/chat", json=ollama) as r:
            lines = [json.loads(raw) async for raw in r.aiter_lines() if raw]
        models = (await http.get(f"{spare}/v1/models")).json()
        session = (await http.get(f"{spare}/session")).json()
        traces = (await http.get(f"{spared.served.head.url}/traces")).json()["traces"]
    text = direct["choices"][0]["message"]["content"]
    assert "Paris" in text
    assert relayed.status_code == 200 and relayed.json()["choices"][0]["message"]["content"] == text
    assert streamed == text
    assert collected["message"]["content"] == text and collected["done"]
    assert "".join(d["message"]["content"] for d in lines) == text and lines[-1]["done"]
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert session["state"] == "spare" and session["host"] == "m1" and session["me"] == "s"
    askers = [d["member"] for d in traces if d["type"] == "request"]
    assert askers.count("s") == 4 and "m1" in askers  # the head names who really asked


async def test_errors_reach_the_spares_client_with_the_hosts_status(spared: Spared) -> None:
    """A full queue's 429 (with its Retry-After) and a refused parameter's 400, as the host gives them."""
    host, spare = spared.served.member.url, spared.spare.url
    head = spared.served.ring.head
    bad = GREEDY | {"temperature": -1}
    async with httpx.AsyncClient(timeout=120) as http:
        wrong = [await http.post(f"{u}/v1/chat/completions", json=bad) for u in (host, spare)]
        head.schedule.max_queue = 0
        try:
            first = asyncio.Event()

            async def running() -> str:
                out = []
                body = GREEDY | {"max_tokens": 48, "stream": True}
                async with http.stream("POST", f"{spare}/v1/chat/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            out += [c["delta"].get("content") or "" for c in json.loads(line[6:])["choices"]]
                            first.set()
                return "".join(out)

            task = asyncio.ensure_future(running())
            await asyncio.wait_for(first.wait(), 60)
            chat = {"model": MODEL, "messages": QUESTION}
            busy = [
                await http.post(f"{spare}/v1/chat/completions", json=GREEDY),
                await http.post(f"{spare}/api/chat", json=chat),
            ]
            served_text = await task
        finally:
            head.schedule.max_queue = None
    assert [r.status_code for r in wrong] == [400, 400] and wrong[0].json() == wrong[1].json()
    assert [r.status_code for r in busy] == [429, 429]
    assert [r.headers.get("retry-after") for r in busy] == ["1", "1"]
    assert busy[0].json()["error"]["code"] == "busy" and "Paris" in served_text


async def test_a_spare_whose_link_went_answers_503_saying_so(spared: Spared) -> None:
    """Last in this module: the link closes while a streamed answer runs; the stream ends, the host
    cancels the request at the head, and every later request gets 503 naming the host."""
    spare = spared.spare.url
    head = spared.served.ring.head
    async with httpx.AsyncClient(timeout=120) as http:
        body = GREEDY | {"max_tokens": 200, "stream": True}
        lines = []
        async with http.stream("POST", f"{spare}/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                lines.append(line)
                if line.startswith("data: {") and not spared.host_link.closed:
                    await spared.host_link.close("test: the spare's control link is cut")
        assert lines and "data: [DONE]" not in lines  # the body ends where it got to
        for _ in range(100):  # the host cancelled it: the head holds nothing
            if not head.schedule.active:
                break
            await asyncio.sleep(0.1)
        after = await http.post(f"{spare}/v1/chat/completions", json=GREEDY)
        health = await http.get(f"{spare}/healthz")
    assert not head.schedule.active
    assert after.status_code == 503 and after.json()["error"]["code"] == "host_unreachable"
    message = after.json()["error"]["message"]
    assert "relays its requests to the host m1, but its control link to the host is gone" in message
    assert health.status_code == 503 and health.json()["state"] == "spare"
