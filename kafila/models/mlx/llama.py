"""Llama (SmolLM2, Llama 2 and 3) in MLX: the embedding, a contiguous range of blocks, the head.

The same model as kafila.models.torch.llama, written for MLX (Apple Silicon, or the CPU through
`mlx[cpu]` on Linux): Hugging Face weight names, rotate-half RoPE from kafila.models.rope, q/k/v and
gate/up fused at load. MLX is lazy; `forward`, `embed` and `logits` evaluate before returning, so a
step's cost is paid inside the call that asked for it.

Shapes: N = rows in a step, H = hidden, d = head_dim, nq/nkv = query/KV heads, L = keys attended,
F = intermediate, V = vocab.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kafila.models import quant as formats
from kafila.models import rope
from kafila.models.config import ModelConfig
from kafila.models.manifest import (
    EMBED,
    FINAL_NORM,
    GROUP,
    HIGH,
    LM_HEAD,
    MINS,
    QUANT_FORMATS,
    SCALES,
    linear_format,
)
from kafila.models.span import Span
from kafila.obs.log import get_logger

log = get_logger(__name__)


@dataclass
class Packed:
    """A packed matrix [out, in] in MLX's affine layout (w = scale * u + bias per group of 32, u
    unsigned, `bits` per value packed into uint32 words low bits first): q4 and q5 are ours as they
    are (scale, min); q4k and q5k take each sub-block's scale d sc and bias -dmin m (float32:
    exact); int8's signed q becomes u = q + 128 with bias -128 scale."""

    wq: mx.array  # uint32 [out, in * bits / 32]
    scales: mx.array  # [out, in / 32]
    biases: mx.array  # [out, in / 32]
    bits: int

    @classmethod
    def of(cls, p: formats.Packed, dtype: mx.Dtype) -> Packed:
        bits = {"q4": 4, "q5": 5, "q4k": 4, "q5k": 5}.get(p.fmt, 8)
        u = formats.levels(p).astype(np.uint32) + (128 if p.fmt == "int8" else 0)  # [out, in]
        stream = (u[..., None] >> np.arange(bits, dtype=np.uint32)) & 1  # [out, in, bits]: a bit stream
        packed = np.packbits(stream.astype(np.uint8).reshape(u.shape[0], -1), axis=1, bitorder="little")
        words = np.ascontiguousarray(packed).view(
            "<u4"
        )  # [out, in * bits / 32], value i at bits 5 i.. for q5
        if p.fmt in ("q4k", "q5k"):
            scales, minimums = formats.k_scales(p)  # [out, in / 32] each
            biases = -minimums
        else:
            scales = p.scales.astype(np.float32)
            biases = p.mins.astype(np.float32) if p.mins is not None else -128 * scales
        return cls(mx.array(words), mx.array(scales).astype(dtype), mx.array(biases).astype(dtype), bits)

    def __call__(self, x: mx.array) -> mx.array:  # [N, in] -> [N, out]
        return mx.quantized_matmul(
            x, self.wq, self.scales, self.biases, transpose=True, group_size=GROUP, bits=self.bits
        )

    def rows(self, ids: mx.array) -> mx.array:
        """Rows `ids` dequantized ([N, in]): an embedding lookup."""
        return mx.dequantize(
            self.wq[ids], self.scales[ids], self.biases[ids], group_size=GROUP, bits=self.bits
        )


@dataclass
class Stacked:
    """Packed matrices of different formats stacked by rows (a GGUF's fused product whose
    matrices' types differ): each part's product, concatenated."""

    parts: list[Packed]

    def __call__(self, x: mx.array) -> mx.array:  # [N, in] -> [N, out]
        return mx.concatenate([p(x) for p in self.parts], axis=-1)


Weight = mx.array | Packed | Stacked


def _mm(x: mx.array, w: Weight) -> mx.array:
    """x [N, in] w^T -> [N, out] for a float or packed weight."""
    return w(x) if isinstance(w, Packed | Stacked) else x @ w.T


