"""The API on every member, driven by the official openai and ollama clients over real HTTP.

The session is a two-member ring of the real default model (SmolLM2-135M-Instruct) inside this
process (members joined in memory); each member serves the API with uvicorn on loopback, and the
member that is not the head forwards its requests around the ring.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator

import httpx
import ollama
import openai
import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

import kafila
from kafila.api import openai as openai_routes
from kafila.api.app import create_app
from kafila.api.server import ApiServer
from kafila.api.service import GenerationError, Sampling
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from tests.api.served import MODEL, Served, serve_ring

pytestmark = [pytest.mark.network, pytest.mark.asyncio(loop_scope="module")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(smollm2_path, tmp_path_factory) -> AsyncIterator[Served]:
    async with serve_ring(smollm2_path, tmp_path_factory.mktemp("traces"), concurrency=2) as s:
        yield s


def oai(server: ApiServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


async def test_openai_chat_through_a_member_that_is_not_the_head(served: Served) -> None:
    async with oai(served.member) as member, oai(served.head) as head:
        via_member = await member.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=24, temperature=0
        )
        via_head = await head.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=24, temperature=0
        )
    answer = via_member.choices[0].message.content
    assert "Paris" in answer
    assert via_head.choices[0].message.content == answer
    assert via_member.usage.completion_tokens > 0 and via_member.usage.prompt_tokens > 5


async def test_openai_streaming_equals_the_whole_answer(served: Served) -> None:
    parts, finish, created = [], None, set()
    asked = int(time.time())
    async with oai(served.member) as client:
        whole = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=20, temperature=0
        )
        stream = await client.chat.completions.create(
            model=MODEL, messages=QUESTION, max_tokens=20, temperature=0, stream=True
        )
        async for chunk in stream:
            parts.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
            created.add(chunk.created)
    assert "".join(parts) == whole.choices[0].message.content
    assert finish == whole.choices[0].finish_reason
    # each completion's own time, the same in every chunk (it was when the API started)
    assert whole.created >= asked and len(created) == 1 and created.pop() >= whole.created


async def test_openai_completions_and_models(served: Served) -> None:
    async with oai(served.head) as client:
        done = await client.completions.create(
            model=MODEL, prompt="The capital of Germany is", max_tokens=6, temperature=0
        )
        assert "Berlin" in done.choices[0].text
        stream = await client.completions.create(
            model=MODEL, prompt="The capital of Germany is", max_tokens=6, temperature=0, stream=True
        )
        assert "".join([c.choices[0].text async for c in stream]) == done.choices[0].text
        assert [m.id for m in (await client.models.list()).data] == [MODEL]


async def test_openai_stop_strings_cut_the_answer(served: Served) -> None:
    async with oai(served.head) as client:
        r = await client.completions.create(
            model=MODEL, prompt="The capital of Germany is", max_tokens=8, temperature=0, stop=["Ber"]
        )
    assert "Ber" not in r.choices[0].text and r.choices[0].finish_reason == "stop"


async def test_openai_stream_ends_with_the_usage_when_asked(served: Served) -> None:
    ask = {"model": MODEL, "messages": QUESTION, "max_tokens": 10, "temperature": 0}
    async with oai(served.member) as client:
        whole = await client.chat.completions.create(**ask)  # type: ignore[call-overload]
        stream = await client.chat.completions.create(
            **ask, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        with pytest.raises(openai.BadRequestError, match="only allowed when 'stream' is true"):
            await client.chat.completions.create(**ask, stream_options={"include_usage": True})
    *answer, last = chunks
    assert last.choices == [] and last.usage == whole.usage  # the same tokens, counted the same
    assert all(c.usage is None for c in answer)
    assert "".join(c.choices[0].delta.content or "" for c in answer) == whole.choices[0].message.content


async def test_openai_completion_of_token_ids_is_the_completion_of_their_text(
    served: Served, smollm2_path
) -> None:
    text = "The capital of Germany is"
    ids = Tokenizer.from_checkpoint(Checkpoint.open(smollm2_path)).encode(text)
    async with oai(served.member) as client:
        by_text, by_ids, nested = [
            await client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0)  # type: ignore[arg-type]
            for p in (text, ids, [ids])
        ]
        with pytest.raises(openai.BadRequestError, match="token 1000000 is outside the model's vocabulary"):
            await client.completions.create(model=MODEL, prompt=[1, 10**6], max_tokens=2)
    assert by_ids.choices[0].text == by_text.choices[0].text == nested.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)


async def test_openai_retrieves_the_served_model_and_names_it_for_another(served: Served) -> None:
    async with oai(served.member) as client:
        assert (await client.models.retrieve(MODEL)).id == MODEL
        with pytest.raises(openai.NotFoundError, match=f"this session serves '{MODEL}'"):
            await client.models.retrieve("llama-70b")


async def test_a_wrong_method_is_a_405_in_the_routes_own_error_shape(served: Served) -> None:
    async with httpx.AsyncClient() as http:
        r = await http.get(f"{served.head.url}/v1/chat/completions")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert r.json()["error"]["message"] == "/v1/chat/completions does not take GET; use POST"
        r = await http.get(f"{served.head.url}/api/chat")
        assert r.status_code == 405 and r.json() == {"error": "/api/chat does not take GET; use POST"}


async def test_the_root_answers_as_ollamas_does_on_every_member(served: Served) -> None:
    # clients and monitors look for a running server at / before calling /api (it was a 404)
    async with httpx.AsyncClient() as http:
        for member in (served.head, served.member):
            got = await http.get(f"{member.url}/")
            assert got.status_code == 200 and got.text.startswith("Kafila is running (OpenAI API at /v1")
            assert (await http.head(f"{member.url}/")).status_code == 200
        assert (await http.get(f"{served.head.url}/v2/nothing")).status_code == 404


def ollama_facts(url: str) -> tuple[ollama.ShowResponse, ollama.ProcessResponse, dict[str, str]]:
    with ollama.Client(host=url) as client:
        return client.show(MODEL), client.ps(), httpx.get(f"{url}/api/version").json()


async def test_ollama_show_ps_and_version_describe_the_served_model(served: Served, smollm2_path) -> None:
    shown, running, version = await asyncio.to_thread(ollama_facts, served.member.url)
    weights = Checkpoint.open(smollm2_path).manifest().total_bytes  # the checkpoint's own tensors
    assert shown.details.family == "llama" and shown.details.quantization_level == "F32"
    assert shown.modelinfo["llama.context_length"] == 256  # the session's context, what fits a request
    assert shown.modelinfo["general.parameter_count"] * 4 == weights
    assert shown.details.parameter_size == "134.5M" and shown.capabilities == ["completion"]
    [loaded] = running.models
    assert loaded.model == MODEL and loaded.size == weights and loaded.context_length == 256
    assert version == {"version": kafila.__version__}


async def test_any_integer_seed_repeats_and_top_p_zero_is_the_most_likely_token(served: Served) -> None:
    ask = {"model": MODEL, "prompt": "The capital of Germany is", "max_tokens": 6}
    async with oai(served.member) as client:
        seeded = [
            (await client.completions.create(**ask, temperature=1.0, seed=-5)).choices[0].text for _ in "ab"
        ]
        greedy = await client.completions.create(**ask, temperature=0)
        narrow = await client.completions.create(**ask, temperature=1.5, top_p=0)
    assert seeded[0] == seeded[1]  # a negative seed was a 500 before
    assert narrow.choices[0].text == greedy.choices[0].text  # top_p 0 was read as 1 (no top-p)
    with ollama.Client(host=served.member.url) as oclient:
        opts = {"num_predict": 3, "temperature": 1.0, "seed": -1}  # Ollama's default seed: random
        done = await asyncio.to_thread(oclient.generate, model=MODEL, prompt="Hi", options=opts)
    assert done["done"] and done["eval_count"] == 3


async def test_a_forwarded_request_with_bad_sampling_is_refused_and_the_ring_keeps_serving(
    served: Served,
) -> None:
    """A member whose API did not check (another version, a bug) forwards temperature -1 and a seed
    numpy cannot take: the head answers that request with an error instead of breaking the ring."""
    member = served.ring.members[0]
    for bad in (Sampling(max_tokens=2, temperature=-1.0), Sampling(max_tokens=2, temperature=1.0, seed=-5)):
        try:  # refused by the head before any answer: submit raises it
            tokens = [ev async for ev in await member.submit([1, 2, 3], bad)]
        except GenerationError as exc:
            assert exc.code == "bad_request" and "temperature must be" in exc.message
        else:
            assert bad.seed == -5 and tokens  # a negative seed is a fixed seed now
    for ids in ([1, 2, 10**6], [-1]):  # the head's embedding would fail on them (IndexError)
        with pytest.raises(
            GenerationError, match=r"prompt token -?\d+ is outside the model's vocabulary \(0-49151\)"
        ):
            [ev async for ev in await member.submit(ids, Sampling(max_tokens=2))]
    assert served.ring.head.broken is None
    async with oai(served.member) as client:
        r = await client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2


async def test_a_fault_of_the_server_is_a_named_json_500(served: Served, monkeypatch) -> None:
    def broken(request: object) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(openai_routes, "models", broken)  # a route with a bug, in a fresh app
    app = create_app(served.head_api)
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
    async with httpx.AsyncClient(transport=transport, base_url="http://kafila") as http:
        r = await http.get("/v1/models")
    assert r.status_code == 500
    assert r.json()["error"] == {
        "message": "internal error: RuntimeError('boom')",
        "type": "server_error",
        "param": None,
        "code": "internal",
    }


def ollama_session(url: str) -> tuple[str, str, str, list[str]]:
    """The ollama client's calls (its synchronous client, run on a worker thread)."""
    options = {"temperature": 0, "num_predict": 24}
    with ollama.Client(host=url) as client:
        whole = client.chat(model=MODEL, messages=QUESTION, options=options)
        assert whole.done and whole.eval_count > 0
        parts = [
            p.message.content
            for p in client.chat(model=MODEL, messages=QUESTION, stream=True, options=options)
        ]
        raw = {"temperature": 0, "num_predict": 6}
        gen = client.generate(model=MODEL, prompt="The capital of Germany is", raw=True, options=raw)
        return whole.message.content, "".join(parts), gen.response, [m.model for m in client.list().models]


