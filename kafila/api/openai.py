"""OpenAI-compatible routes: /v1/chat/completions, /v1/completions (SSE streaming or not), /v1/models."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from kafila.api.errors import ApiError, invalid
from kafila.api.params import (
    Job,
    check_model,
    fit,
    flag,
    integer,
    messages,
    model_request,
    number,
    refuse_not_implemented,
    stop_strings,
    text_field,
)
from kafila.api.service import Sampling
from kafila.api.state import Api, api_of
from kafila.api.stream import ChunkStream, Piece, Tally, collect, pieces, replanning, start


def job_from(
    body: dict[str, Any],
    prompt: list[int],
    context: int,
    prompt_key: str = "messages",
    defaults: dict[str, Any] | None = None,
) -> Job:
    """A request's job; `defaults` (Api.request_defaults) stand in for temperature, top_p and stop
    where the request leaves them out."""
    own = defaults or {}
    refuse_not_implemented(body)
    if integer(body, "n", 1, 1) != 1:
        raise invalid("n", "only n=1 is supported")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = fit(prompt, integer(body, key, 1, None), context, key, prompt_key)
    sampling = Sampling(
        max_tokens=max_tokens,
        temperature=number(body, "temperature", 0.0, 2.0, own.get("temperature", 1.0)),
        top_p=number(body, "top_p", 0.0, 1.0, own.get("top_p", 1.0)),
        min_p=number(body, "min_p", 0.0, 1.0, 0.0),  # not OpenAI's: vLLM's and llama.cpp's extension
        seed=integer(body, "seed", -(2**63), None),
        presence_penalty=number(body, "presence_penalty", -2.0, 2.0, 0.0),
        frequency_penalty=number(body, "frequency_penalty", -2.0, 2.0, 0.0),
    )
    stop = stop_strings(body.get("stop")) if body.get("stop") is not None else tuple(own.get("stop", ()))
    return Job(prompt, sampling, stop, flag(body, "stream", False), include_usage(body))


def include_usage(body: dict[str, Any]) -> bool:
    """`stream_options: {"include_usage": true}` asks for a last chunk carrying the usage block."""
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise invalid("stream_options", "'stream_options' must be an object")
    if body.get("stream") is not True:
        raise invalid("stream_options", "'stream_options' is only allowed when 'stream' is true")
    # include_obfuscation pads chunks against size side channels on OpenAI's servers; no answer
    # depends on it, so it is accepted and not done
    unknown = sorted(set(opts) - {"include_usage", "include_obfuscation"})
    if unknown:
        raise invalid("stream_options", f"'stream_options.{unknown[0]}' is not supported here; leave it out")
    return flag(opts, "include_usage", False)


async def chat_completions(request: Request) -> Response:
    api, body = await model_request(request)
    prompt = await api.chat_ids(messages(body, tool_ids=True))
    return await _run(
        request, api, job_from(body, prompt, api.service.context, defaults=api.request_defaults), chat=True
    )


async def completions(request: Request) -> Response:
    api, body = await model_request(request)
    prompt = await _prompt_ids(api, body.get("prompt"))
    return await _run(
        request, api, job_from(body, prompt, api.service.context, "prompt", api.request_defaults), chat=False
    )


async def _prompt_ids(api: Api, prompt: Any) -> list[int]:
    """A completion's prompt: a string, or token ids as OpenAI takes them (one prompt per request,
    also as a list of one); the head refuses ids outside the model's vocabulary."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return await api.prompt_ids(text_field(prompt, "prompt"))
    if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise invalid("prompt", "'prompt' must be a string or a list of token ids (one prompt per request)")


async def models(request: Request) -> Response:
    return JSONResponse({"object": "list", "data": [_model(api_of(request))]})


async def model(request: Request) -> Response:
    """GET /v1/models/{model}: the served model, or 404 naming what is served."""
    api = api_of(request)
    check_model({"model": request.path_params["model"]}, api.model_id)
    return JSONResponse(_model(api))


def _model(api: Api) -> dict[str, Any]:
    return {"id": api.model_id, "object": "model", "created": api.created, "owned_by": "kafila"}


async def _run(request: Request, api: Api, job: Job, chat: bool) -> Response:
    gen = await start(api.service, job)
    tally = Tally(len(job.prompt))
    stream = pieces(gen, api.codec, job, tally, lambda: replanning(api.service))
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())  # this completion's, every chunk of it the same (not the API's start)
    if job.stream:
        sse = _sse(stream, api, (rid, created), chat, tally if job.usage else None)
        return ChunkStream(sse, gen, "text/event-stream", _sse_error)  # type: ignore[return-value]
    await collect(request, stream, gen)
    text = "".join(tally.text)
    choice: dict[str, Any] = {"index": 0, "finish_reason": tally.finish, "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    body = {"choices": [choice], "usage": _usage(tally)}
    return JSONResponse(_envelope(api, (rid, created), chat, False) | body)


def _envelope(api: Api, made: tuple[str, int], chat: bool, chunk: bool) -> dict[str, Any]:
    """The fields every answer and chunk carry; `made`: the completion's id and creation time."""
    kind = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
    rid, created = made
    return {"id": rid, "object": kind, "created": created, "model": api.model_id}


def _usage(t: Tally) -> dict[str, Any]:
    """OpenAI's usage block; `completion_tokens_details` says how many drafted tokens the answer
    kept and how many were verified and dropped (OpenAI's predicted-output fields)."""
    total = t.prompt_tokens + t.completion_tokens
    details = {"accepted_prediction_tokens": t.accepted, "rejected_prediction_tokens": t.drafted - t.accepted}
    return {
        "prompt_tokens": t.prompt_tokens,
        "completion_tokens": t.completion_tokens,
        "total_tokens": total,
        "completion_tokens_details": details,
    }


async def _sse(
    stream: AsyncIterator[Piece], api: Api, made: tuple[str, int], chat: bool, usage: Tally | None
) -> AsyncIterator[bytes]:
    """The chunks; with `usage` (stream_options.include_usage) every chunk carries `"usage": null`
    and one more, with no choices, carries the usage block before [DONE], as OpenAI sends them."""
    head = _envelope(api, made, chat, True) | ({"usage": None} if usage else {})
    if chat:
        yield _event(
            head | {"choices": [{"index": 0, "delta": {"role": "assistant"}, "finish_reason": None}]}
        )
    async for p in stream:
        if p.queue_position:  # an SSE comment: clients ignore it, people and tools can read it
            yield f": queued, position {p.queue_position}\n\n".encode()
        if p.replanning:  # the ring re-plans around a lost member: held, not failed
            yield b": replanning\n\n"
        if p.text or p.finish:
            body = {"content": p.text} if chat else None
            choice: dict[str, Any] = {"index": 0, "finish_reason": p.finish}
            choice |= {"delta": body if p.text else {}} if chat else {"text": p.text, "logprobs": None}
            yield _event(head | {"choices": [choice]})
    if usage is not None:
        yield _event(head | {"choices": [], "usage": _usage(usage)})
    yield b"data: [DONE]\n\n"


def _event(d: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(d).encode() + b"\n\n"


def _sse_error(exc: ApiError) -> bytes:
    return _event({"error": {"message": exc.message, "type": "server_error", "code": exc.code}})
