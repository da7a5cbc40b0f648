"""Text <-> token ids for a checkpoint: `tokenizers` for the BPE, the folder's chat template, stop ids.

    tok = Tokenizer.from_checkpoint(ckpt)              # or Tokenizer.from_folder(path)
    ids = tok.encode_chat(messages)                     # == transformers apply_chat_template(tokenize=True)
    ids = tok.encode("plain text")                      # == transformers tokenizer(text).input_ids
    stream = tok.stream()                               # incremental decode for streaming
    for token in generated: print(stream.push(token), end="")
    print(stream.flush())

Behaves like transformers' fast tokenizer: `encode` adds the post-processor's special tokens (e.g.
Llama 3's BOS) unless told not to; a rendered chat is encoded without them, because the template
writes its own. `stop_ids` are the EOS ids of generation_config.json, config.json and the
tokenizer config's eos_token together.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kafila.engine import chat_template
from kafila.models.checkpoint import token_ids, token_text

if TYPE_CHECKING:
    from kafila.models.checkpoint import Checkpoint

SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """No tokenizer.json, or no chat template where one is needed."""


class Tokenizer:
    def __init__(
        self,
        backend: Any,  # tokenizers.Tokenizer
        *,
        tokenizer_config: Mapping[str, Any] | None = None,
        chat_template: str | None = None,
        eos_ids: Iterable[int] = (),
        source: str = "",
    ) -> None:
        self.backend = backend
        self.source = source
        config = dict(tokenizer_config or {})
        self.chat_template = chat_template
        self.special_tokens = {k: t for k in SPECIAL_NAMES if (t := token_text(config.get(k))) is not None}
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False))
        eos = self.special_tokens.get("eos_token")
        eos_id = backend.token_to_id(eos) if eos is not None else None
        self.stop_ids: frozenset[int] = frozenset([*eos_ids, *([] if eos_id is None else [eos_id])])
        # the model's own request defaults (an Ollama model's params: temperature, top_p, stop),
        # from generation_config.json's `kafila_request_defaults`; a request's fields win
        self.request_defaults: dict[str, Any] = {}

    # --- construction ----------------------------------------------------------------------------

    @classmethod
    def from_checkpoint(cls, ckpt: Checkpoint) -> Tokenizer:
        if ckpt.tokenizer_file is None:
            raise TokenizerError(f"{ckpt.path}: no tokenizer.json (Kafila reads fast-tokenizer files only)")
        eos = (*token_ids(ckpt.generation_config.get("eos_token_id")), *ckpt.config.eos_token_id)
        tok = cls._load(ckpt.tokenizer_file, ckpt.tokenizer_config, ckpt.chat_template, eos)
        tok.request_defaults = _request_defaults(ckpt.generation_config)
        return tok

    @classmethod
    def from_folder(cls, folder: str | Path) -> Tokenizer:
        """A tokenizer-only folder (tokenizer.json, tokenizer_config.json, optional chat_template.jinja,
        generation_config.json and config.json)."""
        folder = Path(folder)
        file = folder / "tokenizer.json"
        if not file.is_file():
            raise TokenizerError(f"{file}: missing")
        tok_config = _json(folder / "tokenizer_config.json")
        template = tok_config.get("chat_template")
        if (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        elif isinstance(template, list):
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default") or next(iter(named.values()), None)
        generation = _json(folder / "generation_config.json")
        eos = (
            *token_ids(generation.get("eos_token_id")),
            *token_ids(_json(folder / "config.json").get("eos_token_id")),
        )
        tok = cls._load(file, tok_config, template if isinstance(template, str) else None, eos)
        tok.request_defaults = _request_defaults(generation)
        return tok

    @classmethod
    def _load(
        cls, file: Path, config: Mapping[str, Any], template: str | None, eos: Iterable[int]
    ) -> Tokenizer:
        from tokenizers import Tokenizer as Backend

        try:
            backend = Backend.from_file(str(file))
        except Exception as exc:  # tokenizers raises plain Exception on a malformed file
            raise TokenizerError(f"{file}: not a tokenizers file: {exc}") from exc
        return cls(backend, tokenizer_config=config, chat_template=template, eos_ids=eos, source=str(file))

    # --- ids ------------------------------------------------------------------------------------

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def pad_id(self) -> int | None:
        pad = self.special_tokens.get("pad_token")
        return None if pad is None else self.backend.token_to_id(pad)

    @functools.cached_property
    def max_token_chars(self) -> int:
        """Characters the longest token spells (a byte-level token's characters are its bytes, at
        least as many as the text characters it covers): a text of N characters is at least
        N / max_token_chars tokens, known without tokenizing it."""
        return max(1, *(len(t) for t in self.backend.get_vocab(with_added_tokens=True)))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(list(ids), skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    # --- chat -----------------------------------------------------------------------------------

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> str:
        if self.chat_template is None:
            raise TokenizerError(f"{self.source}: this model has no chat template (use a raw prompt)")
        specials = dict(self.special_tokens)
        bos, eos = specials.pop("bos_token", None), specials.pop("eos_token", None)
        return chat_template.render(
            self.chat_template,
            messages,
            add_generation_prompt,
            bos_token=bos,
            eos_token=eos,
            tools=tools,
            **{**specials, **extra},
        )

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        **extra: Any,
    ) -> list[int]:
        text = self.render_chat(messages, add_generation_prompt, tools, **extra)
        return self.encode(text, add_special_tokens=False)

    def stream(self, skip_special_tokens: bool = True) -> StreamDecoder:
        return StreamDecoder(self, skip_special_tokens)


class StreamDecoder:
    """Incremental detokenization: `push(id)` returns the text that became final with this token.

    Text is held back while it ends in an incomplete UTF-8 sequence (the decoder shows it as
    U+FFFD), so a multi-byte character split over tokens is emitted whole, once. Each step decodes a
    short window (from the last emitted boundary), never the whole sequence. `flush()` returns what
    is left at the end (a genuinely broken tail then shows as U+FFFD, as transformers would)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = []
        self.prefix = 0  # window start: context for tokenizers that drop a leading space
        self.read = 0  # ids before this are emitted

    def push(self, token_id: int) -> str:
        self.ids.append(int(token_id))
        emitted = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        if len(window) <= len(emitted) or window.endswith("\ufffd"):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return window[len(emitted) :]

    def flush(self) -> str:
        emitted = self._decode(self.ids[self.prefix : self.read])
        window = self._decode(self.ids[self.prefix :])
        self.prefix = self.read = len(self.ids)
        return window[len(emitted) :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip) if ids else ""


def _clean_up_spaces(text: str) -> str:
    """transformers' clean_up_tokenization (used when tokenizer_config asks for it)."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't")):
        text = text.replace(a, b)
    for a, b in ((" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _json(file: Path) -> dict[str, Any]:
    if not file.is_file():
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"{file}: not valid JSON: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _request_defaults(generation: Mapping[str, Any]) -> dict[str, Any]:
    found = generation.get("kafila_request_defaults")
    return dict(found) if isinstance(found, dict) else {}
