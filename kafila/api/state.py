"""What every route needs: the generation service, the model's text codec, and the served name."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from kafila.api.errors import ApiError
from kafila.api.text import TextCodec
from kafila.models.config import ModelConfig
from kafila.models.manifest import specs_from_config
from kafila.obs.trace import TraceLog
from kafila.session.service import GenerationService


@dataclass(frozen=True)
class ModelFacts:
    """What the Ollama routes report about the served model, from its config (every member has it)."""

    architecture: str  # config.json's model_type, e.g. "llama"
    parameters: int
    size_bytes: int  # every weight in the session's dtype: all members' shares together
    dtype: str  # the session's, e.g. "F32"

    @classmethod
    def of(cls, config: ModelConfig, dtype: str) -> ModelFacts:
        specs = specs_from_config(config, dtype)
        return cls(config.model_type, sum(s.numel for s in specs), sum(s.nbytes() for s in specs), dtype)


@dataclass
class Api:
    service: GenerationService
    codec: TextCodec
    model_id: str
    facts: ModelFacts
    traces: TraceLog | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    def encode_chat(self, msgs: list[dict[str, Any]]) -> list[int]:
        try:
            return self.codec.encode_chat(msgs)
        except (ValueError, TypeError, KeyError) as exc:  # the template refused the messages
            raise ApiError(
                400, "invalid_messages", f"messages cannot be rendered: {exc}", "messages"
            ) from exc


def api_of(request: Request) -> Api:
    return request.app.state.api  # type: ignore[no-any-return]
