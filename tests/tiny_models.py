"""Tiny random Llama and Qwen3 checkpoints written by transformers itself (the test reference).

`make_tiny(folder, arch, seed=0, **shape)` saves a Hugging Face folder (config.json plus
model.safetensors, or shards with model.safetensors.index.json when `shard_bytes` is given) and
returns the transformers model in fp32 eval mode, so tests can compare against it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

# Shapes the engine must get right: GQA ratios, tied/untied, head_dim != hidden/heads.
SHAPES: dict[str, dict[str, Any]] = {
    "llama-gqa3-tied": dict(
        hidden_size=96,
        num_attention_heads=6,
        num_key_value_heads=2,
        intermediate_size=160,
        tie_word_embeddings=True,
    ),
    "llama-mha-untied": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=128,
        tie_word_embeddings=False,
    ),
    "llama-mqa-headdim": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=24,
        intermediate_size=112,
        tie_word_embeddings=False,
    ),
    "llama3-rope-scaling": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        tie_word_embeddings=True,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen3-gqa2-untied": dict(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        intermediate_size=96,
        tie_word_embeddings=False,
    ),
    "qwen3-gqa4-tied": dict(
        hidden_size=128,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=192,
        tie_word_embeddings=True,
    ),
}


def make_tiny(
    folder: Path,
    arch: str = "llama",
    *,
    seed: int = 0,
    num_hidden_layers: int = 5,
    vocab_size: int = 256,
    shard_bytes: int | None = None,
    dtype: str = "float32",
    **shape: Any,
) -> Any:
    import torch
    import transformers

    cfg_cls = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen3": transformers.Qwen3ForCausalLM}[arch]
    base = dict(
        num_hidden_layers=num_hidden_layers,
        vocab_size=vocab_size,
        max_position_embeddings=256,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = cfg_cls(**(base | shape))
    torch.manual_seed(seed)
    model = model_cls(config).eval()
    with torch.no_grad():  # default init is tiny; widen it so logits are of unit scale
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.5 / p.shape[-1] ** 0.5 * 4)
    folder.mkdir(parents=True, exist_ok=True)
    kwargs = {"max_shard_size": shard_bytes} if shard_bytes else {}
    model.to(getattr(torch, dtype)).save_pretrained(folder, **kwargs)
    return model.float()
