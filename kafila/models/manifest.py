"""Byte sizes of a checkpoint's parts, the planner's model inputs (pure: stdlib only).

A manifest is computed from tensor specs (name, dtype, shape) alone: from safetensors headers for
a real checkpoint (kafila.models.checkpoint) or synthesized from a config for planning presets
(`specs_from_config`). No tensor bytes are read.

- `block_bytes[i]`: every tensor named `model.layers.{i}.*`.
- `head_resident_bytes`: embedding + final norm + unembedding (counted once when tied).
- `head_read_bytes`: what one decoded token reads at the head: unembedding + final norm + one
  embedding row.
- `kv_bytes_per_token_per_block`: K and V for one position in one block at the KV dtype.

Weight formats (`QUANT_FORMATS`; docs/weights.md): "none" keeps floats; "int8" stores a matrix
[out, in] as int8 values [out, in] plus one float16 scale per group of `GROUP` = 32 inputs
([out, in/32], llama.cpp's Q8_0: 34 bytes per 32 weights); "q4" as 4-bit values packed two to a
byte [out, in/2] plus a float16 scale and a float16 minimum per group ([out, in/32] each, Q4_1: 20
bytes per 32). A packed checkpoint stores them as ordinary safetensors entries `X.weight` (I8 or
U8), `X.scales` (F16) and, for q4, `X.mins` (F16): a block's bytes are its entries' bytes, exact.
The other packed formats are a GGUF file's types served as stored (no session packs floats into
them; LAYOUTS has each one's entries): "q5" (Q5_0 and Q5_1: q4's entries and a fifth bit per
weight, `X.high` U8 [out, in/8]: in each group of 32, bit j of byte j / 8 is entry j's, llama.cpp's
Q5_1 `qh`; w = scale * (q + 16 h) + min: 24 bytes per 32 weights); and the K-quants, super-blocks
of `SUPER` = 256 inputs whose bytes besides their float16 scale d (`X.scales` [out, in/256]) and,
for q4k and q5k, minimum dmin (`X.mins`) are `X.weight` U8 [out, in/256 * bytes] in llama.cpp's
own order: "q6k" (Q6_K, 208 + 2 bytes per 256 weights), "q4k" (Q4_K, 140 + 4), "q5k" (Q5_K,
172 + 4): the file's bytes (kafila.models.quant has the layouts).
Policy: the linear layers of the blocks take the session's format; the embedding/unembedding
matrix is int8 in either quantized format (the default GGUF's own Q8_0 embedding, kept); norms and
biases stay in the compute dtype. A packed checkpoint (config.json's `quantization_config`, as a
GGUF converts to: kafila.models.gguf_convert) keeps the float matrices it holds as floats: they are
floats there because their numbers have no packed format (`keeps_floats`).
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

QUANT_FORMATS = ("none", "int8", "q4")
GROUP = 32  # inputs per scale (and minimum) in both packed formats
SCALES, MINS = "scales", "mins"  # sibling entries of a packed `X.weight`: `X.scales`, `X.mins`
HIGH = "high"  # q5's sibling `X.high`: the fifth bit of each weight
SIBLINGS = (SCALES, MINS, HIGH)
SUPER = 256  # inputs per super-block of the K-quant formats (llama.cpp's QK_K)
# a super-block's bytes besides its float16 scale (and minimum) in each K-quant format
Q6K_BYTES = 208  # q6k: 128 low nibbles, 64 bytes of high bits, 16 int8 sub-scales
Q4K_BYTES = 140  # q4k: 12 bytes of 6-bit sub-scales and sub-minimums, 128 of nibbles
Q5K_BYTES = 172  # q5k: q4k's 12, 32 bytes of fifth bits, 128 of nibbles


@dataclass(frozen=True)
class Layout:
    """How a packed format stores a matrix [out, in]: `X.weight` of dtype `data` holding
    `data_bytes` bytes per `per` inputs of a row, `X.scales` F16 one per `per` inputs, with `mins`
    an `X.mins` F16 the same, with `high` an `X.high` U8 of one bit per input."""

    data: str  # "I8" | "U8"
    per: int  # inputs per scale
    data_bytes: int  # `X.weight` bytes per scale
    mins: bool = False
    high: bool = False

    def scale_bytes(self) -> int:
        """Bytes per `per` inputs of a row, every entry counted."""
        return self.data_bytes + (4 if self.mins else 2) + (self.per // 8 if self.high else 0)


LAYOUTS = {
    "int8": Layout("I8", GROUP, GROUP),
    "q4": Layout("U8", GROUP, GROUP // 2, mins=True),
    "q5": Layout("U8", GROUP, GROUP // 2, mins=True, high=True),
    "q6k": Layout("U8", SUPER, Q6K_BYTES),
    "q4k": Layout("U8", SUPER, Q4K_BYTES, mins=True),
    "q5k": Layout("U8", SUPER, Q5K_BYTES, mins=True),
}
PACKED_DTYPES = {fmt: layout.data for fmt, layout in LAYOUTS.items()}
NP_DTYPES = {"F32": "<f4", "F16": "<f2", "BF16": "<u2", "I8": "i1", "U8": "u1"}  # numpy's, of each

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


def packed_specs(name: str, fmt: str, shape: tuple[int, ...]) -> list[TensorSpec]:
    """The entries a matrix [out, in] named `name` takes in packed format `fmt` (LAYOUTS)."""
    out, cols = shape
    layout = _layout(fmt)
    if cols % layout.per:
        raise ValueError(f"{name} [{out}, {cols}]: {fmt} needs inputs in groups of {layout.per}")
    base, n = name.removesuffix("weight"), cols // layout.per
    specs = [
        TensorSpec(name, layout.data, (out, n * layout.data_bytes)),
        TensorSpec(base + SCALES, "F16", (out, n)),
    ]
    if layout.mins:
        specs.append(TensorSpec(base + MINS, "F16", (out, n)))
    if layout.high:
        specs.append(TensorSpec(base + HIGH, "U8", (out, cols // 8)))
    return specs


def _layout(fmt: str) -> Layout:
    if fmt not in LAYOUTS:
        raise ValueError(f"unknown weight format {fmt!r}; choose one of {', '.join(QUANT_FORMATS)}")
    return LAYOUTS[fmt]


@dataclass(frozen=True)
class Manifest:
    model_type: str
    n_blocks: int
    block_bytes: tuple[int, ...]
    head_resident_bytes: int
    head_read_bytes: int
    kv_bytes_per_token_per_block: int
    dtype: str  # the dtype the sizes are given in
    quant: str = "none"  # the weight format the blocks are priced in (QUANT_FORMATS; None: as stored)

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


def stage_tensors(names: Iterable[str], blocks: range, head: bool) -> list[str]:
    """The tensors among `names` a stage of blocks [a, b) (and the head) reads: its blocks' and,
    with `head`, the embedding, final norm and lm_head with their packed scales and minimums."""
    wanted = {EMBED, FINAL_NORM, LM_HEAD} if head else set()
    wanted |= {n.removesuffix("weight") + part for n in wanted for part in SIBLINGS}
    return [n for n in names if n in wanted or ((i := block_index(n)) is not None and i in blocks)]


def matrix_shape(fmt: str, data_shape: tuple[int, ...]) -> tuple[int, int]:
    """The [out, in] a packed `data` array of this shape stands for (two q4 values per byte; q6k's
    208 bytes per 256 inputs)."""
    out, cols = data_shape
    layout = LAYOUTS[fmt]
    return (out, cols // layout.data_bytes * layout.per)


def entries_format(data_dtype: str, data_cols: int, scale_cols: int, has_mins: bool, has_high: bool) -> str:
    """The packed format of a matrix whose `X.weight` entry has safetensors dtype `data_dtype` and
    `data_cols` columns beside `X.scales` of `scale_cols`, with `X.mins` and `X.high` siblings or
    not: the LAYOUTS entry they match (data bytes per scale tell q4 from q4k, q5k, q6k)."""
    per_scale = data_cols // max(scale_cols, 1)
    for fmt, layout in LAYOUTS.items():
        if (layout.data, layout.data_bytes, layout.mins, layout.high) == (
            data_dtype, per_scale, has_mins, has_high
        ):  # fmt: skip
            return fmt
    siblings = "".join(f" + {n}" for n, on in ((MINS, has_mins), (HIGH, has_high)) if on)
    raise ValueError(
        f"packed entries {data_dtype} [.., {data_cols}] + scales [.., {scale_cols}]{siblings} "
        "match no packed format"
    )


def session_format(fmt: str) -> str:
    """The session format (QUANT_FORMATS) a stored matrix format counts as where a checkpoint's
    format is voted: q6k as int8 (signed levels, no minimums; a session of either packed format
    holds it as stored), q5, q4k and q5k as q4."""
    return {"q6k": "int8", "q5": "q4", "q4k": "q4", "q5k": "q4"}.get(fmt, fmt)


def packed_bytes(fmt: str, rows: int, cols: int) -> int:
    """Bytes of a [rows, cols] matrix in weight format `fmt` (LAYOUTS), scales included."""
    layout = _layout(fmt)
    if cols % layout.per:
        raise ValueError(
            f"a {fmt} matrix needs inputs in groups of {layout.per}; [{rows}, {cols}] has {cols}"
        )
    return rows * (cols // layout.per) * layout.scale_bytes()


def is_linear(name: str) -> bool:
    """Whether `name` is a matrix a quantized session packs: a block's projections and the head's
    embedding/unembedding (not norms, not biases)."""
    return name in (EMBED, LM_HEAD) or (block_index(name) is not None and name.endswith("_proj.weight"))


def linear_format(name: str, quant: str) -> str:
    """The format weight `name` takes in a session of format `quant` (the module docstring's policy)."""
    if quant == "none" or not is_linear(name):
        return "none"
    return "int8" if name in (EMBED, LM_HEAD) else quant


def packed_format(name: str, by_name: dict[str, TensorSpec]) -> str:
    """The format a checkpoint stores matrix `name` in: "int8"/"q4"/"q6k" where its `scales`
    sibling is present (`entries_format`), else "none"."""
    base = name.removesuffix("weight")
    if not name.endswith(".weight") or base + SCALES not in by_name or name not in by_name:
        return "none"
    data, scales = by_name[name], by_name[base + SCALES]
    if len(data.shape) != 2 or len(scales.shape) != 2:
        return "none"
    has_mins, has_high = base + MINS in by_name, base + HIGH in by_name
    return entries_format(data.dtype, data.shape[1], scales.shape[1], has_mins, has_high)


def logical_shape(spec: TensorSpec, by_name: dict[str, TensorSpec]) -> tuple[int, ...]:
    """The unpacked shape of `spec` ([out, in] for a q4 matrix stored as [out, in/2])."""
    fmt = packed_format(spec.name, by_name)
    if fmt != "none":
        return matrix_shape(fmt, spec.shape)
    return spec.shape


def keeps_floats(config: ModelConfig) -> bool:
    """Whether a checkpoint's float matrices stay floats in a packed session: a packed checkpoint's
    (config.json names its `quantization_config`), whose floats hold numbers no format packs."""
    return isinstance(config.raw.get("quantization_config"), dict)


def priced(
    specs: Iterable[TensorSpec], dtype: str | None = None, quant: str | None = None, keep_floats: bool = False
) -> dict[str, int]:
    """Bytes per tensor name as a stage holds them. Floats are priced in `dtype` where given. With
    `quant` ("none", "int8", "q4") a float matrix takes its format under the policy above and a
    packed one (with its scales and minimums) is kept as stored, or widened to `dtype` (or F32) for
    "none"; None keeps every tensor as stored. With `keep_floats` (`keeps_floats`) float matrices
    are priced as floats in every format."""
    by_name = {s.name: s for s in specs}
    size: dict[str, int] = {}
    for n, s in by_name.items():
        base = n.removesuffix(SCALES).removesuffix(MINS).removesuffix(HIGH)
        if n.endswith(SIBLINGS) and packed_format(base + "weight", by_name) != "none":
            size[n] = 0 if quant == "none" else s.nbytes()  # part of its matrix's price
            continue
        stored = packed_format(n, by_name)
        if stored != "none":
            shape = logical_shape(s, by_name)
            wide = TensorSpec(n, dtype or "F32", shape)
            size[n] = wide.nbytes() if quant == "none" else s.nbytes()
            continue
        floating = s.dtype.startswith(("F", "BF"))
        packs = floating and len(s.shape) == 2 and not keep_floats
        fmt = linear_format(n, quant or "none") if packs else "none"
        if fmt != "none":
            size[n] = packed_bytes(fmt, s.shape[0], s.shape[1])
        else:
            size[n] = s.nbytes(dtype if dtype and floating else None)
    return size


def build_manifest(
    specs: Iterable[TensorSpec], config: ModelConfig, dtype: str | None = None, quant: str | None = None
) -> Manifest:
    """Sizes from tensor specs. `dtype` (e.g. "BF16") prices floating tensors as if cast to it,
    as the engine does when asked for another dtype; None keeps each tensor's stored dtype.
    `quant` prices the weights in a format (`priced`); the KV cache stays in `dtype`."""
    by_name = {s.name: s for s in specs}
    size = priced(by_name.values(), dtype, quant, keeps_floats(config))
    for n in list(size):  # a packed matrix's scales and minimums count with it
        base = n.removesuffix(SCALES).removesuffix(MINS).removesuffix(HIGH) + "weight"
        if n.endswith(SIBLINGS) and base in size and packed_format(base, by_name) != "none":
            size[base] += size.pop(n)
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
    kv_dtype = dtype or _float_dtype(by_name)
    return Manifest(
        model_type=config.model_type,
        n_blocks=config.num_hidden_layers,
        block_bytes=tuple(blocks),
        head_resident_bytes=size[EMBED] + size[FINAL_NORM] + (0 if tied else size[LM_HEAD]),
        head_read_bytes=unembed + size[FINAL_NORM] + embed_row,
        kv_bytes_per_token_per_block=2 * config.num_key_value_heads * config.head_dim * DTYPE_BYTES[kv_dtype],
        dtype=kv_dtype,
        quant=quant or _stored_format(by_name),
    )


def _stored_format(by_name: dict[str, TensorSpec]) -> str:
    """The format most block matrices are stored in ("none" for a float checkpoint)."""
    formats = [
        session_format(packed_format(n, by_name))
        for n in by_name
        if is_linear(n) and n not in (EMBED, LM_HEAD)
    ]
    return max(set(formats), key=formats.count) if formats else "none"


def _float_dtype(by_name: dict[str, TensorSpec]) -> str:
    """The float dtype a checkpoint computes in without a `dtype`: its embedding's, or for a packed
    embedding F32 (a packed checkpoint stores its norms in F32)."""
    spec = by_name[EMBED]
    return spec.dtype if spec.dtype.startswith(("F", "BF")) else by_name[FINAL_NORM].dtype


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
