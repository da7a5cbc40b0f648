"""The API as an attacker tries it, against a real two-member ring of the default model:
keys through the official openai and ollama clients, forwarding member -> head with keys on both,
Host and Origin checks, JSON-only bodies, and the bad input that got a 500 or a 200."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx
import ollama
import openai
import pytest
import pytest_asyncio

from kafila.api.app import create_app
from kafila.api.security import ApiSecurity
from kafila.api.server import ApiServer
from kafila.api.state import Api
from tests.api.served import MODEL, Served, serve_ring

pytestmark = [pytest.mark.network, pytest.mark.asyncio(loop_scope="module")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
KEY, MEMBER_KEY = "head-key-0123456789abcdef", "member-key-0123456789abcdef"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(smollm2_path, tmp_path_factory) -> AsyncIterator[Served]:
    async with serve_ring(smollm2_path, tmp_path_factory.mktemp("traces"), concurrency=2) as s:
        yield s


async def serve(served: Served, security: ApiSecurity, member: bool = False) -> ApiServer:
    """Another API server on the ring's head (or its other member, which forwards to the head)."""
    head = served.head_api
    api = Api(served.ring.members[0], head.codec, MODEL, head.facts) if member else head
    return await ApiServer(create_app(api), security=security).start()  # as a member serves it


def oai(server: ApiServer, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)


async def test_a_key_is_required_on_every_route_and_a_wrong_one_refused(served: Served) -> None:
    server = await serve(served, ApiSecurity((KEY,)))
    try:
        async with oai(server, KEY) as good, oai(server, "not-the-key-0123456789") as bad:
            answer = await good.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=12, temperature=0
            )
            assert "Paris" in (answer.choices[0].message.content or "")
            with pytest.raises(openai.AuthenticationError) as err:
                await bad.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
            assert err.value.body["code"] == "invalid_api_key"  # OpenAI's error object
            with pytest.raises(openai.AuthenticationError):
                await bad.models.list()
        with ollama.Client(host=server.url, headers={"Authorization": f"Bearer {KEY}"}) as oclient:
            done = await asyncio.to_thread(
                oclient.generate, model=MODEL, prompt="Hi", options={"num_predict": 2}
            )
            assert done["done"]
        with ollama.Client(
            host=server.url, headers={"Authorization": "Bearer wrong-key-0123456789"}
        ) as oclient:
            with pytest.raises(ollama.ResponseError) as oerr:
                await asyncio.to_thread(
                    oclient.generate, model=MODEL, prompt="Hi", options={"num_predict": 2}
                )
            assert oerr.value.status_code == 401 and "not one of this member's" in oerr.value.error
        async with httpx.AsyncClient(base_url=server.url) as http:
            for path in ("/session", "/traces", "/metrics", "/api/tags", "/api/version", "/v1/models"):
                r = await http.get(path)
                assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Bearer"), path
            assert (await http.get("/api/tags")).json() == {
                "error": "no API key given: send 'Authorization: Bearer KEY'"
            }
            assert (await http.get("/healthz")).status_code == 200  # monitors need no key
            assert (await http.get("/")).status_code == 200  # the member page holds no data
            for asset in ("/_kafila/page.js", "/_kafila/page.css"):  # nor its scripts, loaded before a key
                assert (await http.get(asset)).status_code == 200, asset
            assert (await http.post("/_kafila/page.js", json={})).status_code == 401  # GET only
            auth = {"Authorization": f"Bearer {KEY}"}
            assert (await http.get("/session", headers=auth)).status_code == 200
    finally:
        await server.stop()


async def test_forwarding_from_a_member_to_the_head_with_keys_on_both(served: Served) -> None:
    """The member forwards over the ring link, not HTTP: its own key is all the client needs."""
    head = await serve(served, ApiSecurity((KEY,)))
    member = await serve(served, ApiSecurity((MEMBER_KEY,)), member=True)
    try:
        async with oai(member, MEMBER_KEY) as client, oai(member, KEY) as with_heads_key:
            answer = await client.chat.completions.create(
                model=MODEL, messages=QUESTION, max_tokens=12, temperature=0
            )
            assert "Paris" in (answer.choices[0].message.content or "")
            with pytest.raises(openai.AuthenticationError):  # keys are per member
                await with_heads_key.models.list()
    finally:
        await member.stop()
        await head.stop()