@dataclass
class Block:
    attn_norm: mx.array  # [H]
    wqkv: Weight  # [(nq + 2 nkv) d, H]: q rows, then k, then v
    bqkv: mx.array | None  # [(nq + 2 nkv) d]
    qk_norm: mx.array | None  # [nq + nkv, d]: q_norm per q head, then k_norm per kv head (qwen3)
    wo: Weight  # [H, nq d]
    mlp_norm: mx.array  # [H]
    w_gate_up: Weight  # [2F, H]
    w_down: Weight  # [H, F]


@dataclass
class KVCache:
    """Preallocated keys and values: per local block [slots, nkv, context, d]."""

    k: list[mx.array]
    v: list[mx.array]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.k + self.v)


class LlamaModel:
    """Blocks [a, b) of a Llama-family model, plus the head when `head` is set (see the torch twin)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, mx.array],
        blocks: range,
        head: bool,
        *,
        dtype: mx.Dtype = mx.float32,
        context: int = 2048,
        quant: str = "none",
        reuse: LlamaModel | None = None,
    ) -> None:
        if quant not in QUANT_FORMATS:
            raise ValueError(f"unknown weight format {quant!r}; choose one of {', '.join(QUANT_FORMATS)}")
        self.config, self.blocks_range, self.has_head = config, blocks, head
        self.dtype, self.context, self.quant = dtype, context, quant
        if reuse is not None and (reuse.dtype, reuse.quant) != (dtype, quant):
            raise ValueError(
                f"cannot reuse blocks held as {reuse.dtype} {reuse.quant} for a model in {dtype} {quant}"
            )
        self.requantized: list[str] = []  # q6k matrices held as int8 (`_packed`)
        self.embed_w: Weight | None = None
        self.unembed_w: Weight | None = None
        self.norm_w: mx.array | None = None
        if head and reuse is not None and reuse.has_head:  # the head it holds, as it is in memory
            self.embed_w, self.unembed_w, self.norm_w = reuse.embed_w, reuse.unembed_w, reuse.norm_w
        elif head:  # first: the largest tensors load while little else is resident (lower peak memory)
            self.embed_w = self._cat(weights, [EMBED])  # [V, H]
            self.norm_w = self._w(weights, FINAL_NORM)  # [H]
            tied = config.tie_word_embeddings or LM_HEAD not in weights
            self.unembed_w = self.embed_w if tied else self._cat(weights, [LM_HEAD])  # [V, H]
        # `reuse`'s blocks this range keeps move over (no read); the others load from `weights`
        held: dict[int, Block] = dict(zip(reuse.blocks_range, reuse.blocks, strict=True)) if reuse else {}
        self.blocks: list[Block] = [held[i] if i in held else self._load_block(weights, i) for i in blocks]
        cos, sin = rope.tables(config, context)
        self.cos, self.sin = mx.array(cos).astype(dtype), mx.array(sin).astype(dtype)  # [context, d]
        mx.eval([self.cos, self.sin, *(_arrays(vars(b)) for b in self.blocks), *_arrays(vars(self))])
        if self.requantized:
            log.info("q6k matrices requantized to int8 for MLX", matrices=len(self.requantized))

    def _w(self, weights: Mapping[str, mx.array], name: str) -> mx.array:
        return weights[name].astype(self.dtype)

    def _cat(self, weights: Mapping[str, mx.array], names: Sequence[str]) -> Weight:
        """The named matrices stacked by rows: floats in the compute dtype for "none" (packed ones
        widened), else packed (float ones packed as the torch model packs them)."""
        stored = [n.removesuffix("weight") + SCALES in weights for n in names]
        if self.quant == "none" or (not any(stored) and linear_format(names[0], self.quant) == "none"):
            if any(stored):
                wide = [formats.dequantize(self._stored(weights, n)) for n in names]
                return mx.concatenate([mx.array(w).astype(self.dtype) for w in wide], axis=0)
            return self._floats(weights, names)
        parts = [self._packed(weights, n) for n in names]
        runs: list[list[formats.Packed]] = []  # parts of one format stack into one matrix
        for part in parts:
            if runs and runs[-1][0].fmt == part.fmt:
                runs[-1].append(part)
            else:
                runs.append([part])
        stacked = [Packed.of(formats.stacked(run), self.dtype) for run in runs]
        return stacked[0] if len(stacked) == 1 else Stacked(stacked)

    def _floats(self, weights: Mapping[str, mx.array], names: Sequence[str]) -> mx.array:
        return mx.concatenate([self._w(weights, n) for n in names], axis=0)

    def _stored(self, weights: Mapping[str, mx.array], name: str) -> formats.Packed:
        """Packed matrix `name` as the checkpoint stores it."""
        base = name.removesuffix("weight")
        mins, high = (np.array(weights[base + n]) if base + n in weights else None for n in (MINS, HIGH))
        data, scales = np.array(weights[name]), np.array(weights[base + SCALES])
        return formats.from_entries(formats.format_of(data, scales, mins, high), data, scales, mins, high)

    def _packed(self, weights: Mapping[str, mx.array], name: str) -> formats.Packed:
        """Matrix `name` packed as MLX holds it: as stored, except q6k (a scale per 16 inputs, where
        MLX's affine layout has one per 32 or more), requantized to int8 from its exact values;
        a float one packed in the session's format."""
        if name.removesuffix("weight") + SCALES in weights:
            p = self._stored(weights, name)
            if p.fmt == "q6k":
                self.requantized.append(name)
                return formats.quantize(formats.dequantize(p), "int8")
            return p
        w = np.array(weights[name].astype(mx.float32))
        return formats.quantize(w, linear_format(name, self.quant))

    def _load_block(self, w: Mapping[str, mx.array], i: int) -> Block:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qk_norm = None
        if self.config.qk_norm:
            nq, nkv = self.config.num_attention_heads, self.config.num_key_value_heads
            q_n, k_n = self._w(w, a + "q_norm.weight"), self._w(w, a + "k_norm.weight")  # [d]
            qk_norm = mx.concatenate(
                [mx.broadcast_to(q_n, (nq, q_n.shape[0])), mx.broadcast_to(k_n, (nkv, k_n.shape[0]))]
            )
        return Block(
            attn_norm=self._w(w, p + "input_layernorm.weight"),
            wqkv=self._cat(w, [a + f"{n}_proj.weight" for n in "qkv"]),
            bqkv=self._floats(w, [a + f"{n}_proj.bias" for n in "qkv"])
            if self.config.attention_bias
            else None,
            qk_norm=qk_norm,
            wo=self._cat(w, [a + "o_proj.weight"]),
            mlp_norm=self._w(w, p + "post_attention_layernorm.weight"),
            w_gate_up=self._cat(w, [m + "gate_proj.weight", m + "up_proj.weight"]),
            w_down=self._cat(w, [m + "down_proj.weight"]),
        )

    def new_cache(self, slots: int) -> KVCache:
        c = self.config
        shape = (slots, c.num_key_value_heads, self.context, c.head_dim)
        cache = KVCache(
            [mx.zeros(shape, self.dtype) for _ in self.blocks],
            [mx.zeros(shape, self.dtype) for _ in self.blocks],
        )
        mx.eval(cache.k, cache.v)
        return cache

    def embed(self, ids: mx.array) -> mx.array:
        """ids [N] int -> hidden [N, H]."""
        assert self.embed_w is not None and not isinstance(self.embed_w, Stacked), "embed() needs the head"
        out = (
            self.embed_w.rows(ids).astype(self.dtype)
            if isinstance(self.embed_w, Packed)
            else self.embed_w[ids]
        )
        mx.eval(out)
        return out

    def logits(self, x: mx.array) -> mx.array:
        """hidden [B, H] -> logits [B, V] float32 (final norm + unembedding)."""
        assert self.unembed_w is not None, "logits() needs the head"
        h = mx.fast.rms_norm(x.astype(self.dtype), self.norm_w, self.config.rms_norm_eps)
        out = _mm(h, self.unembed_w).astype(mx.float32)
        mx.eval(out)
        return out

    def forward(self, x: mx.array, spans: Sequence[Span], cache: KVCache) -> mx.array:
        """hidden [N, H] (spans' rows stacked in order) -> hidden [N, H] after every local block."""
        x = x.astype(self.dtype)
        pos = mx.array([s.start + t for s in spans for t in range(s.length)])  # [N]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]  # [N, 1, d]
        masks = [_causal_mask(s) for s in spans]
        for i, blk in enumerate(self.blocks):
            x = self._block(blk, x, cos, sin, spans, masks, cache, i)
        mx.eval(x, cache.k, cache.v)
        return x

    def _block(
        self,
        blk: Block,
        x: mx.array,
        cos: mx.array,
        sin: mx.array,
        spans: Sequence[Span],
        masks: list[mx.array | None],
        cache: KVCache,
        i: int,
    ) -> mx.array:
        c, eps = self.config, self.config.rms_norm_eps
        n, nq, nkv, d = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        qkv = _mm(mx.fast.rms_norm(x, blk.attn_norm, eps), blk.wqkv)  # [N, (nq + 2 nkv) d]
        if blk.bqkv is not None:
            qkv = qkv + blk.bqkv
        qk = qkv[:, : (nq + nkv) * d].reshape(n, nq + nkv, d)  # [N, nq + nkv, d]
        if blk.qk_norm is not None:
            qk = mx.fast.rms_norm(qk, None, eps) * blk.qk_norm
        qk = qk * cos + mx.roll(qk, d // 2, -1) * sin  # rotate-half RoPE
        v = qkv[:, (nq + nkv) * d :].reshape(n, nkv, d)  # [N, nkv, d]
        outs, row = [], 0
        for s, mask in zip(spans, masks, strict=True):
            rows = slice(row, row + s.length)
            outs.append(self._attend(s, mask, qk[rows, :nq], qk[rows, nq:], v[rows], cache, i))
            row += s.length
        attn = mx.concatenate(outs) if len(outs) > 1 else outs[0]  # [N, nq d]
        x = x + _mm(attn, blk.wo)
        gate, up = mx.split(_mm(mx.fast.rms_norm(x, blk.mlp_norm, eps), blk.w_gate_up), 2, axis=-1)  # [N, F]
        return x + _mm(gate * mx.sigmoid(gate) * up, blk.w_down)

    def _attend(
        self, s: Span, mask: mx.array | None, q: mx.array, k: mx.array, v: mx.array, cache: KVCache, i: int
    ) -> mx.array:
        """One request: q [T, nq, d], k/v [T, nkv, d] -> [T, nq d] (GQA handled by MLX's SDPA)."""
        t, nq, d = q.shape
        cache.k[i][s.slot, :, s.start : s.end] = k.transpose(1, 0, 2)  # [nkv, T, d]
        cache.v[i][s.slot, :, s.start : s.end] = v.transpose(1, 0, 2)
        keys = cache.k[i][s.slot, :, : s.end][None]  # [1, nkv, L, d]
        vals = cache.v[i][s.slot, :, : s.end][None]
        out = mx.fast.scaled_dot_product_attention(
            q.transpose(1, 0, 2)[None], keys, vals, scale=d**-0.5, mask=mask
        )  # [1, nq, T, d]
        return out[0].transpose(1, 0, 2).reshape(t, nq * d)


def _arrays(fields: dict[str, object]) -> list[mx.array]:
    """Every array among `fields`' values, packed weights' parts included (for one mx.eval)."""
    out: list[mx.array] = []
    for v in fields.values():
        packed = v.parts if isinstance(v, Stacked) else [v] if isinstance(v, Packed) else []
        for p in packed:
            out += [p.wq, p.scales, p.biases]
        if isinstance(v, mx.array):
            out.append(v)
    return out


def _causal_mask(s: Span) -> mx.array | None:
    """[T, L] boolean: query t (position start + t) sees keys 0..start + t; None for one row."""
    if s.length == 1:
        return None
    keys = mx.arange(s.end)
    return keys[None, :] <= mx.arange(s.start, s.end)[:, None]
