"""Tokenizer: encode/decode equal transformers' fast tokenizer (SmolLM2 converted, real Qwen3), streaming
decode never emits broken UTF-8, stop ids come from every place a folder names them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kafila.engine.tokenizer import Tokenizer, TokenizerError
from kafila.models.checkpoint import Checkpoint

TEXTS = [
    "What is the capital of France?",
    " leading space and  double  spaces ",
    "digits 1234567890 and 3.14159",
    "naïve café – Ünïcödé — «東京» 🚀👍🏽 ﷽ 𝔘𝔫𝔦𝔠𝔬𝔡𝔢",
    "code:\n\tdef f(x):\n\t\treturn x**2  # square\n",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.fixture(scope="module", params=["smollm2", "qwen3"])
def pair(request: pytest.FixtureRequest) -> tuple[Tokenizer, Any]:
    from transformers import PreTrainedTokenizerFast

    folder: Path = request.getfixturevalue(
        "smollm2_path" if request.param == "smollm2" else "qwen3_tokenizer_dir"
    )
    return Tokenizer.from_folder(folder), PreTrainedTokenizerFast.from_pretrained(folder)


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_like_transformers(pair: tuple[Tokenizer, Any], text: str) -> None:
    ours, ref = pair
    ids = ours.encode(text)
    assert ids == ref(text)["input_ids"]
    assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False)["input_ids"]
    assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)


def test_special_tokens_and_stop_ids(pair: tuple[Tokenizer, Any]) -> None:
    ours, ref = pair
    assert ours.eos_token == ref.eos_token == "<|im_end|>"
    assert ours.bos_token == ref.bos_token
    assert ours.pad_id == ref.pad_token_id
    assert ref.eos_token_id in ours.stop_ids
    assert ours.vocab_size == len(ref)
    im_start = ours.token_to_id("<|im_start|>")
    assert im_start is not None and ours.id_to_token(im_start) == "<|im_start|>"
    assert ours.encode("<|im_start|>", add_special_tokens=False) == [im_start]


def _stream(tok: Tokenizer, ids: list[int], skip: bool = True) -> list[str]:
    stream = tok.stream(skip_special_tokens=skip)
    pieces = [stream.push(i) for i in ids]
    return [*pieces, stream.flush()]


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_emits_broken_utf8(pair: tuple[Tokenizer, Any], text: str) -> None:
    tok = pair[0]
    ids = tok.encode(text, add_special_tokens=False)
    for skip in (True, False):
        pieces = _stream(tok, ids, skip)
        assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
        assert not any("\ufffd" in p for p in pieces)


def test_streaming_holds_back_a_split_character(pair: tuple[Tokenizer, Any]) -> None:
    """A character whose UTF-8 bytes span tokens comes out whole, with the token that completes it."""
    tok = pair[0]
    ids = tok.encode("ok 𝔘𝔫𝔦", add_special_tokens=False)
    partial = [i for i in ids if "\ufffd" in tok.decode([i])]
    assert partial, "test text must contain a character split over byte-level tokens"
    pieces = _stream(tok, ids)
    assert "" in pieces[:-1]  # some token completed nothing printable
    assert [p for p in pieces if p] and all(len(p.encode()) >= 1 for p in pieces if p)
    assert "".join(pieces) == "ok 𝔘𝔫𝔦"


def test_streaming_flush_shows_a_truncated_tail(pair: tuple[Tokenizer, Any]) -> None:
    tok = pair[0]
    ids = tok.encode("a𝔘", add_special_tokens=False)
    broken = next(n for n in range(1, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd"))
    pieces = _stream(tok, ids[:broken])
    assert "\ufffd" not in "".join(pieces[:-1]) and pieces[-1].endswith("\ufffd")


def test_from_checkpoint_collects_stop_ids(
    smollm2_path: Path, tiny_checkpoint: Callable[..., Path], tmp_path: Path
) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama-gqa3-tied"), folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_path / name, folder / name)
    gen = json.loads((folder / "generation_config.json").read_text()) | {"eos_token_id": [7, 9]}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    tok = Tokenizer.from_checkpoint(Checkpoint.open(folder))
    # generation_config [7, 9] + config.json eos 2 + tokenizer_config eos "<|im_end|>" (= 2)
    assert tok.stop_ids == {2, 7, 9}
    assert tok.chat_template is not None and "<|im_start|>" in tok.chat_template


def test_errors_name_the_problem(tiny_checkpoint: Callable[..., Path], tmp_path: Path) -> None:
    ckpt = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))
    with pytest.raises(TokenizerError, match=r"no tokenizer\.json"):
        Tokenizer.from_checkpoint(ckpt)
    with pytest.raises(TokenizerError, match=r"tokenizer\.json: missing"):
        Tokenizer.from_folder(tmp_path)
    (tmp_path / "tokenizer.json").write_text('{"model": 3}')
    with pytest.raises(TokenizerError, match="not a tokenizers file"):
        Tokenizer.from_folder(tmp_path)


def test_render_without_template_is_an_error(smollm2_path: Path, tmp_path: Path) -> None:
    shutil.copy(smollm2_path / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_folder(tmp_path)
    assert tok.decode(tok.encode("plain completion")) == "plain completion"
    with pytest.raises(TokenizerError, match="no chat template"):
        tok.render_chat([{"role": "user", "content": "hi"}])


def test_post_processor_bos_like_llama3(smollm2_path: Path, tmp_path: Path) -> None:
    """A tokenizer.json whose post-processor adds BOS (as Llama 3's does): plain encode adds it,
    a rendered chat does not (its template writes the BOS), exactly as transformers does."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    backend = Backend.from_file(str(smollm2_path / "tokenizer.json"))
    backend.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A",
        pair="<|endoftext|> $A <|endoftext|> $B",
        special_tokens=[("<|endoftext|>", 0)],
    )
    backend.save(str(tmp_path / "tokenizer.json"))
    config = json.loads((smollm2_path / "tokenizer_config.json").read_text())
    config |= {"bos_token": "<|endoftext|>", "chat_template": "{{ bos_token }}{{ messages[0]['content'] }}"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    ours, ref = Tokenizer.from_folder(tmp_path), PreTrainedTokenizerFast.from_pretrained(tmp_path)
    assert ours.encode("hello") == ref("hello")["input_ids"] == [0, *ours.encode("hello", False)]
    chat = [{"role": "user", "content": "hello"}]
    want = ref.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert ours.encode_chat(chat, add_generation_prompt=False) == list(want) == ours.encode("hello")
