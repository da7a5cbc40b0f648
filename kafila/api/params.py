"""Request bodies -> a `Job` (prompt ids, sampling, stop strings, stream flag), validated.

OpenAI and Ollama name the same parameters differently; both end here so the limits and messages
are the same. A prompt that does not fit the declared context is refused, never truncated.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from kafila.api.errors import ApiError, invalid
from kafila.api.service import Sampling
from kafila.api.state import Api, api_of


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    sampling: Sampling
    stop: tuple[str, ...]
    stream: bool
    usage: bool = False  # a streamed answer ends with a usage chunk (OpenAI's stream_options)


async def read_body(request: Request) -> dict[str, Any]:
    try:
        body = json.loads(await _bounded_body(request) or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ApiError(400, "invalid_json", f"request body is not JSON: {exc}") from None
    except RecursionError:  # 100 000 nested arrays: the decoder's recursion, not a server fault
        raise ApiError(400, "invalid_json", "request body is nested too deeply to read") from None
    if not isinstance(body, dict):
        raise ApiError(400, "invalid_json", f"request body must be a JSON object, got {type(body).__name__}")
    return body


async def _bounded_body(request: Request) -> bytes:
    """The body, refused with 413 once it passes what a request that fits the context can need
    (read and parsed on the event loop: a 300 MB body held it for over a second, and more would
    stop the ring's heartbeats)."""
    limit = api_of(request).body_limit
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:  # refused before reading any of it
        raise _too_large(f"request body of {int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large("request body", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(what: str, limit: int) -> ApiError:
    return ApiError(
        413,
        "request_too_large",
        f"{what} is over this session's limit of {limit} bytes, which any request that fits the "
        "session's context stays within",
    )


# OpenAI parameters this server does not implement, with the values that mean "not used": a request
# that sets one to anything else is refused by name, never answered as if it had not asked
NOT_IMPLEMENTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False, 0),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "best_of": (None, 1),
    "logit_bias": (None, {}),
    "suffix": (None, ""),
    "tools": (None, []),
    "functions": (None, []),
    "tool_choice": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
}


def refuse_not_implemented(
    body: dict[str, Any], table: dict[str, tuple[Any, ...]] = NOT_IMPLEMENTED, where: str = ""
) -> None:
    """Refuse (400, by name) a parameter of `table` set to anything but a value meaning "not used"."""
    for key, unused in table.items():
        value = body.get(key)
        # True is not 1 here (best_of: true is no count); otherwise 0 == 0.0 and {} == {} as JSON means
        fine = any(value is u for u in unused) if isinstance(value, bool) else value in unused
        if not fine:
            name, got = where + key, json.dumps(value)
            got = got if len(got) <= 80 else got[:77] + "..."  # an image's base64 is megabytes
            raise invalid(name, f"'{name}' is not supported here (got {got}); leave it out")


async def model_request(request: Request) -> tuple[Api, dict[str, Any]]:
    """The session's Api and the request's JSON body, refused unless the body names the model served."""
    api, body = api_of(request), await read_body(request)
    check_model(body, api.model_id)
    return api, body


def check_model(body: dict[str, Any], served: str) -> None:
    name = body.get("model")
    if not isinstance(name, str) or not name:
        raise invalid("model", "'model' is required and must be a string")
    if name not in {served, served.split(":")[0]} and name.split(":")[0] != served:
        raise ApiError(
            404, "model_not_found", f"model {name!r} is not served here; this session serves {served!r}"
        )


def number(d: dict[str, Any], key: str, lo: float, hi: float, default: float, where: str = "") -> float:
    """`d[key]` in [lo, hi]; errors name the field as the client sent it (`where`: "options.")."""
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float) or not lo <= v <= hi:
        name = where + key
        raise invalid(name, f"{name!r} must be a number in [{lo}, {hi}], got {v!r}")
    return float(v)


def integer(d: dict[str, Any], key: str, lo: int, default: int | None, where: str = "") -> int | None:
    v = d.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v < lo:
        name = where + key
        raise invalid(name, f"{name!r} must be an integer >= {lo}, got {v!r}")
    return v


