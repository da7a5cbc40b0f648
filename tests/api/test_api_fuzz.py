"""Property-based fuzz of the OpenAI and Ollama routes against a real served model (the default
SmolLM2 in a two-member ring): hypothesis draws request bodies from the two schemas, each field
either a valid value or any JSON value (lone surrogates included), and every answer must be a
4xx naming the problem or a 200: never a 500, never a hang; the ring serves afterwards.

Bounded for CI: a fixed number of examples, answers of at most 3 tokens (every body that could
generate carries a small budget), a timeout on every request."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import pytest_asyncio
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.api.served import MODEL, Served, serve_ring

pytestmark = [pytest.mark.network, pytest.mark.asyncio(loop_scope="module")]
FUZZ = settings(max_examples=100, deadline=None, database=None, suppress_health_check=list(HealthCheck))
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]

# any text, lone UTF-16 surrogates included (they travel as "\ud800" escapes in JSON)
TEXT = st.text(st.characters(codec=None, exclude_categories=()), max_size=24)
SCALAR = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | TEXT
JSON = st.recursive(
    SCALAR, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3), max_leaves=8
)


def schemas(fuzz: bool) -> st.SearchStrategy[tuple[str, dict[str, Any]]]:
    """(route, body) of the five POST routes: every field valid, or (`fuzz`) each field either a
    valid value or any JSON value, with roles and texts outside what is served."""

    def field(valid: st.SearchStrategy[Any], junk: st.SearchStrategy[Any] = JSON) -> st.SearchStrategy[Any]:
        return st.one_of(valid, valid, junk) if fuzz else valid

    def optional(**fields: st.SearchStrategy[Any]) -> st.SearchStrategy[dict[str, Any]]:
        return st.fixed_dictionaries({}, optional={k: field(v) for k, v in fields.items()})

    def body(base: dict[str, Any], extra: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[Any]:
        return st.builds(lambda a, b: a | b, st.fixed_dictionaries(base), extra)

    text = TEXT if fuzz else st.text(max_size=24)
    roles = ["system", "user", "assistant"] + (["tool", "developer", "wizard", ""] if fuzz else [])
    model = field(st.sampled_from([MODEL, MODEL + ":latest"] + (["other-model"] if fuzz else [])))
    part = st.fixed_dictionaries({"type": field(st.just("text")), "text": field(text)})
    content = text | st.lists(part, min_size=1, max_size=2)
    message = st.fixed_dictionaries(
        {"role": field(st.sampled_from(roles)), "content": field(content)},
        optional={"tool_call_id": field(text), "name": field(text), "images": JSON} if fuzz else {},
    )
    messages = field(st.lists(message, min_size=1, max_size=3))
    # budgets that generate are at most 3 tokens; any other value drawn is refused
    budget = field(st.integers(1, 3), st.sampled_from([0, -5, 2**64, 1.5, "3", True]))
    sampling = {
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0, 1),
        "min_p": st.floats(0, 1),
        "seed": st.integers(-(2**63), 2**63),
        "stop": text | st.lists(text, max_size=3),
        "presence_penalty": st.floats(-2, 2),
        "frequency_penalty": st.floats(-2, 2),
    }
    openai_extra = optional(
        stream=st.booleans(),
        n=st.just(1),
        logprobs=st.just(False),
        stream_options=st.fixed_dictionaries({"include_usage": st.booleans()}),
        **sampling,
    ).filter(lambda b: fuzz or "stream_options" not in b or b.get("stream") is True)
    ids = st.integers(-5, 60_000) if fuzz else st.integers(0, 49_151)
    prompt = field(text.filter(bool) | st.lists(ids, min_size=1, max_size=4))
    ollama_sampling = optional(
        top_k=st.integers(0, 50),
        repeat_penalty=st.floats(0.1, 3),
        repeat_last_n=st.integers(-1, 64),
        **sampling,
    )
    options = field(
        st.builds(lambda o, n: o | {"num_predict": n}, ollama_sampling, budget),
        st.sampled_from([[], "fast", 3]),  # not an object: refused
    )
    ollama_extra = optional(stream=st.booleans(), **({"format": JSON, "keep_alive": JSON} if fuzz else {}))
    generate_extra = optional(
        stream=st.booleans(), raw=st.booleans(), system=text, **({"images": JSON} if fuzz else {})
    )
    return st.one_of(
        st.tuples(
            st.just("/v1/chat/completions"),
            body({"model": model, "messages": messages, "max_tokens": budget}, openai_extra),
        ),
        st.tuples(
            st.just("/v1/completions"),
            body({"model": model, "prompt": prompt, "max_tokens": budget}, openai_extra),
        ),
        st.tuples(
            st.just("/api/chat"),
            body({"model": model, "messages": messages, "options": options}, ollama_extra),
        ),
        st.tuples(
            st.just("/api/generate"),
            body({"model": model, "prompt": field(text), "options": options}, generate_extra),
        ),
        st.tuples(st.just("/api/show"), st.fixed_dictionaries({"model": model})),
    )


ROUTES = st.booleans().flatmap(schemas)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def served(smollm2_path, tmp_path_factory) -> AsyncIterator[Served]:
    async with serve_ring(smollm2_path, tmp_path_factory.mktemp("traces"), concurrency=2) as s:
        yield s


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def http(served: Served) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=served.member.url, timeout=60) as client:
        yield client


@FUZZ
@given(request=ROUTES)
async def test_any_request_of_the_schemas_gets_a_200_or_a_named_4xx(
    http: httpx.AsyncClient, request: tuple[str, dict[str, Any]]
) -> None:
    path, body = request
    r = await http.post(path, content=json.dumps(body), headers={"Content-Type": "application/json"})
    event(f"{path} {r.status_code}")  # --hypothesis-show-statistics: how many got how far
    assert r.status_code == 200 or 400 <= r.status_code < 500, (r.status_code, r.text[:300])
    if r.status_code != 200:
        error = r.json()["error"]
        assert error if path.startswith("/api/") else error["message"], r.text
    else:  # a whole answer, or a stream that ended well
        assert '"error"' not in r.text, r.text[:300]


async def test_the_ring_serves_after_the_fuzz(served: Served, http: httpx.AsyncClient) -> None:
    ask = {"model": MODEL, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    r = await http.post("/v1/chat/completions", json=ask)
    assert r.status_code == 200 and "Paris" in r.json()["choices"][0]["message"]["content"]
    assert served.ring.head.broken is None