async def test_ollama_chat_generate_and_tags(served: Served) -> None:
    whole, streamed, generated, models = await asyncio.to_thread(ollama_session, served.member.url)
    assert "Paris" in whole and streamed == whole
    assert "Berlin" in generated
    assert models == [MODEL]


async def test_errors_are_clear_4xx_json(served: Served) -> None:
    async with oai(served.member) as client:
        with pytest.raises(openai.NotFoundError, match="'llama-70b' is not served here"):
            await client.chat.completions.create(model="llama-70b", messages=QUESTION)
        with pytest.raises(openai.BadRequestError, match="temperature"):
            await client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=7)
        with pytest.raises(openai.BadRequestError, match="context is 256 tokens") as err:
            await client.completions.create(model=MODEL, prompt="Paris " * 400, max_tokens=4)
    assert err.value.body["code"] == "context_length_exceeded"
    with ollama.Client(host=served.member.url) as oclient, pytest.raises(ollama.ResponseError) as oerr:
        await asyncio.to_thread(oclient.chat, model="nope", messages=QUESTION)
    assert oerr.value.status_code == 404 and "not served here" in oerr.value.error
    async with httpx.AsyncClient() as http:
        r = await http.post(
            f"{served.head.url}/v1/chat/completions",
            content=b"{not json",
            headers={"Content-Type": "application/json"},
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


async def test_parameters_not_implemented_are_refused_by_name_unless_unused(served: Served) -> None:
    async with oai(served.member) as client:
        refused = r"'logprobs' is not supported here \(got 2\)"
        with pytest.raises(openai.BadRequestError, match=refused) as err:
            await client.completions.create(model=MODEL, prompt="Paris", max_tokens=2, logprobs=2)
        assert err.value.body["param"] == "logprobs"
        with pytest.raises(openai.BadRequestError, match="'top_logprobs' is not supported here"):
            await client.chat.completions.create(model=MODEL, messages=QUESTION, top_logprobs=3)
        with pytest.raises(openai.BadRequestError, match="'response_format' is not supported here"):
            fmt = {"type": "json_object"}
            await client.chat.completions.create(model=MODEL, messages=QUESTION, response_format=fmt)  # type: ignore[arg-type]
        with pytest.raises(openai.BadRequestError, match="'modalities' is not supported here"):
            await client.chat.completions.create(model=MODEL, messages=QUESTION, modalities=["text", "audio"])
        # the values that mean "not used", as some clients send them, are answered
        unused = {"logprobs": False, "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {},
                  "modalities": ["text"]}  # fmt: skip
        answer = await client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2, **unused)
        assert answer.choices[0].message.content
    with ollama.Client(host=served.member.url) as oclient:
        for kw, name in (
            ({"format": "json"}, "format"),
            ({"options": {"mirostat": 2}}, "options.mirostat"),
        ):
            with pytest.raises(ollama.ResponseError) as oerr:
                await asyncio.to_thread(oclient.generate, model=MODEL, prompt="Hi", **kw)
            assert oerr.value.status_code == 400 and f"'{name}' is not supported here" in oerr.value.error
        neutral = {"num_predict": 2, "repeat_penalty": 1.0, "typical_p": 1.0}
        done = await asyncio.to_thread(oclient.generate, model=MODEL, prompt="Hi", options=neutral)
        assert done["done"] and done["eval_count"] == 2


