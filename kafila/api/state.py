"""What every route needs: the generation service, the model's text codec, and the served name."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request

from kafila.api.errors import ApiError
from kafila.api.service import GenerationService
from kafila.api.text import TextCodec
from kafila.models.config import ModelConfig
from kafila.models.manifest import priced, specs_from_config
from kafila.obs.trace import TraceLog


@dataclass(frozen=True)
class ModelFacts:
    """What the Ollama routes report about the served model, from its config (every member has it)."""

    architecture: str  # config.json's model_type, e.g. "llama"
    parameters: int
    size_bytes: int  # every weight in the session's dtype and format: all members' shares together
    dtype: str  # the session's, e.g. "F32"
    digest: str = ""  # the checkpoint id (sha256 of its safetensors headers): the same at every member
    quant: str = "none"  # the session's weight format ("none", "int8", "q4")

    @classmethod
    def of(cls, config: ModelConfig, dtype: str, digest: str = "", quant: str = "none") -> ModelFacts:
        specs = specs_from_config(config, dtype)
        numel, nbytes = sum(s.numel for s in specs), sum(priced(specs, dtype, quant).values())
        return cls(config.model_type, numel, nbytes, dtype, digest, quant)

    @property
    def level(self) -> str:
        """Ollama's `quantization_level`: the dtype for floats, else the GGUF type with the same
        layout (int8: 8-bit, one fp16 scale per 32 = Q8_0; q4: scale and minimum per 32 = Q4_1)."""
        return {"int8": "Q8_0", "q4": "Q4_1"}.get(self.quant, self.dtype)


@dataclass
class Api:
    service: GenerationService
    codec: TextCodec
    model_id: str
    facts: ModelFacts
    traces: TraceLog | None = None
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def request_defaults(self) -> dict[str, Any]:
        """The served model's own request defaults (an Ollama model's params layer: temperature,
        top_p, stop), where the codec's tokenizer carries them; a request's own fields win."""
        tokenizer = getattr(self.codec, "tokenizer", None)
        found = getattr(tokenizer, "request_defaults", None)
        return dict(found) if isinstance(found, dict) else {}

    async def chat_ids(self, msgs: list[dict[str, Any]]) -> list[int]:
        """Messages rendered and tokenized on a worker thread, refused first when their text alone
        cannot fit the context: tokenizing 10 MB on the event loop stopped this member's
        heartbeats long enough to break the ring."""
        self._check_chars(sum(len(str(m.get("content", ""))) for m in msgs), "messages")
        return await asyncio.to_thread(self._encode_chat, msgs)

    async def prompt_ids(self, text: str, key: str = "prompt") -> list[int]:
        """A plain prompt tokenized on a worker thread, refused first when it cannot fit."""
        self._check_chars(len(text), key)
        return await asyncio.to_thread(self._encode_prompt, text, key)

    @property
    def most_chars(self) -> int:
        """Characters of the longest text that can fit the context: every token at its longest."""
        return self.service.context * self.codec.max_token_chars

    @property
    def body_limit(self) -> int:
        """Bytes of a request body: 8 bytes a character of the longest text that can fit the context
        (an escaped non-ASCII character takes 6), plus 16 MiB, so a prompt a few times too long is
        still read and told by how much (`context_length_exceeded`), and only bodies far past any
        use (hundreds of MB, read and parsed on the event loop) are refused unread."""
        return 16 * 2**20 + 8 * self.most_chars

    def _check_chars(self, chars: int, key: str) -> None:
        context, per_token = self.service.context, self.codec.max_token_chars
        if chars > self.most_chars:
            raise ApiError(
                400,
                "context_length_exceeded",
                f"the prompt's {chars} characters are more than {self.most_chars} ({context} tokens "
                f"of at most {per_token} characters): it cannot fit the session's context of {context} "
                "tokens; shorten it (Kafila never truncates it)",
                key,
            )

    def _encode_prompt(self, text: str, key: str) -> list[int]:
        try:
            return self.codec.encode_prompt(text)
        except (ValueError, TypeError) as exc:  # text the tokenizer cannot take is the client's
            raise ApiError(400, "invalid_parameter", f"{key!r} cannot be tokenized: {exc}", key) from exc

    def _encode_chat(self, msgs: list[dict[str, Any]]) -> list[int]:
        try:
            return self.codec.encode_chat(msgs)
        except (ValueError, TypeError, KeyError) as exc:  # the template refused the messages
            raise ApiError(
                400, "invalid_messages", f"messages cannot be rendered: {exc}", "messages"
            ) from exc


def api_of(request: Request) -> Api:
    return request.app.state.api
