"""The generation service the API talks to: submit a prompt, read token events, cancel.

Two implementations: the ring head (it schedules the request on the ring itself) and a member
that is not the head (it forwards the request over its ring link to the head). The API sees only
this interface, so both serve the same routes.

A `Generation` is an async iterator of `TokenEvent`s; the last one carries `finish`. Failures
arrive as `GenerationError` raised from the iterator, with a stable `code` the API maps to HTTP
status. `cancel()` stops the request wherever it is (queue, ring), never blocks (so it works
inside a cancelled task's cleanup) and is safe to call twice; the reason `STOP_STRING` says the
answer ended (the head records it as finished "stop", any other reason as "cancelled"). Stop and
EOS tokens are not included in `tokens`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, fields
from typing import Any, Protocol

from kafila.proto import tensor as t


@dataclass(frozen=True)
class Sampling:
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    seed: int | None = None
    stop_ids: tuple[int, ...] = ()  # token ids that end the answer (EOS is added by the service)
    repeat_penalty: float = 1.0  # penalties as kafila.engine.sampler reads them; these values: off
    repeat_last_n: int = 64
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    min_p: float = 0.0  # 0: off

    def forwarded(self, request_id: int, prompt: Sequence[int]) -> t.Generate:
        """The message a member that is not the head sends for this request: Generate's fields
        after the prompt are these, in this order."""
        return t.Generate(request_id, tuple(prompt), *(getattr(self, f.name) for f in fields(self)))

    @classmethod
    def of(cls, msg: t.Generate) -> Sampling:
        """The settings a forwarded request carries (the inverse of `forwarded`)."""
        return cls(*(getattr(msg, f.name) for f in fields(msg)[2 : 2 + len(fields(cls))]))


@dataclass(frozen=True)
class TokenEvent:
    tokens: tuple[int, ...] = ()
    finish: str | None = None  # "stop" | "length" on the last event
    queue_position: int | None = None  # set while the request waits for a slot (1 = next)
    prefill_s: float | None = None  # on the event with the first token
    drafted: int = 0  # drafted tokens the step verified (speculative decoding)
    accepted: int = 0  # ... and those of them kept, among `tokens`


STOP_STRING = "stop string"  # the cancel reason of an answer that ended on one of its stop strings


class GenerationError(Exception):
    """A request failed. `code`: busy | too_long | member_lost | replanning | session_ended | cancelled |
    internal | bad_request."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Generation(Protocol):
    request_id: int

    def __aiter__(self) -> AsyncIterator[TokenEvent]: ...

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop the request; returns at once (the work is scheduled), a no-op once finished."""
        ...


class GenerationService(Protocol):
    @property
    def context(self) -> int:
        """Declared context length: prompt plus answer tokens of one request."""
        ...

    async def submit(self, prompt: Sequence[int], sampling: Sampling) -> Generation: ...

    def describe(self) -> dict[str, Any]:
        """The /session document: members, ring order, plan, links, state."""
        ...