COUNT = [{"role": "user", "content": "Count from 1 to 20, separated by commas."}]


async def test_penalties_reach_the_sampler_through_both_apis_and_any_member(served: Served) -> None:
    """OpenAI's frequency and presence penalties and Ollama's repeat penalty change a greedy answer
    that repeats itself (a numbered list: "1. 1\n2. 2\n..."), alike through the head and a forwarding
    member."""
    async with oai(served.member) as member, oai(served.head) as head:
        ask = {"model": MODEL, "messages": COUNT, "max_tokens": 24, "temperature": 0}
        plain = (await member.chat.completions.create(**ask)).choices[0].message.content
        penalized = {"frequency_penalty": 2.0, "presence_penalty": 0.5}
        via_member = (await member.chat.completions.create(**ask, **penalized)).choices[0].message.content
        via_head = (await head.chat.completions.create(**ask, **penalized)).choices[0].message.content
    assert plain.count("\n") >= 4 and via_member != plain and via_member == via_head, (plain, via_member)
    with ollama.Client(host=served.member.url) as m, ollama.Client(host=served.head.url) as h:
        opts = {"num_predict": 24, "temperature": 0}
        plain = (await asyncio.to_thread(m.chat, model=MODEL, messages=COUNT, options=opts))["message"][
            "content"
        ]
        opts |= {"repeat_penalty": 1.5, "repeat_last_n": -1}
        via_member = (await asyncio.to_thread(m.chat, model=MODEL, messages=COUNT, options=opts))["message"][
            "content"
        ]
        via_head = (await asyncio.to_thread(h.chat, model=MODEL, messages=COUNT, options=opts))["message"][
            "content"
        ]
    assert via_member != plain and via_member == via_head, (plain, via_member)
    async with httpx.AsyncClient() as http:
        body = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"repeat_penalty": 0}}
        r = await http.post(f"{served.member.url}/api/generate", json=body)
        assert r.status_code == 400 and "'options.repeat_penalty' must be > 0 (1 is off), got 0" in r.text
        r = await http.post(
            f"{served.member.url}/v1/chat/completions",
            json={"model": MODEL, "messages": COUNT, "frequency_penalty": 3},
        )
        assert r.status_code == 400 and "'frequency_penalty' must be a number in [-2.0, 2.0], got 3" in r.text
        body = {"model": MODEL, "prompt": "Hi", "stream": False, "options": {"min_p": 2, "num_predict": 2}}
        r = await http.post(f"{served.member.url}/api/generate", json=body)
        assert r.status_code == 400 and "'options.min_p' must be a number in [0.0, 1.0], got 2" in r.text
        body["options"] |= {"min_p": 0.5, "temperature": 1.0, "seed": 7}
        r = await http.post(f"{served.member.url}/api/generate", json=body)
        assert r.status_code == 200 and r.json()["eval_count"] == 2


