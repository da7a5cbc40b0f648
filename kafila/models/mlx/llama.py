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

from kafila.models import rope
from kafila.models.config import ModelConfig
from kafila.models.manifest import EMBED, FINAL_NORM, LM_HEAD
from kafila.models.span import Span


@dataclass
class Block:
    attn_norm: mx.array  # [H]
    wqkv: mx.array  # [(nq + 2 nkv) d, H]: q rows, then k, then v
    bqkv: mx.array | None  # [(nq + 2 nkv) d]
    qk_norm: mx.array | None  # [nq + nkv, d]: q_norm per q head, then k_norm per kv head (qwen3)
    wo: mx.array  # [H, nq d]
    mlp_norm: mx.array  # [H]
    w_gate_up: mx.array  # [2F, H]
    w_down: mx.array  # [H, F]


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
    ) -> None:
        self.config, self.blocks_range, self.has_head = config, blocks, head
        self.dtype, self.context = dtype, context
        self.embed_w = self.norm_w = self.unembed_w = None
        if head:  # first: the largest tensors load while little else is resident (lower peak memory)
            self.embed_w = self._w(weights, EMBED)  # [V, H]
            self.norm_w = self._w(weights, FINAL_NORM)  # [H]
            tied = config.tie_word_embeddings or LM_HEAD not in weights
            self.unembed_w = self.embed_w if tied else self._w(weights, LM_HEAD)  # [V, H]
        self.blocks = [self._load_block(weights, i) for i in blocks]
        cos, sin = rope.tables(config, context)
        self.cos, self.sin = mx.array(cos).astype(dtype), mx.array(sin).astype(dtype)  # [context, d]
        mx.eval([self.cos, self.sin, *(vars(b) for b in self.blocks), self.embed_w, self.unembed_w])

    def _w(self, weights: Mapping[str, mx.array], name: str) -> mx.array:
        return weights[name].astype(self.dtype)

    def _cat(self, weights: Mapping[str, mx.array], names: Sequence[str]) -> mx.array:
        return mx.concatenate([self._w(weights, n) for n in names], axis=0)

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
            bqkv=self._cat(w, [a + f"{n}_proj.bias" for n in "qkv"]) if self.config.attention_bias else None,
            qk_norm=qk_norm,
            wo=self._w(w, a + "o_proj.weight"),
            mlp_norm=self._w(w, p + "post_attention_layernorm.weight"),
            w_gate_up=self._cat(w, [m + "gate_proj.weight", m + "up_proj.weight"]),
            w_down=self._w(w, m + "down_proj.weight"),
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
        assert self.embed_w is not None, "embed() needs the head"
        out = self.embed_w[ids]
        mx.eval(out)
        return out

    def logits(self, x: mx.array) -> mx.array:
        """hidden [B, H] -> logits [B, V] float32 (final norm + unembedding)."""
        assert self.unembed_w is not None, "logits() needs the head"
        h = mx.fast.rms_norm(x.astype(self.dtype), self.norm_w, self.config.rms_norm_eps)
        out = (h @ self.unembed_w.T).astype(mx.float32)
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
        qkv = mx.fast.rms_norm(x, blk.attn_norm, eps) @ blk.wqkv.T  # [N, (nq + 2 nkv) d]
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
        x = x + attn @ blk.wo.T
        gate, up = mx.split(mx.fast.rms_norm(x, blk.mlp_norm, eps) @ blk.w_gate_up.T, 2, axis=-1)  # [N, F]
        return x + (gate * mx.sigmoid(gate) * up) @ blk.w_down.T

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


def _causal_mask(s: Span) -> mx.array | None:
    """[T, L] boolean: query t (position start + t) sees keys 0..start + t; None for one row."""
    if s.length == 1:
        return None
    keys = mx.arange(s.end)
    return keys[None, :] <= mx.arange(s.start, s.end)[:, None]
