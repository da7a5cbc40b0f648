"""A GGUF's SentencePiece vocabulary (`tokenizer.ggml.model` "llama": Llama 2, Mistral, TinyLlama) as
a `tokenizers` Tokenizer that splits text as llama.cpp and transformers do.

llama.cpp's SentencePiece tokenizer replaces spaces with "▁" (U+2581), puts one before the text and
before each stretch of text after a special token, even one that starts with a space
(`tokenizer.ggml.add_space_prefix`, on unless the file says otherwise), then merges adjacent pieces,
the pair whose joined piece scores highest (`tokenizer.ggml.scores`) first, and spells a character
no piece holds as its UTF-8 bytes (`<0x41>` tokens). The same as a BPE whose merges are every
split of every vocabulary piece into two pieces, best score first (transformers' `generate_merges`,
which its GGUF loader uses), with byte fallback, and the prefix and spaces as Llama 2's own
tokenizer.json puts them (a normalizer: transformers' GGUF loader's Metaspace pre-tokenizer adds
no prefix to a text that starts with a space, nor after a special token). Control tokens
(`<s>`, `</s>`) are special added tokens, user-defined ones plain added tokens; BOS is put before
an encoded text where `tokenizer.ggml.add_bos_token` says so (llama.cpp's default for these files:
on).
"""

from __future__ import annotations

from typing import Any

SPACE = "\u2581"
UNKNOWN, CONTROL, USER_DEFINED = 2, 3, 4  # tokenizer.ggml.token_type values (1 normal, 6 byte)


def add_bos(meta: dict[str, Any]) -> bool:
    """Whether an encoded text starts with BOS (llama.cpp: yes unless the file says no)."""
    return bool(meta.get("tokenizer.ggml.add_bos_token", True))


def merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of a piece into two vocabulary pieces, the joined piece's score first (higher
    first; then the longer left part, then the longer right part; then by the parts' ids)."""
    ids = {t: i for i, t in enumerate(tokens)}
    found: list[tuple[float, int, int, int, int, str, str]] = []
    for piece, score in zip(tokens, scores, strict=True):
        for cut in range(1, len(piece)):
            left, right = piece[:cut], piece[cut:]
            if left in ids and right in ids:
                found.append((-score, -len(left), -len(right), ids[left], ids[right], left, right))
    found.sort(key=lambda m: m[:5])
    return [(m[5], m[6]) for m in found]


def sentencepiece_tokenizer(meta: dict[str, Any]) -> Any:
    """The `tokenizers` Tokenizer of a GGUF's SentencePiece vocabulary (see the module)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    kinds: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    scores = meta.get("tokenizer.ggml.scores")
    if scores is None or len(scores) != len(tokens):
        have = "none" if scores is None else len(scores)
        raise ValueError(f"a SentencePiece vocabulary of {len(tokens)} tokens needs as many scores: {have}")
    unk = _unknown(meta, tokens, kinds)
    model = models.BPE(
        vocab={t: i for i, t in enumerate(tokens)},
        merges=merges(tokens, [float(s) for s in scores]),
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    tok = Tokenizer(model)
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    spaces = normalizers.Replace(" ", SPACE)
    # each stretch of text (the whole, or each between special tokens) gets its own prefix space
    tok.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), spaces]) if prefix else spaces
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:  # the space put before the text
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tok.decoder = decoders.Sequence(steps)
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if add_bos(meta) and bos is not None and 0 <= int(bos) < len(tokens):
        b = tokens[int(bos)]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{b} $A", pair=f"{b} $A {b} $B", special_tokens=[(b, int(bos))]
        )
    tok.add_tokens(
        [
            AddedToken(t, special=kind == CONTROL, normalized=False)
            for t, kind in zip(tokens, kinds, strict=True)
            if kind in (CONTROL, USER_DEFINED)
        ]
    )
    return tok


def _unknown(meta: dict[str, Any], tokens: list[str], kinds: list[int]) -> str | None:
    i = meta.get("tokenizer.ggml.unknown_token_id")
    if i is not None and 0 <= int(i) < len(tokens):
        return tokens[int(i)]
    return next((t for t, kind in zip(tokens, kinds, strict=True) if kind == UNKNOWN), None)
