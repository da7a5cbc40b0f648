"""Ollama-compatible routes: /api/chat, /api/generate (NDJSON streaming by default), /api/tags,
/api/show, /api/ps and /api/version.

A streamed request that waits for a slot first gets lines like Ollama's own chunks with empty
text and one extra field, `"queue_position": N` (1 = next), each time its place changes. The
official `ollama` client parses them as ordinary empty chunks (its response models ignore fields
they do not know); people and tools reading the NDJSON see the position. While the ring re-plans
around a lost member, a held stream gets such an empty chunk with `"replanning": true` every 2 s of
silence: Ollama's NDJSON has no comment line, and an empty line breaks its clients' JSON parsing.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kafila import __version__
from kafila.api import params
from kafila.api.errors import ApiError, invalid
from kafila.api.params import Job, fit, flag, integer, messages, model_request, number, stop_strings
from kafila.api.service import Sampling
from kafila.api.state import Api, api_of
from kafila.api.stream import ChunkStream, Piece, Tally, collect, pieces, replanning, start

# the request's `format` and the sampling options this server does not implement (refused by name
# unless unused, as kafila.api.params.NOT_IMPLEMENTED for OpenAI's; other options are ignored)
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "format": (None, ""),
    "think": (None, False),
    "tools": (None, []),
    "images": (None, []),  # /api/generate's; a chat message's are checked in `chat`
    "template": (None, ""),  # a Go template: the model's own chat template is what renders here
    "suffix": (None, ""),
    "context": (None, []),  # /api/generate's token context of an earlier answer (not returned here)
}
OPTIONS_NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "mirostat": (None, 0),
    "typical_p": (None, 1),
    "tfs_z": (None, 1),
}


def job_from(
    body: dict[str, Any],
    prompt: list[int],
    context: int,
    prompt_key: str = "messages",
    defaults: dict[str, Any] | None = None,
) -> Job:
    """A request's job; `defaults` (Api.request_defaults, the model's params) stand in for
    options.temperature, options.top_p and options.stop where the request leaves them out."""
    own = defaults or {}
    opts = body.get("options") or {}
    if not isinstance(opts, dict):
        raise invalid("options", "'options' must be an object")
    params.refuse_not_implemented(body, NOT_IMPLEMENTED)
    params.refuse_not_implemented(opts, OPTIONS_NOT_IMPLEMENTED, "options.")
    num_predict = integer(opts, "num_predict", -2, None, "options.")
    if num_predict == 0:  # (the head would refuse it as max_tokens, after the request was accepted)
        raise invalid(
            "options.num_predict",
            "'options.num_predict' must be >= 1, or -1 or -2 (until the context is full), got 0",
        )
    max_tokens = fit(
        prompt,
        None if num_predict is None or num_predict < 0 else num_predict,
        context,
        "num_predict",
        prompt_key,
    )
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=number(opts, "temperature", 0.0, 2.0, own.get("temperature", 0.8), "options."),
        top_k=integer(opts, "top_k", 0, 40, "options.") or 0,
        top_p=number(opts, "top_p", 0.0, 1.0, own.get("top_p", 0.9), "options."),
        min_p=number(opts, "min_p", 0.0, 1.0, 0.0, "options."),
        seed=_seed(opts),
        **_penalties(opts, context),
    )
    given = opts.get("stop")
    stop = stop_strings(given, "options.stop") if given is not None else tuple(own.get("stop", ()))
    return Job(prompt, sampling, stop, flag(body, "stream", True))


def _penalties(opts: dict[str, Any], context: int) -> dict[str, Any]:
    """Ollama's penalty options (off unless given): repeat_last_n -1 means the whole context, 0 off."""
    repeat = number(opts, "repeat_penalty", 0.0, 100.0, 1.0, "options.")
    if repeat == 0:
        raise invalid("options.repeat_penalty", "'options.repeat_penalty' must be > 0 (1 is off), got 0")
    last_n = integer(opts, "repeat_last_n", -1, 64, "options.")
    return {
        "repeat_penalty": repeat,
        "repeat_last_n": context if last_n == -1 else last_n,
        "presence_penalty": number(opts, "presence_penalty", -2.0, 2.0, 0.0, "options."),
        "frequency_penalty": number(opts, "frequency_penalty", -2.0, 2.0, 0.0, "options."),
    }


def _seed(opts: dict[str, Any]) -> int | None:
    """Ollama's default seed is -1, which means a random one (as in llama.cpp): any negative seed
    draws from a fresh generator; 0 and up repeat."""
    seed = integer(opts, "seed", -(2**63), None, "options.")
    return None if seed is None or seed < 0 else seed


def _load_or_unload(api: Api, body: dict[str, Any], chat: bool) -> Response:
    """Ollama's way to load a model (or, with keep_alive 0, unload it): no prompt, no messages.
    The session's model is always loaded, so the answer comes at once, as Ollama's does."""
    unload = body.get("keep_alive") in (0, "0", "0s", "0m", "0h")
    return JSONResponse(_line(api, "", chat) | {"done": True, "done_reason": "unload" if unload else "load"})