def ollama_refusals(url: str) -> dict[str, str]:
    """What the ollama client hears back for each part of a request this server does not serve."""
    image = b"\x89PNG\r\n\x1a\n" + bytes(64)
    asks = {
        "messages[0].images": ("chat", {"messages": [{**QUESTION[0], "images": [image]}]}),
        "think": ("chat", {"messages": QUESTION, "think": True}),
        "tools": ("chat", {"messages": QUESTION, "tools": [{"type": "function", "function": {"name": "f"}}]}),
        "images": ("generate", {"prompt": "What is this?", "images": [image]}),
        "template": ("generate", {"prompt": "Hi", "template": "{{ .Prompt }}"}),
        "suffix": ("generate", {"prompt": "def f(", "suffix": "return 1"}),
        "context": ("generate", {"prompt": "And then?", "context": [1, 2, 3]}),
    }
    heard = {}
    with ollama.Client(host=url) as client:
        for name, (route, kw) in asks.items():
            try:
                getattr(client, route)(model=MODEL, options={"num_predict": 2}, **kw)
            except ollama.ResponseError as exc:
                heard[name] = f"{exc.status_code} {exc.error}"
    return heard


async def test_ollama_request_parts_not_served_are_refused_by_name(served: Served) -> None:
    heard = await asyncio.to_thread(ollama_refusals, served.member.url)
    for name in ("messages[0].images", "think", "tools", "images", "template", "suffix", "context"):
        assert heard.get(name, "").startswith(f"400 '{name}' is not supported here"), (name, heard.get(name))
    assert len(heard["messages[0].images"]) < 200  # the image is not echoed back


