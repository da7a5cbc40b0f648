"""SentencePiece vocabularies in GGUF files (Llama 2, Mistral, TinyLlama): a small vocabulary with
scores, written with the gguf package as llama.cpp's converter writes one, tokenized by Kafila as
transformers' GGUF loader and llama.cpp's merge-by-score procedure tokenize it."""

from __future__ import annotations

import itertools
import re
from pathlib import Path
from typing import Any

import pytest

from kafila.models.checkpoint import Checkpoint
from kafila.models.gguf_convert import build_tokenizer, ensure_gguf
from kafila.models.gguf_sentencepiece import SPACE, merges
from tests.gguf_files import Shape, write_gguf

gguf = pytest.importorskip("gguf")

# pieces and scores (higher merges first), as SentencePiece's BPE trainer leaves them
PIECES = {
    f"{SPACE}t": -1.0, "he": -2.0, f"{SPACE}the": -3.0, "at": -4.0, f"{SPACE}c": -5.0, f"{SPACE}cat": -6.0,
    "in": -7.0, f"{SPACE}in": -8.0, "er": -9.0, f"{SPACE}s": -10.0, "on": -11.0, f"{SPACE}a": -12.0,
    "an": -13.0, "and": -14.0, f"{SPACE}and": -15.0, f"{SPACE}{SPACE}": -16.0, "ll": -17.0, "ell": -18.0,
    "hell": -19.0, f"{SPACE}h": -20.0, f"{SPACE}hell": -21.0, "ou": -22.0, "th": -23.0, f"{SPACE}th": -24.0,
}  # fmt: skip
LETTERS = "abcdefghijklmnopqrstuvwxyzTHIS.,!?'0123456789"
TEXTS = [
    "the cat sat on the mat",
    " the  cat   and\tthe hell",
    "Hello, world! This is it.",
    "naïve café – 東京 🚀 x=12345",
    "line one\nline two\n\n",
    "<s>the cat</s> and the hat",
    "",
    "   ",
]


def sentencepiece_meta() -> dict[str, Any]:
    """tokenizer.ggml.* of a small SentencePiece vocabulary: <unk>, <s>, </s>, the 256 byte pieces,
    the letters and "▁", then PIECES (types: 2 unknown, 3 control, 6 byte, 1 normal)."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    kinds = [2, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    for i, piece in enumerate([SPACE, *LETTERS]):
        tokens.append(piece), kinds.append(1), scores.append(-100.0 - i)
    for piece, score in PIECES.items():
        tokens.append(piece), kinds.append(1), scores.append(score)
    return {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.token_type": kinds,
        "tokenizer.ggml.merges": [],
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
    }


def llama_cpp_spm(meta: dict[str, Any], text: str) -> list[int]:
    """llama.cpp's SentencePiece tokenizer (llama_tokenize_impl, llm_tokenizer_spm) without BOS:
    special tokens cut out whole; each stretch of text between them gets "▁" for each space and
    one before it, then the adjacent pair whose joined piece scores highest is merged (the
    leftmost of equals), again and again; a symbol no piece holds is spelled as its UTF-8 bytes."""
    kinds = zip(meta["tokenizer.ggml.tokens"], meta["tokenizer.ggml.token_type"], strict=True)
    special = [t for t, k in kinds if k == 3]
    pattern = "(" + "|".join(re.escape(t) for t in special) + ")"
    ids = {t: i for i, t in enumerate(meta["tokenizer.ggml.tokens"])}
    out: list[int] = []
    for part in re.split(pattern, text):
        out += [ids[part]] if part in special else _merge_by_score(meta, part)
    return out


def _merge_by_score(meta: dict[str, Any], text: str) -> list[int]:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    ids = {t: i for i, t in enumerate(tokens)}
    score = dict(zip(tokens, meta["tokenizer.ggml.scores"], strict=True))
    symbols = list(SPACE + text.replace(" ", SPACE)) if text else []
    while True:
        pairs = [(score[a + b], -i) for i, (a, b) in enumerate(itertools.pairwise(symbols)) if a + b in ids]
        if not pairs:
            break
        i = -max(pairs)[1]
        symbols[i : i + 2] = [symbols[i] + symbols[i + 1]]
    out: list[int] = []
    for s in symbols:
        out += [ids[s]] if s in ids else [ids[f"<0x{b:02X}>"] for b in s.encode()]
    return out


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("spm")
    shape = Shape(arch="llama", hidden=256, layers=1, heads=4, kv_heads=2, head_dim=64, ffn=256)
    return write_gguf(folder / "tiny-llama-spm.gguf", shape, sentencepiece_meta(), {})


def test_ids_are_llama_cpps_merges_by_score() -> None:
    meta = sentencepiece_meta()
    tok = build_tokenizer(meta, Path("spm.gguf"))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False).ids == llama_cpp_spm(meta, text), text
        if "<s>" not in text:  # the prefix space goes on decoding
            assert tok.decode(tok.encode(text).ids, skip_special_tokens=True) == text


def test_ids_and_text_are_transformers_gguf_tokenizers() -> None:
    """transformers' GGUF tokenizer builder (the one its loader calls on tokenizer.ggml.*) gives the
    same ids but where a text starts with a space or follows a special token: there llama.cpp (and
    Kafila, and Llama 2's own tokenizer.json) put a prefix space that its Metaspace pre-tokenizer
    leaves out."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import convert_gguf_tokenizer

    meta = sentencepiece_meta()
    fields = {"tokens": "tokens", "scores": "scores", "token_type": "token_type", "model": "tokenizer_type"}
    hf, _ = convert_gguf_tokenizer("llama", {v: meta[f"tokenizer.ggml.{k}"] for k, v in fields.items()})
    tok = build_tokenizer(meta, Path("spm.gguf"))
    for text in TEXTS:
        if text.startswith(" ") or "<s>" in text:
            continue
        ours = tok.encode(text, add_special_tokens=False).ids
        assert ours == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.decode(ours) == hf.decode(ours)
    assert tok.encode("the cat").ids[0] == 1  # BOS, as llama.cpp adds it to these files


def test_merges_rank_joined_pieces_by_score() -> None:
    ranked = merges(["a", "b", "c", "ab", "bc", "abc"], [0.0, 0.0, 0.0, -2.0, -1.0, -3.0])
    assert ranked == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_converted_folder_encodes_with_bos_and_names_its_special_tokens(
    spm_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kafila.engine.tokenizer import Tokenizer

    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    ckpt = Checkpoint.open(ensure_gguf(spm_gguf, progress=False), complete=True)
    tok = Tokenizer.from_checkpoint(ckpt)
    meta = sentencepiece_meta()
    assert tok.encode("the cat sat") == [1, *llama_cpp_spm(meta, "the cat sat")]
    assert tok.decode(tok.encode("the cat sat"), skip_special_tokens=True) == "the cat sat"
    assert (ckpt.special_tokens.bos, ckpt.special_tokens.eos) == ("<s>", "</s>")
