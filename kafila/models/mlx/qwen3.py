"""Qwen3 in MLX: Llama's block with an RMSNorm on every query and key head before RoPE."""

from __future__ import annotations

from kafila.models.mlx.llama import LlamaModel


class Qwen3Model(LlamaModel):
    """Blocks [a, b) of a Qwen3 model (and the head); see LlamaModel."""

    def __init__(self, config, weights, blocks, head, **kw) -> None:  # type: ignore[no-untyped-def]
        if not config.qk_norm:
            raise ValueError(f"Qwen3Model needs a qwen3 config, got model_type={config.model_type!r}")
        super().__init__(config, weights, blocks, head, **kw)