async def test_ollama_generate_places_its_system_message(served: Served) -> None:
    system, opts = "Answer with one word only.", {"temperature": 0, "num_predict": 8}
    question = QUESTION[0]["content"]
    with ollama.Client(host=served.member.url) as client:
        msgs = [{"role": "system", "content": system}, *QUESTION]
        chat = await asyncio.to_thread(client.chat, model=MODEL, messages=msgs, options=opts)
        ask = {"model": MODEL, "prompt": question, "options": opts}
        gen = await asyncio.to_thread(client.generate, **ask, system=system)
        plain = await asyncio.to_thread(client.generate, **ask)
    # the same prompt as the chat's, rendered by the model's template; without `system` the template
    # puts its own default system message there (SmolLM2's names the model), so the prompts differ
    assert gen.response == chat.message.content and gen.prompt_eval_count == chat.prompt_eval_count
    assert gen.prompt_eval_count != plain.prompt_eval_count


async def test_text_parts_and_the_developer_role_read_as_plain_content_and_system(served: Served) -> None:
    system = {"role": "system", "content": "Answer in one word."}
    plain = [system, *QUESTION]
    parts = [
        {"role": "developer", "content": [{"type": "text", "text": "Answer in one word."}]},
        {"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]},
    ]
    async with oai(served.member) as client:
        want, got = [
            await client.chat.completions.create(model=MODEL, messages=m, max_tokens=6, temperature=0)  # type: ignore[arg-type]
            for m in (plain, parts)
        ]
        assert got.choices[0].message.content == want.choices[0].message.content  # greedy: the same prompt
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        with pytest.raises(
            openai.BadRequestError, match=r"content\[1\]: only text parts are served, got 'image_url'"
        ):
            msg = {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}
            await client.chat.completions.create(model=MODEL, messages=[msg])  # type: ignore[list-item]


async def test_a_client_that_disconnects_cancels_its_request(served: Served) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 200, "temperature": 0, "stream": True}
    url = f"{served.member.url}/v1/chat/completions"
    async with httpx.AsyncClient() as http, http.stream("POST", url, json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and "content" in line:
                break
    for _ in range(100):  # the cancel travels to the head; its slot frees
        if not served.ring.head.schedule.active:
            break
        await asyncio.sleep(0.05)
    assert served.ring.head.schedule.active == ()


async def test_streaming_requests_beyond_the_concurrency_see_their_queue_position(served: Served) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0, "stream": True}

    async def one(http: httpx.AsyncClient) -> list[str]:
        async with http.stream("POST", f"{served.head.url}/v1/chat/completions", json=body) as r:
            return [line async for line in r.aiter_lines() if line]

    async with httpx.AsyncClient(timeout=60) as http:
        streams = await asyncio.gather(*(one(http) for _ in range(4)))  # the session serves 2 at once
    comments = [line for lines in streams for line in lines if line.startswith(": queued, position")]
    assert comments, "no request was told it waits in the queue"
    assert all(lines[-1] == "data: [DONE]" for lines in streams)


