"""The terms of a session: what the host decided and every member follows (pure, no I/O).

The host sends them inside its `plan` message (a signaling payload the rendezvous forwards
unread; kafila.session.forming.core). Parsing is strict and versioned like the signaling
messages: a missing or unknown field, a wrong type or a value out of range raises
`TermsError` naming it. Every member of a session runs the same kafila.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

TERMS_VERSION = 1
SESSION_DTYPES = ("fp32", "bf16", "fp16")  # kafila.engine.DTYPES' keys (a test keeps them equal)
MAX_MODEL = 200
DIVISIONS = ("kafila", "uniform", "memory")


class TermsError(ValueError):
    """Session terms that do not parse; the message names the field."""


@dataclass(frozen=True)
class SessionTerms:
    model: str  # the model id clients ask for
    chunk: int  # prompt tokens per prefill step
    queue: int  # requests that may wait for a slot at the head; more get 429
    dtype: str  # the session's one dtype: every member computes in it
    context: int  # tokens per request
    concurrency: int  # requests served at once
    division: str  # how the blocks were divided

    def __post_init__(self) -> None:
        if not self.model or len(self.model) > MAX_MODEL:
            raise TermsError(f"model must be 1 to {MAX_MODEL} characters, got {len(self.model)}")
        for key, lo in (("chunk", 1), ("queue", 0), ("context", 1), ("concurrency", 1)):
            if getattr(self, key) < lo:
                raise TermsError(f"{key} must be at least {lo}, got {getattr(self, key)}")
        if self.dtype not in SESSION_DTYPES:
            raise TermsError(f"dtype {self.dtype!r} is none of {list(SESSION_DTYPES)}")
        if self.division not in DIVISIONS:
            raise TermsError(f"division {self.division!r} is none of {list(DIVISIONS)}")

    def to_dict(self) -> dict[str, Any]:
        return {"v": TERMS_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, body: Any) -> SessionTerms:
        if not isinstance(body, Mapping):
            raise TermsError("the terms are not an object")
        version = body.get("v")
        if version != TERMS_VERSION or isinstance(version, bool):
            raise TermsError(f"terms version {version!r}, this member speaks {TERMS_VERSION}")
        want = {"model", "chunk", "queue", "dtype", "context", "concurrency", "division"}
        keys = set(body) - {"v"}
        if missing := want - keys:
            raise TermsError(f"terms: missing {sorted(missing)}")
        if extra := keys - want:
            raise TermsError(f"terms: unknown {sorted(extra)}")
        for key in ("model", "dtype", "division"):
            if not isinstance(body[key], str):
                raise TermsError(f"{key} must be text, got {type(body[key]).__name__}")
        for key in ("chunk", "queue", "context", "concurrency"):
            if not isinstance(body[key], int) or isinstance(body[key], bool):
                raise TermsError(f"{key} must be an integer, got {type(body[key]).__name__}")
        return cls(**{k: body[k] for k in want})