def text_field(v: Any, name: str) -> str:
    """A string the tokenizer can take: JSON may carry a lone UTF-16 surrogate ("\\ud800"), which
    no UTF-8 text holds; refused here by name (the tokenizer raised a TypeError: a 500)."""
    if not isinstance(v, str):
        raise invalid(name, f"{name!r} must be a string")
    try:
        v.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = f"\\u{ord(v[exc.start]):04x}"
        raise invalid(
            name, f"{name!r} holds a lone UTF-16 surrogate ({bad} at character {exc.start}), which is no text"
        ) from None
    return v


def stop_strings(v: Any, key: str = "stop") -> tuple[str, ...]:
    if v is None:
        return ()
    if isinstance(v, str):
        return (text_field(v, key),)
    if isinstance(v, list) and all(isinstance(s, str) for s in v) and len(v) <= 16:
        return tuple(text_field(s, f"{key}[{i}]") for i, s in enumerate(v))
    raise invalid(key, f"{key!r} must be a string or a list of up to 16 strings")


def flag(d: dict[str, Any], key: str, default: bool) -> bool:
    """A true/false field; null is the default, as OpenAI and Ollama read it."""
    v = d.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(key, f"{key!r} must be true or false, got {v!r}")
    return v


ROLES = ("system", "user", "assistant", "tool")  # what the chat templates served here render


def messages(body: dict[str, Any], tool_ids: bool = False) -> list[dict[str, Any]]:
    """The chat as the template takes it: each content a string (OpenAI's text parts joined by
    newlines, as other servers join them), OpenAI's `developer` role under its older name `system`.
    Roles are those of `ROLES`; with `tool_ids` (OpenAI's routes) a tool message names the call it
    answers (`tool_call_id`), as OpenAI requires."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("messages", "'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid("messages", f"messages[{i}] must be an object with a 'role'")
        role = "system" if m["role"] == "developer" else m["role"]
        if role not in ROLES:
            shown = text_field(m["role"], f"messages[{i}].role")[:40]
            names = ", ".join(map(repr, (*ROLES, "developer")))
            where = f"messages[{i}].role"
            raise invalid(where, f"{where} {shown!r} is not a role served here; use one of {names}")
        if role == "tool" and tool_ids:
            call = m.get("tool_call_id")
            if not isinstance(call, str) or not call:
                raise invalid(
                    f"messages[{i}].tool_call_id",
                    f"messages[{i}] has role 'tool' and needs 'tool_call_id' (the call it answers)",
                )
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                text_field(m[key], f"messages[{i}].{key}")
        out.append(m | {"role": role, "content": _text(m.get("content", ""), i)})
    return out


def _text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return text_field(content, f"messages[{i}].content")
    if not isinstance(content, list):
        raise invalid("messages", f"messages[{i}].content must be a string or a list of text parts")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid("messages", f"messages[{i}].content[{j}]: only text parts are served, got {kind!r}")
        texts.append(text_field(part["text"], f"messages[{i}].content[{j}].text"))
    return "\n".join(texts)


def n_tokens(n: int, what: str = "token") -> str:
    """'1 token', '2 tokens' (or of `what`)."""
    return f"{n} {what}{'' if n == 1 else 's'}"


def fit(
    prompt: list[int], max_tokens: int | None, context: int, key: str, prompt_key: str = "messages"
) -> int:
    """The answer budget; refuses a prompt (or prompt + max_tokens) that exceeds the context.
    `key` names the answer's budget, `prompt_key` the prompt ("messages" or "prompt")."""
    if not prompt:
        raise invalid(prompt_key, "the prompt is empty after tokenization")
    room = context - len(prompt)
    if room <= 0:
        raise ApiError(
            400,
            "context_length_exceeded",
            f"prompt is {n_tokens(len(prompt))}; the session's context is {context} tokens "
            f"(prompt plus answer); shorten the prompt (Kafila never truncates it)",
            prompt_key,
        )
    if max_tokens is not None and max_tokens > room:
        raise ApiError(
            400,
            "context_length_exceeded",
            f"prompt of {n_tokens(len(prompt))} plus {key}={max_tokens} exceeds the session's context of "
            f"{context} tokens; at most {n_tokens(room, 'answer token')} fit{'s' if room == 1 else ''}",
            key,
        )
    return max_tokens if max_tokens is not None else room