async def test_session_document_and_traces(served: Served) -> None:
    async with httpx.AsyncClient() as http:
        doc = (await http.get(f"{served.member.url}/session")).json()
        assert doc["ring"] == ["m0", "m1"] and doc["head"] == "m0" and doc["state"] == "serving"
        assert {m["name"]: m["blocks"] for m in doc["members"]} == {"m0": [0, 12], "m1": [12, 30]}
        assert doc["links"][0]["path"] == "local"
        traces = (await http.get(f"{served.head.url}/traces")).json()["traces"]
        assert traces and traces[-1]["stages"][1]["measured_ms"] > 0
        text = (await http.get(f"{served.head.url}/metrics")).text
        measured = [s.labels for f in text_string_to_metric_families(text) for s in f.samples
                    if s.name == "kafila_stage_measured_seconds"]  # fmt: skip
        assert any(m["member"] == "m1" and m["stage"] == "1" for m in measured), measured
    json.dumps(doc)


async def test_a_body_far_past_any_request_that_fits_is_refused_unread_with_413(served: Served) -> None:
    """A 300 MB body was read whole and parsed on the member's event loop (1.2 s here; a few GB would
    stop the ring's heartbeats, and take as much memory)."""
    limit = served.head_api.body_limit  # 16 MiB + 8 bytes a character that can fit 256 tokens
    assert 16 * 2**20 < limit < 17 * 2**20
    body = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"a" * limit + b'"}'

    async def chunked():  # no Content-Length: refused once the bytes read pass the limit
        for i in range(0, len(body), 2**20):
            yield body[i : i + 2**20]

    async with httpx.AsyncClient(timeout=60) as http:
        json_body = {"Content-Type": "application/json"}
        sized = await http.post(f"{served.member.url}/v1/completions", content=body, headers=json_body)
        streamed = await http.post(f"{served.member.url}/api/generate", content=chunked(), headers=json_body)
    assert sized.status_code == 413 and sized.json()["error"]["code"] == "request_too_large"
    assert sized.json()["error"]["message"] == (
        f"request body of {len(body)} bytes is over this session's limit of {limit} bytes, which any "
        "request that fits the session's context stays within"
    )
    assert streamed.status_code == 413 and streamed.json()["error"].startswith(
        "request body is over this session's limit"
    )  # Ollama's error shape
    assert served.ring.head.broken is None


