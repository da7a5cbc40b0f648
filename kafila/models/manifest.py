"""Byte sizes of a checkpoint's parts, the planner's model inputs (pure: stdlib only).

A manifest is computed from tensor specs (name, dtype, shape) alone: from safetensors headers for
a real checkpoint (kafila.models.checkpoint) or synthesized from a config for planning presets
(`specs_from_config`). No tensor bytes are read.

- `block_bytes[i]`: every tensor named `model.layers.{i}.*`.
- `head_resident_bytes`: embedding + final norm + unembedding (counted once when tied).
- `head_read_bytes`: what one decoded token reads at the head: unembedding + final norm + one
  embedding row.
- `kv_bytes_per_token_per_block`: K and V for one position in one block at the KV dtype.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass

from kafila.models.config import ModelConfig

DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
}
# names users type for a runtime dtype -> safetensors dtype
RUNTIME_DTYPES = {
    "fp32": "F32",
    "float32": "F32",
    "fp16": "F16",
    "float16": "F16",
    "bf16": "BF16",
    "bfloat16": "BF16",
}

EMBED = "model.embed_tokens.weight"
FINAL_NORM = "model.norm.weight"
LM_HEAD = "lm_head.weight"
_BLOCK = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype string, e.g. "F32", "BF16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def nbytes(self, dtype: str | None = None) -> int:
        return self.numel * DTYPE_BYTES[dtype or self.dtype]


@dataclass(frozen=True)
class Manifest:
    model_type: str
    n_blocks: int
    block_bytes: tuple[int, ...]
    head_resident_bytes: int
    head_read_bytes: int
    kv_bytes_per_token_per_block: int
    dtype: str  # the dtype the sizes are given in

    @property
    def block_bytes_max(self) -> int:
        return max(self.block_bytes)

    @property
    def total_bytes(self) -> int:
        return sum(self.block_bytes) + self.head_resident_bytes

    def kv_bytes(self, context: int, concurrency: int, n_blocks: int) -> int:
        """KV cache reserved for `n_blocks` blocks at a declared context and concurrency."""
        return self.kv_bytes_per_token_per_block * context * concurrency * n_blocks

    def to_dict(self) -> dict[str, object]:
        d = asdict(self)
        d["block_bytes"] = list(self.block_bytes)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> Manifest:
        return cls(**{**d, "block_bytes": tuple(d["block_bytes"])})  # type: ignore[arg-type]


def block_index(name: str) -> int | None:
    """`model.layers.7.mlp.up_proj.weight` -> 7; head tensors -> None."""
    m = _BLOCK.match(name)
    return int(m.group(1)) if m else None


def build_manifest(specs: Iterable[TensorSpec], config: ModelConfig, dtype: str | None = None) -> Manifest:
    """Sizes from tensor specs. `dtype` (e.g. "BF16") prices floating tensors as if cast to it,
    as the engine does when asked for another dtype; None keeps each tensor's stored dtype."""
    by_name = {s.name: s for s in specs}
    size = {
        n: s.nbytes(dtype if dtype and s.dtype.startswith(("F", "BF")) else None) for n, s in by_name.items()
    }
    blocks = [0] * config.num_hidden_layers
    for name, nbytes in size.items():
        i = block_index(name)
        if i is not None:
            if i >= config.num_hidden_layers:
                raise ValueError(f"tensor {name} is past num_hidden_layers={config.num_hidden_layers}")
            blocks[i] += nbytes
    for name in (EMBED, FINAL_NORM):
        if name not in by_name:
            raise ValueError(f"checkpoint has no {name}")
    tied = LM_HEAD not in by_name
    unembed = size[EMBED] if tied else size[LM_HEAD]
    embed_row = size[EMBED] // by_name[EMBED].shape[0]
    kv_dtype = dtype or by_name[EMBED].dtype
    return Manifest(
        model_type=config.model_type,
        n_blocks=config.num_hidden_layers,
        block_bytes=tuple(blocks),
        head_resident_bytes=size[EMBED] + size[FINAL_NORM] + (0 if tied else size[LM_HEAD]),
        head_read_bytes=unembed + size[FINAL_NORM] + embed_row,
        kv_bytes_per_token_per_block=2 * config.num_key_value_heads * config.head_dim * DTYPE_BYTES[kv_dtype],
        dtype=kv_dtype,
    )


def specs_from_config(config: ModelConfig, dtype: str = "BF16") -> list[TensorSpec]:
    """The Hugging Face tensor list a Llama/Qwen3 checkpoint of this config holds."""
    h, d, v, f = config.hidden_size, config.head_dim, config.vocab_size, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    specs = [TensorSpec(EMBED, dtype, (v, h)), TensorSpec(FINAL_NORM, dtype, (h,))]
    if not config.tie_word_embeddings:
        specs.append(TensorSpec(LM_HEAD, dtype, (v, h)))
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}."
        block = {
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
            "self_attn.q_proj.weight": (q, h),
            "self_attn.k_proj.weight": (kv, h),
            "self_attn.v_proj.weight": (kv, h),
            "self_attn.o_proj.weight": (h, q),
            "mlp.gate_proj.weight": (f, h),
            "mlp.up_proj.weight": (f, h),
            "mlp.down_proj.weight": (h, f),
        }
        if config.attention_bias:
            block |= {
                "self_attn.q_proj.bias": (q,),
                "self_attn.k_proj.bias": (kv,),
                "self_attn.v_proj.bias": (kv,),
            }
        if config.qk_norm:
            block |= {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        specs += [TensorSpec(p + k, dtype, shape) for k, shape in block.items()]
    return specs
