"""The probe prices and runs its synthetic blocks and head in the session's weight format."""

from __future__ import annotations

import pytest

from kafila.engine.backend import resolve
from kafila.models.config import ModelConfig
from kafila.models.manifest import build_manifest, specs_from_config
from kafila.probe.ops import Ops

CONFIG = ModelConfig.from_dict(
    {
        "model_type": "llama", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 256, "vocab_size": 512, "tie_word_embeddings": True,
    }
)  # fmt: skip


@pytest.mark.parametrize("quant", ["none", "int8", "q4"])
def test_the_synthetic_block_weighs_what_the_manifest_prices_in_the_sessions_format(quant: str) -> None:
    ops = Ops(resolve("torch", "fp32"), quant)
    manifest = build_manifest(specs_from_config(CONFIG, "F32"), CONFIG, "F32", quant)
    assert ops.block_bytes(CONFIG) == manifest.block_bytes[0]
    run = ops.make_block(CONFIG, position=3, blocks=2)
    assert tuple(run().shape) == (1, CONFIG.hidden_size)
    head, nbytes = ops.make_head(CONFIG)
    assert tuple(head().shape) == (1, CONFIG.vocab_size)
    # the unembedding: fp32, or int8 (34 bytes per 32 weights) in both packed formats
    assert nbytes == {"none": 4 * 512 * 128, "int8": 512 * 128 * 34 // 32, "q4": 512 * 128 * 34 // 32}[quant]


def test_quant_models_packed_block_is_smaller_than_the_float_one() -> None:
    f32 = Ops(resolve("torch", "fp32")).block_bytes(CONFIG)
    q4 = Ops(resolve("torch", "fp32"), "q4").block_bytes(CONFIG)
    assert q4 < f32 / 5
