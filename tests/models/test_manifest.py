"""Manifest from safetensors headers equals sums over the real tensors (loaded by safetensors), and the
planner's config-only path (`specs_from_config`) equals the headers for every tiny shape."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors.torch import load_file

from kafila.models.checkpoint import Checkpoint
from kafila.models.manifest import (
    EMBED,
    FINAL_NORM,
    LM_HEAD,
    Manifest,
    block_index,
    build_manifest,
    specs_from_config,
)
from tests.tiny_models import SHAPES

TinyFactory = Callable[..., Path]


def _real_nbytes(folder: Path) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for file in folder.glob("*.safetensors"):
        for name, tensor in load_file(file).items():
            sizes[name] = tensor.numel() * tensor.element_size()
    return sizes


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_manifest_is_exact_against_tensor_sums(
    tiny_checkpoint: TinyFactory, shape: str, sharded: bool
) -> None:
    folder = tiny_checkpoint(shape, sharded=sharded)
    ckpt = Checkpoint.open(folder)
    real = _real_nbytes(folder)
    m = ckpt.manifest()
    cfg = ckpt.config
    assert m.n_blocks == cfg.num_hidden_layers == 5
    for i in range(m.n_blocks):
        assert m.block_bytes[i] == sum(n for name, n in real.items() if block_index(name) == i)
    tied = LM_HEAD not in real
    assert tied == cfg.tie_word_embeddings
    embed_row = real[EMBED] // cfg.vocab_size
    assert embed_row == cfg.hidden_size * 4
    if tied:
        assert m.head_resident_bytes == real[EMBED] + real[FINAL_NORM]
        assert m.head_read_bytes == real[EMBED] + real[FINAL_NORM] + embed_row
    else:
        assert m.head_resident_bytes == real[EMBED] + real[FINAL_NORM] + real[LM_HEAD]
        assert m.head_read_bytes == real[LM_HEAD] + real[FINAL_NORM] + embed_row
    assert m.kv_bytes_per_token_per_block == 2 * cfg.num_key_value_heads * cfg.head_dim * 4
    assert m.total_bytes == sum(real.values())
    assert m.dtype == "F32"


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_specs_from_config_equal_the_headers(tiny_checkpoint: TinyFactory, shape: str) -> None:
    ckpt = Checkpoint.open(tiny_checkpoint(shape))
    from_config = sorted(specs_from_config(ckpt.config, "F32"), key=lambda s: s.name)
    assert from_config == sorted(ckpt.specs(), key=lambda s: s.name)
    assert build_manifest(from_config, ckpt.config) == ckpt.manifest()


def test_bf16_checkpoint_and_dtype_pricing(tiny_checkpoint: TinyFactory) -> None:
    f32 = Checkpoint.open(tiny_checkpoint("qwen3-gqa2-untied")).manifest()
    bf16_ckpt = Checkpoint.open(tiny_checkpoint("qwen3-gqa2-untied", dtype="bfloat16"))
    assert {t.dtype for t in bf16_ckpt.tensors.values()} == {"BF16"}
    bf16 = bf16_ckpt.manifest()
    assert bf16.dtype == "BF16"
    assert [2 * b for b in bf16.block_bytes] == list(f32.block_bytes)
    assert 2 * bf16.head_resident_bytes == f32.head_resident_bytes
    assert 2 * bf16.kv_bytes_per_token_per_block == f32.kv_bytes_per_token_per_block
    # pricing an fp32 checkpoint at bf16 (the engine casts on load) gives the bf16 checkpoint's sizes
    as_bf16 = Checkpoint.open(tiny_checkpoint("qwen3-gqa2-untied")).manifest("BF16")
    assert as_bf16 == bf16


def test_manifest_round_trips_through_dict(tiny_checkpoint: TinyFactory) -> None:
    m = Checkpoint.open(tiny_checkpoint("llama-mqa-headdim")).manifest()
    assert Manifest.from_dict(m.to_dict()) == m
    assert m.kv_bytes(context=128, concurrency=3, n_blocks=2) == m.kv_bytes_per_token_per_block * 128 * 3 * 2
