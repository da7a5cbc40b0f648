"""Text in and out of the API: the codec protocol and an incremental detokenizer.

`TextCodec` is what the API needs from a model's tokenizer and chat template (the engine's tokenizer and
template implement it through `kafila.session` adapters). `Detokenizer` turns a growing list of
token ids into text deltas without splitting a multi-byte character, and cuts the answer at the
first stop string.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class TextCodec(Protocol):
    eos_ids: tuple[int, ...]
    max_token_chars: int  # characters of the longest token: N characters are >= N / this tokens

    def encode_prompt(self, text: str) -> list[int]:
        """A plain completion prompt (BOS added when the model expects one)."""
        ...

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Messages rendered with the chat template, generation prompt added."""
        ...

    def decode(self, ids: Sequence[int]) -> str: ...


class Detokenizer:
    """Feed token ids, get the new text; stop strings end the answer and are not returned."""

    def __init__(self, codec: TextCodec, stop: Sequence[str] = ()) -> None:
        self._codec = codec
        self._ids: list[int] = []
        self._sent = 0  # characters of the decoded text already returned
        self._stop = [s for s in stop if s]
        self.stopped = False

    def feed(self, ids: Sequence[int]) -> str:
        self._ids += ids
        text = self._codec.decode(self._ids)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return ""
        return self._release(text, final=False)

    def flush(self) -> str:
        return "" if self.stopped else self._release(self._codec.decode(self._ids), final=True)

    def _release(self, text: str, final: bool) -> str:
        cut = min((i for s in self._stop if (i := text.find(s, self._sent_floor())) >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._take(text[:cut])
        hold = 0 if final else self._partial_stop(text)
        return self._take(text[: len(text) - hold])

    def _sent_floor(self) -> int:
        return max(0, self._sent - max((len(s) for s in self._stop), default=0))

    def _partial_stop(self, text: str) -> int:
        """Characters at the end of `text` that could still become a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def _take(self, text: str) -> str:
        if len(text) <= self._sent:
            return ""
        delta, self._sent = text[self._sent :], len(text)
        return delta