async def chat(request: Request) -> Response:
    api, body = await model_request(request)
    if body.get("messages") in (None, []):
        return _load_or_unload(api, body, chat=True)
    msgs = messages(body)
    for i, m in enumerate(msgs):
        params.refuse_not_implemented(m, {"images": (None, [])}, f"messages[{i}].")
    prompt = await api.chat_ids(msgs)
    return await _run(
        request, api, job_from(body, prompt, api.service.context, defaults=api.request_defaults), chat=True
    )


async def generate(request: Request) -> Response:
    api, body = await model_request(request)
    text = body.get("prompt")
    if text in (None, ""):
        return _load_or_unload(api, body, chat=False)
    text = params.text_field(text, "prompt")
    system = body.get("system")
    if system is not None:
        system = params.text_field(system, "system")
    if flag(body, "raw", False):
        if system:
            raise invalid("system", "'system' has no place in a raw prompt: the prompt is sent as it is")
        prompt = await api.prompt_ids(text)
    else:
        turn = [{"role": "user", "content": text}]
        prompt = await api.chat_ids(([{"role": "system", "content": system}] if system else []) + turn)
    return await _run(
        request, api, job_from(body, prompt, api.service.context, "prompt", api.request_defaults), chat=False
    )


async def tags(request: Request) -> Response:
    api = api_of(request)
    return JSONResponse({"models": [_entry(api) | {"modified_at": _created(api)}]})


async def ps(request: Request) -> Response:
    """The one model this session keeps loaded (on every member, in shares) until it ends."""
    api = api_of(request)
    return JSONResponse({"models": [_entry(api) | {"size_vram": 0, "context_length": api.service.context}]})


async def show(request: Request) -> Response:
    """POST /api/show: the model's details; `model_info` gives the session's context (what a client
    can fit a prompt to), not the length the model was trained for."""
    api, _ = await model_request(request)
    f = api.facts
    info = {
        "general.architecture": f.architecture,
        "general.parameter_count": f.parameters,
        f"{f.architecture}.context_length": api.service.context,
    }
    return JSONResponse(
        {
            "modelfile": "",
            "parameters": "",
            "template": "",
            "details": _details(api),
            "model_info": info,
            "capabilities": ["completion"],
            "modified_at": _created(api),
        }
    )


async def version(request: Request) -> Response:
    return JSONResponse({"version": __version__})


def _entry(api: Api) -> dict[str, Any]:
    size = api.facts.size_bytes
    return {
        "name": api.model_id,
        "model": api.model_id,
        "size": size,
        "digest": api.facts.digest,
        "details": _details(api),
    }


def _details(api: Api) -> dict[str, Any]:
    f = api.facts
    return {
        "format": "safetensors",
        "family": f.architecture,
        "families": [f.architecture],
        "parameter_size": _count(f.parameters),
        "quantization_level": f.level,
    }


def _count(n: int) -> str:
    """135_000_000 -> "135.0M", as Ollama writes parameter sizes."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return str(n)


def _created(api: Api) -> str:
    return datetime.fromtimestamp(api.created, UTC).isoformat()


async def _run(request: Request, api: Api, job: Job, chat: bool) -> Response:
    gen = await start(api.service, job)
    tally = Tally(len(job.prompt))
    stream = pieces(gen, api.codec, job, tally, lambda: replanning(api.service))
    if job.stream:
        return ChunkStream(_ndjson(stream, api, tally, chat), gen, "application/x-ndjson", _error)  # type: ignore[return-value]
    await collect(request, stream, gen)
    return JSONResponse(_line(api, "".join(tally.text), chat) | _final(tally))


def _line(api: Api, text: str, chat: bool) -> dict[str, Any]:
    d: dict[str, Any] = {"model": api.model_id, "created_at": datetime.now(UTC).isoformat()}
    if chat:
        d["message"] = {"role": "assistant", "content": text}
    else:
        d["response"] = text
    return d | {"done": False}


def _final(t: Tally) -> dict[str, Any]:
    end = t.finished or time.perf_counter()
    first = t.first_token or end
    ns = 1_000_000_000
    return {
        "done": True,
        "done_reason": t.finish,
        "total_duration": int((end - t.started) * ns),
        "load_duration": 0,
        "prompt_eval_count": t.prompt_tokens,
        "prompt_eval_duration": int((first - t.started) * ns),
        "eval_count": t.completion_tokens,
        "eval_duration": int((end - first) * ns),
    }


async def _ndjson(stream: AsyncIterator[Piece], api: Api, tally: Tally, chat: bool) -> AsyncIterator[bytes]:
    async for p in stream:
        if p.queue_position:
            yield json.dumps(_line(api, "", chat) | {"queue_position": p.queue_position}).encode() + b"\n"
        if p.replanning:
            yield json.dumps(_line(api, "", chat) | {"replanning": True}).encode() + b"\n"
        if p.text:
            yield json.dumps(_line(api, p.text, chat)).encode() + b"\n"
        if p.finish:
            yield json.dumps(_line(api, "", chat) | _final(tally)).encode() + b"\n"


def _error(exc: ApiError) -> bytes:
    return json.dumps({"error": exc.message}).encode() + b"\n"