async def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(served: Served) -> None:
    """A 4 MB message used to be tokenized on the member's event loop (seconds), stopping its
    heartbeats: the ring broke for every user. Its characters alone say it cannot fit."""
    huge = [{"role": "user", "content": "Paris is the capital of France. " * 125_000}]
    async with httpx.AsyncClient(timeout=60) as http:
        r = await http.post(
            f"{served.member.url}/v1/chat/completions", json={"model": MODEL, "messages": huge}
        )
        done = await http.post(
            f"{served.member.url}/v1/completions", json={"model": MODEL, "prompt": "Paris " * 400}
        )
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded" and err["param"] == "messages"
    assert err["message"].startswith("the prompt's 4000000 characters are more than ")
    assert done.status_code == 400 and done.json()["error"]["param"] == "prompt"  # (it said "messages")
    assert served.ring.head.broken is None


async def test_odd_but_valid_bodies_get_what_the_reference_servers_give(served: Served) -> None:
    """Found by a helper driving the API as clients do: null where a default is meant, Ollama's
    load and unload calls (no prompt), num_predict 0, and JSON nested past the decoder's depth."""
    url = served.member.url
    async with httpx.AsyncClient(timeout=120) as http:
        body = {"model": MODEL, "messages": QUESTION, "max_tokens": 3, "stream": None, "temperature": 0}
        r = await http.post(f"{url}/v1/chat/completions", json=body)
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
        raw = {"model": MODEL, "prompt": "Hi", "stream": False, "raw": None, "options": {"num_predict": 2}}
        assert (await http.post(f"{url}/api/generate", json=raw)).json()["done"] is True
        for path, field in (("/api/generate", "response"), ("/api/chat", "message")):
            load = (await http.post(f"{url}{path}", json={"model": MODEL})).json()
            unload = (await http.post(f"{url}{path}", json={"model": MODEL, "keep_alive": 0})).json()
            assert (load["done"], load["done_reason"], unload["done_reason"]) == (True, "load", "unload")
            assert field in load and not served.ring.head.schedule.active  # nothing was generated
        zero = {"model": MODEL, "messages": QUESTION, "options": {"num_predict": 0}}
        r = await http.post(f"{url}/api/chat", json=zero)  # streaming: the error used to come as a 200 line
        assert r.status_code == 400 and "'options.num_predict' must be >= 1" in r.json()["error"]
        deep = b'{"model": "smollm2-135m", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
        r = await http.post(
            f"{url}/v1/chat/completions", content=deep, headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"


async def test_a_client_leaving_a_non_streaming_request_is_not_a_server_error(served: Served) -> None:
    """The cancelled answer's CancelledError reached uvicorn as "Exception in ASGI application"
    with a traceback, one per client that gave up waiting."""
    import logging

    errors: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = errors.append  # type: ignore[method-assign]
    uvicorn_log = logging.getLogger("uvicorn.error")  # (uvicorn's loggers do not reach the root's)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200, "temperature": 0}
    uvicorn_log.addHandler(handler)
    try:
        async with httpx.AsyncClient(timeout=1.0) as http:
            with pytest.raises(httpx.TimeoutException):
                await http.post(f"{served.member.url}/v1/completions", json=body)
        for _ in range(100):
            if not served.ring.head.schedule.active:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
    finally:
        uvicorn_log.removeHandler(handler)
    assert served.ring.head.schedule.active == ()
    assert not errors, [r.getMessage() for r in errors]
