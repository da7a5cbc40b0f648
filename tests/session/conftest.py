"""Fixtures the session tests share: the NAT lab (root) from tests/natlab, a real rendezvous on
loopback, and tiny random chat models carrying the real SmolLM2 tokenizer and chat template."""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.natlab.conftest import natlab
from tests.net.conftest import rdv
from tests.tiny_models import make_tiny

__all__ = ["make_tiny_chat", "natlab", "rdv"]


def make_tiny_chat(folder: Path, tokenizer: Path, blocks: int) -> Path:
    """A tiny random Llama of `blocks` blocks with SmolLM2's vocabulary, and its tokenizer and
    template from the folder `tokenizer` (the `smollm2_tokenizer` fixture)."""
    make_tiny(
        folder,
        "llama",
        num_hidden_layers=blocks,
        vocab_size=49152,
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=True,
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, folder / name)
    return folder
