"""The API's TextCodec on top of the engine's Tokenizer (tokenizer.json + chat template)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kafila.engine.tokenizer import Tokenizer, TokenizerError


class TokenizerCodec:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = tuple(sorted(tokenizer.stop_ids))
        self.max_token_chars = tokenizer.max_token_chars

    def encode_prompt(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=True)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            return self.tokenizer.encode_chat(messages)
        except TokenizerError as exc:
            raise ValueError(str(exc)) from exc

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)