async def test_browsers_cross_origin_and_rebound_hosts_are_refused(served: Served) -> None:
    """What was found: Host attacker.example with a text/plain body got a 200 generation."""
    url = f"{served.head.url}/v1/completions"
    body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2})
    async with httpx.AsyncClient() as http:
        r = await http.post(
            url, content=body, headers={"Host": "attacker.example", "Content-Type": "application/json"}
        )
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
        r = await http.get(f"{served.head.url}/session", headers={"Host": "attacker.example:11434"})
        assert r.status_code == 421
        r = await http.get(f"{served.head.url}/healthz", headers={"Host": "member-3.internal:11434"})
        assert r.status_code == 200  # a monitor may call it by any name
        r = await http.post(url, content=body, headers={"Content-Type": "text/plain"})
        assert r.status_code == 415 and "application/json" in r.json()["error"]["message"]
        r = await http.post(url, content=body)  # a fetch of a Blob sends no type at all
        assert r.status_code == 415
        r = await http.post(
            f"{served.head.url}/api/generate",
            content=body,
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        assert r.status_code == 415 and "JSON body" in r.json()["error"]
        evil = {"Origin": "http://evil.example", "Content-Type": "application/json"}
        r = await http.post(url, content=body, headers=evil)
        assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
        assert "access-control-allow-origin" not in r.headers
        same = {"Origin": served.head.url, "Content-Type": "application/json"}  # the member page's own fetch
        assert (await http.post(url, content=body, headers=same)).status_code == 200
        page = await http.get(f"{served.head.url}/", headers={"Host": f"localhost:{served.head.port}"})
        assert page.status_code == 200


async def test_an_allowed_origin_gets_cors_answers_and_a_named_host_is_accepted(served: Served) -> None:
    origin = "https://app.example"
    server = await serve(served, ApiSecurity((KEY,), ("kafila.lan",), (origin,)))
    url = f"{server.url}/v1/chat/completions"
    try:
        async with httpx.AsyncClient() as http:
            pre = await http.options(
                url,
                headers={
                    "Origin": origin,
                    "Access-Control-Request-Method": "POST",
                    "Access-Control-Request-Headers": "authorization, content-type",
                },
            )
            assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == origin
            assert "authorization" in pre.headers["access-control-allow-headers"].lower()
            ask = {"model": MODEL, "messages": QUESTION, "max_tokens": 2}
            r = await http.post(url, json=ask, headers={"Origin": origin, "Authorization": f"Bearer {KEY}"})
            assert r.status_code == 200 and r.headers["access-control-allow-origin"] == origin
            r = await http.post(url, json=ask, headers={"Origin": origin})  # the page can read why
            assert r.status_code == 401 and r.headers["access-control-allow-origin"] == origin
            other = await http.post(
                url, json=ask, headers={"Origin": "https://other.example", "Authorization": f"Bearer {KEY}"}
            )
            assert other.status_code == 403
            named = await http.get(
                f"{server.url}/v1/models",
                headers={"Host": f"kafila.lan:{server.port}", "Authorization": f"Bearer {KEY}"},
            )
            assert named.status_code == 200
    finally:
        await server.stop()


async def post(http: httpx.AsyncClient, path: str, body: dict[str, object]) -> httpx.Response:
    """POST `body` as ASCII JSON, lone surrogates escaped as a client in another language sends them
    (httpx itself would refuse to encode them)."""
    return await http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})


async def test_text_the_tokenizer_cannot_take_is_a_400_naming_the_field(served: Served) -> None:
    """A lone UTF-16 surrogate in a completion prompt and a raw generate prompt was a 500."""
    async with httpx.AsyncClient(base_url=served.head.url) as http:
        r = await post(
            http, "/v1/completions", {"model": MODEL, "prompt": "Hi \ud800 there", "max_tokens": 2}
        )
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert "lone UTF-16 surrogate" in r.json()["error"]["message"]
        raw = {"model": MODEL, "prompt": "\udfff", "raw": True, "stream": False}
        r = await post(http, "/api/generate", raw)
        assert r.status_code == 400 and "'prompt' holds a lone UTF-16 surrogate" in r.json()["error"]
        r = await post(
            http, "/api/generate", raw | {"raw": False, "prompt": "Hi", "system": "be \ud83d brief"}
        )
        assert r.status_code == 400 and "'system'" in r.json()["error"]
        chat = {
            "model": MODEL,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}],
        }
        r = await post(http, "/v1/chat/completions", chat)
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content[0].text"
        stop = {"model": MODEL, "prompt": "Hi", "max_tokens": 2, "stop": ["\ud800"]}
        r = await post(http, "/v1/completions", stop)
        assert r.status_code == 400 and r.json()["error"]["param"] == "stop[0]"
    async with oai(served.head, "unused") as client:  # and it still serves
        done = await client.completions.create(
            model=MODEL, prompt="The capital of Germany is", max_tokens=4, temperature=0
        )
        assert "Berlin" in done.choices[0].text


async def test_roles_are_those_the_template_renders_and_tool_answers_name_their_call(served: Served) -> None:
    async with oai(served.member, "unused") as client:
        with pytest.raises(openai.BadRequestError, match="'wizard' is not a role") as err:
            await client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "Hi"}])  # type: ignore[list-item,misc]
        assert err.value.body["param"] == "messages[0].role"
        tool = {"role": "tool", "content": "42"}
        with pytest.raises(openai.BadRequestError, match="needs 'tool_call_id'"):
            await client.chat.completions.create(model=MODEL, messages=[*QUESTION, tool])  # type: ignore[list-item]
        answered = [*QUESTION, tool | {"tool_call_id": "call_1"}]
        done = await client.chat.completions.create(model=MODEL, messages=answered, max_tokens=2)  # type: ignore[arg-type]
        assert done.choices[0].message.content is not None
    with ollama.Client(host=served.member.url) as oclient:
        with pytest.raises(ollama.ResponseError) as oerr:
            await asyncio.to_thread(oclient.chat, model=MODEL, messages=[{"role": "wizard", "content": "Hi"}])
        assert oerr.value.status_code == 400 and "messages[0].role 'wizard'" in oerr.value.error
        for option, value in (("temperature", 7), ("top_k", -1), ("seed", "x"), ("num_predict", 0)):
            with pytest.raises(ollama.ResponseError) as oerr:
                await asyncio.to_thread(oclient.generate, model=MODEL, prompt="Hi", options={option: value})
            assert oerr.value.status_code == 400 and f"'options.{option}'" in oerr.value.error, (
                oerr.value.error
            )
