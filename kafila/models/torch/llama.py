"""Llama (SmolLM2, Llama 2 and 3) in torch: the embedding, a contiguous range of blocks, the head.

Hugging Face weight names, rotate-half RoPE (see kafila.models.rope), no permutations. At load the
q/k/v rows are fused into one `wqkv` and gate/up into one `w_gate_up`, so a block is four matmuls.
On the CPU in fp32 and bf16, decode steps and prompts' first prefill chunks run each block as one
compiled call (`decode_cpu`; up to `KERNEL_ROWS` and `FUSED_PREFILL_ROWS` rows), and the products
of later prefill chunks go through the kernel in `few_rows` (up to `KERNEL_ROWS` rows);
larger fp32 steps, other dtypes and other devices go through torch's ops. Weights keep the Hugging
Face [out, in] layout for all of them.
The model knows nothing about networks or requests: `forward` takes the hidden rows of several
requests stacked together and, for each, its KV-cache slot and first position (`Span`).

Shapes: N = rows in a step (all requests' tokens), H = hidden, d = head_dim, nq/nkv = query/KV
heads, g = nq / nkv, L = keys attended, F = intermediate, V = vocab.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
import torch.nn.functional as F

from kafila.models import quant as formats
from kafila.models import rope
from kafila.models.config import ModelConfig
from kafila.models.manifest import (
    EMBED,
    FINAL_NORM,
    HIGH,
    LM_HEAD,
    MINS,
    QUANT_FORMATS,
    SCALES,
    keeps_floats,
    linear_format,
)
from kafila.models.span import Span
from kafila.models.torch import hugepages, packed
from kafila.models.torch.packed import PackedLinear, StackedLinear

Tensor = torch.Tensor


# Products of at most this many rows go through few_rows' kernel, and decode steps of at most this
# many rows through decode_cpu (CPU; None: any number), so their rows stay independent. Measured
# with the weights read from memory, as in a prefill (benchmarks/products.py, docs/engine.md): in
# fp32 the kernel is 1.2-2.9x faster than torch up to 96 rows on one or two threads, 1.00-1.15x at
# 128, and even or slower from 160 on; in bf16 it is 4.4-4.8x faster from 19 rows to 256 (torch
# widens bf16 slowly here).
KERNEL_ROWS: dict[torch.dtype, int | None] = {torch.float32: 128, torch.bfloat16: None}
# A prompt's first prefill chunk (every span of the step from position 0) of at most this many rows
# also runs each block as one compiled call (decode_cpu.block_step, one row per position: it writes
# the step's keys first, so each row attends to the rows before it), where the torch ops cost their
# dispatch per op: 19-128 rows through 13 blocks of the default model in 0.77-0.81x the time (one
# thread, docs/engine.md). Later chunks stay on torch: block_step attends row by row over every
# cached key, and at a chunk's later positions that would cost more than SDPA saves the dispatch.
FUSED_PREFILL_ROWS = 128


def _kernels_take(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the CPU kernels (few_rows, decode_cpu) take this dtype on this device: fp32 or bf16
    on the CPU, with numba installed."""
    return dtype in (torch.float32, torch.bfloat16) and device.type == "cpu" and packed.kernels_available()


def _kernel_dtype(t: Tensor) -> bool:
    return _kernels_take(t.dtype, t.device)


def _too_many(rows: int, dtype: torch.dtype) -> bool:
    """Whether a product or decode step of `rows` rows in `dtype` is past KERNEL_ROWS (torch takes it)."""
    limit = KERNEL_ROWS.get(dtype)
    return limit is not None and rows > limit


class Attention(Protocol):
    """What `LlamaModel._block` attends with: `_AttentionPlan`, or static_decode's for captured steps."""

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor) -> Tensor: ...


@dataclass
class Linear:
    """y = x W^T + b for a weight W [out, in]."""

    w: Tensor  # [out, in]
    bias: Tensor | None = None  # [out]

    def __call__(self, x: Tensor) -> Tensor:  # [N, in] -> [N, out]
        if not (_kernel_dtype(x) and _kernel_dtype(self.w)) or _too_many(x.shape[0], self.w.dtype):
            return F.linear(x, self.w, self.bias)
        from kafila.models.torch import few_rows  # numba loads only where its kernels run

        y = few_rows.linear(x, self.w)
        return y if self.bias is None else y.add_(self.bias)


AnyLinear = Linear | PackedLinear | StackedLinear


def _kernel_arrays(lin: AnyLinear) -> np.ndarray | tuple[Any, ...]:
    """A weight as decode_cpu.block_step takes it: a float view, or a packed tuple (quant_cpu)."""
    from kafila.models.torch.few_rows import numpy_view

    return lin.arrays() if isinstance(lin, PackedLinear | StackedLinear) else numpy_view(lin.w)


@dataclass
class Block:
    attn_norm: Tensor  # [H]
    wqkv: AnyLinear  # [(nq + 2 nkv) d, H]: q rows, then k, then v
    qk_norm: Tensor | None  # [nq + nkv, d]: q_norm per q head, then k_norm per kv head (qwen3)
    wo: AnyLinear  # [H, nq d]
    mlp_norm: Tensor  # [H]
    w_gate_up: AnyLinear  # [2F, H]: gate rows, then up
    w_down: AnyLinear  # [H, F]

    def arrays(self) -> tuple[Any, ...]:
        """The weights in `decode_cpu.block_step`'s order: matrices as views (float32, or bf16 bits,
        or packed tuples), norms and biases as float32."""

        def f32(t: Tensor | None, empty: tuple[int, ...]) -> np.ndarray:
            return np.empty(empty, np.float32) if t is None else t.float().contiguous().numpy()

        return (
            f32(self.attn_norm, (0,)),
            _kernel_arrays(self.wqkv),
            f32(self.wqkv.bias, (0,)),
            f32(self.qk_norm, (0, 0)),
            _kernel_arrays(self.wo),
            f32(self.mlp_norm, (0,)),
            _kernel_arrays(self.w_gate_up),
            _kernel_arrays(self.w_down),
        )


@dataclass
class KVCache:
    """Preallocated keys and values: per local block [slots, nkv, context, d]."""

    k: list[Tensor]
    v: list[Tensor]
    _views: list[tuple[np.ndarray, np.ndarray]] | None = field(default=None, repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def numpy_views(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """Per block (keys, values) as numpy views for decode_cpu (made once: the tensors never move)."""
        if self._views is None:
            from kafila.models.torch.few_rows import numpy_view

            self._views = [(numpy_view(k), numpy_view(v)) for k, v in zip(self.k, self.v, strict=True)]
        return self._views


class LlamaModel:
    """Blocks [a, b) of a Llama-family model, plus the head (embedding, final norm, unembedding)
    when `head` is set. `weights` maps Hugging Face names to tensors (any float dtype, or a packed
    matrix's entries: `X.weight` int8/uint8 with `X.scales` (and `X.mins`), kafila.models.quant).
    `quant` is the session's weight format: "none" computes with float matrices (widening packed
    ones), "int8"/"q4" packs float matrices as kafila.models.manifest's policy says and keeps
    packed ones as stored. `reuse`: a model of the same config, dtype, device and format whose
    blocks (and head) in this range are taken as they are in memory, not read (Stage.rebuild)."""

    def __init__(
        self,
        config: ModelConfig,
        weights: Mapping[str, Tensor],
        blocks: range,
        head: bool,
        *,
        dtype: torch.dtype = torch.float32,
        device: str = "cpu",
        context: int = 2048,
        quant: str = "none",
        reuse: LlamaModel | None = None,
    ) -> None:
        if quant not in QUANT_FORMATS:
            raise ValueError(f"unknown weight format {quant!r}; choose one of {', '.join(QUANT_FORMATS)}")
        self.config, self.blocks_range, self.has_head = config, blocks, head
        self.dtype, self.device, self.context, self.quant = dtype, torch.device(device), context, quant
        if reuse is not None and (reuse.dtype, reuse.device, reuse.quant) != (dtype, self.device, quant):
            raise ValueError(
                f"cannot reuse blocks held as {reuse.dtype} {reuse.quant} on {reuse.device} "
                f"for a model in {dtype} {quant} on {self.device}"
            )
        self.embed_w: Tensor | PackedLinear | None = None  # [V, H]
        self.norm_w: Tensor | None = None
        self.unembed: AnyLinear | None = None
        self._pages = hugepages.for_device(self.device)  # the weight matrices' memory, where offered
        if head and reuse is not None and reuse.has_head:  # the head it holds, as it is in memory
            self.embed_w, self.unembed, self.norm_w = reuse.embed_w, reuse.unembed, reuse.norm_w
        elif head:  # first: the largest tensors load while little else is resident (lower peak memory)
            tied = config.tie_word_embeddings or LM_HEAD not in weights
            embed = self._linear(weights, [EMBED])  # one matrix: never a StackedLinear
            assert not isinstance(embed, StackedLinear)
            self.embed_w = embed.w if isinstance(embed, Linear) else embed
            self.unembed = embed if tied else self._linear(weights, [LM_HEAD])  # [V, H]
            if isinstance(self.unembed, PackedLinear):  # int8 in both formats: integer products (INT_DOT)
                self.unembed.round_x = True
            self.norm_w = self._w(weights, FINAL_NORM)  # [H]
        # `reuse`'s blocks this range keeps move over (no read); the others load from `weights`
        held: dict[int, Block] = dict(zip(reuse.blocks_range, reuse.blocks, strict=True)) if reuse else {}
        self.blocks: list[Block] = [held[i] if i in held else self._load_block(weights, i) for i in blocks]
        cos, sin = rope.tables(config, context)
        self.cos = torch.from_numpy(cos).to(self.device, dtype)  # [context, d]
        self.sin = torch.from_numpy(sin).to(self.device, dtype)  # [context, d], sign folded in
        self._rope32 = (cos, sin)  # float32 numpy, for decode_cpu
        # decode steps in fp32 and bf16 on the CPU run each block as one compiled call (decode_cpu)
        self.fused_decode = _kernels_take(dtype, self.device)
        self._arrays = [b.arrays() for b in self.blocks] if self.fused_decode else []
        if self.fused_decode:
            from kafila.models.torch import decode_cpu  # numba loads only where its kernels run

            self._block_step = decode_cpu.block_step

    @property
    def batch_rows(self) -> int | None:
        """Most rows one step may hold with every row's result the same bits as alone: on the CPU
        the fewer of the few-row kernel's `KERNEL_ROWS` for this dtype and FUSED_PREFILL_ROWS (a
        first chunk past it takes the torch ops). None: no bound below a chunk (no kernel runs here,
        and torch's products promise nothing either way)."""
        if not _kernels_take(self.dtype, self.device):
            return None
        return min(KERNEL_ROWS.get(self.dtype) or FUSED_PREFILL_ROWS, FUSED_PREFILL_ROWS)

    def prefill_path(self, starts: Sequence[int]) -> str:
        """The code a prefill step whose chunks begin at positions `starts` runs (within
        `batch_rows` rows): "fused" when they are all first chunks and the kernels run here, else
        "ops". The two round differently, so chunks share a step only where they take the same path
        alone (kafila.session.ring.schedule)."""
        return "fused" if self.fused_decode and all(p == 0 for p in starts) else "ops"

    # -- loading ---------------------------------------------------------------------------------

    def _w(self, weights: Mapping[str, Tensor], name: str) -> Tensor:
        return weights[name].to(self.device, self.dtype)

    def _stack(self, weights: Mapping[str, Tensor], names: Sequence[str]) -> Tensor:
        """The named weights ([out_i, in] matrices, or [out_i] biases) stacked by rows in this
        model's dtype and device, each converted as it is copied in (exact for a widening, to
        nearest for a narrowing, as `.to()`): on the CPU into memory on huge pages where the
        system offers them (hugepages), so a weight is never held twice."""
        parts = [weights[n] for n in names]  # the checkpoint's reads
        if self._pages is None and len(parts) == 1:
            return parts[0].to(self.device, self.dtype)  # no copy where dtype and device already match
        shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
        if self._pages is None:
            out = torch.empty(shape, dtype=self.dtype, device=self.device)
        else:
            out = self._pages.empty(shape, self.dtype)
        at = 0
        for p in parts:
            out[at : at + p.shape[0]].copy_(p)
            at += p.shape[0]
        return out

    def _linear(
        self, weights: Mapping[str, Tensor], names: Sequence[str], bias: Tensor | None = None
    ) -> AnyLinear:
        """The named matrices stacked by rows as one product in the session's format: float
        (`_stack`, packed ones widened) for "none", else packed (float ones packed here, except in
        a packed checkpoint, which keeps its float matrices as stored: `keeps_floats`)."""
        stored = [n.removesuffix("weight") + SCALES in weights for n in names]
        kept = keeps_floats(self.config) or linear_format(names[0], self.quant) == "none"
        if self.quant == "none" or (not any(stored) and kept):
            if any(stored):
                wide = {n: self._packed(weights, n).dequantized(slice(None), torch.float32) for n in names}
                return Linear(self._stack(wide, names), bias)
            return Linear(self._stack(weights, names), bias)
        parts = [self._packed(weights, n) for n in names]
        out = PackedLinear.stack(parts)
        out.bias = bias
        return out

    def _packed(self, weights: Mapping[str, Tensor], name: str) -> PackedLinear:
        """Matrix `name` packed: as stored, or a float one packed in its format (on the CPU)."""
        base = name.removesuffix("weight")
        if base + SCALES in weights:
            mins, high = (
                weights[base + n].to(self.device) if base + n in weights else None for n in (MINS, HIGH)
            )
            data, scales = weights[name].to(self.device), weights[base + SCALES].to(self.device)
            return PackedLinear.of_entries(data, scales, mins, high)
        t = weights[name].cpu()  # [out, in]; bf16 as its bits, widened chunk by chunk by quantize
        w = t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.float().numpy()
        return PackedLinear.from_packed(formats.quantize(w, linear_format(name, self.quant)), self.device)

    def _load_block(self, w: Mapping[str, Tensor], i: int) -> Block:
        p = f"model.layers.{i}."
        a, m = p + "self_attn.", p + "mlp."
        qk_norm = None
        if self.config.qk_norm:
            nq, nkv = self.config.num_attention_heads, self.config.num_key_value_heads
            q_n, k_n = self._w(w, a + "q_norm.weight"), self._w(w, a + "k_norm.weight")  # [d]
            qk_norm = torch.cat([q_n.expand(nq, -1), k_n.expand(nkv, -1)]).contiguous()  # [nq+nkv, d]
        bias = [a + f"{n}_proj.bias" for n in "qkv"]
        bqkv = self._stack(w, bias) if self.config.attention_bias else None
        return Block(
            attn_norm=self._w(w, p + "input_layernorm.weight"),
            wqkv=self._linear(w, [a + f"{n}_proj.weight" for n in "qkv"], bqkv),
            qk_norm=qk_norm,
            wo=self._linear(w, [a + "o_proj.weight"]),
            mlp_norm=self._w(w, p + "post_attention_layernorm.weight"),
            w_gate_up=self._linear(w, [m + "gate_proj.weight", m + "up_proj.weight"]),
            w_down=self._linear(w, [m + "down_proj.weight"]),
        )

    def new_cache(self, slots: int) -> KVCache:
        c = self.config
        shape = (slots, c.num_key_value_heads, self.context, c.head_dim)
        k = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.blocks]
        v = [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in self.blocks]
        return KVCache(k, v)

    # -- compute ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def embed(self, ids: Tensor) -> Tensor:
        """ids [N] int64 -> hidden [N, H]."""
        assert self.embed_w is not None, "embed() needs the head"
        if isinstance(self.embed_w, PackedLinear):
            return self.embed_w.embedding(ids.to(self.device), self.dtype)
        return F.embedding(ids.to(self.device), self.embed_w)

    @torch.inference_mode()
    def logits(self, x: Tensor) -> Tensor:
        """hidden [B, H] -> logits [B, V] float32 (final norm + unembedding)."""
        assert self.unembed is not None and self.norm_w is not None, "logits() needs the head"
        h = F.rms_norm(x, (x.shape[-1],), self.norm_w, self.config.rms_norm_eps)
        return self.unembed(h).float()

    @torch.inference_mode()
    def forward(self, x: Tensor, spans: Sequence[Span], cache: KVCache) -> Tensor:
        """hidden [N, H] (spans' rows stacked in order) -> hidden [N, H] after every local block."""
        x = x.to(self.device, self.dtype, copy=True)  # [N, H], updated in place below
        if self.fused_decode and not _too_many(len(spans), self.dtype) and all(s.length == 1 for s in spans):
            self._decode_fused(x, spans, cache)
            return x
        if self._fused_prefill(spans):  # one span per row: block_step takes rows at any positions
            self._decode_fused(
                x, [Span(s.slot, s.start + t, 1) for s in spans for t in range(s.length)], cache
            )
            return x
        plan = _AttentionPlan(spans, self.device)
        if len(spans) == 1:  # one request: its positions are a slice, no gather
            rows = slice(spans[0].start, spans[0].end)
            cos, sin = self.cos[rows, None], self.sin[rows, None]  # [N, 1, d]
        else:
            cos, sin = self.cos[plan.positions, None], self.sin[plan.positions, None]
        for blk, k_cache, v_cache in zip(self.blocks, cache.k, cache.v, strict=True):
            self._block(blk, x, cos, sin, plan, k_cache, v_cache)
        return x

    def _fused_prefill(self, spans: Sequence[Span]) -> bool:
        rows = sum(s.length for s in spans)
        return self.prefill_path([s.start for s in spans]) == "fused" and rows <= FUSED_PREFILL_ROWS

    def _decode_fused(self, x: Tensor, spans: Sequence[Span], cache: KVCache) -> None:
        """One row per span (decode), every local block through decode_cpu.block_step, in place on x."""
        bf16 = self.dtype == torch.bfloat16
        xf = x.float() if bf16 else x  # [N, H] float32 (shares x's memory in fp32)
        slots = np.array([s.slot for s in spans], dtype=np.int64)  # [N]
        positions = np.array([s.start for s in spans], dtype=np.int64)  # [N]
        cos, sin = self._rope32  # [context, d]
        nq, eps = self.config.num_attention_heads, self.config.rms_norm_eps
        xn = xf.numpy()
        for arrays, kv in zip(self._arrays, cache.numpy_views(), strict=True):
            self._block_step(xn, *arrays, *kv, cos, sin, slots, positions, nq, eps, bf16)
        if bf16:
            x.copy_(xf)  # exact: every block rounded the rows to bf16 values

    def _block(
        self, blk: Block, x: Tensor, cos: Tensor, sin: Tensor, plan: Attention, kc: Tensor, vc: Tensor
    ) -> None:
        c, eps = self.config, self.config.rms_norm_eps
        n, nq, nkv, d = x.shape[0], c.num_attention_heads, c.num_key_value_heads, c.head_dim
        h = F.rms_norm(x, (x.shape[-1],), blk.attn_norm, eps)  # [N, H]
        qkv = blk.wqkv(h)  # [N, (nq + 2 nkv) d]
        qk = qkv[:, : (nq + nkv) * d].view(n, nq + nkv, d)  # [N, nq + nkv, d]
        if blk.qk_norm is not None:
            qk = F.rms_norm(qk, (d,), None, eps) * blk.qk_norm
        qk = torch.addcmul(qk * cos, qk.roll(d // 2, dims=-1), sin)  # rotate-half RoPE, [N, nq + nkv, d]
        v = qkv[:, (nq + nkv) * d :].view(n, nkv, d)  # [N, nkv, d]
        attn = plan.attend(qk[:, :nq], qk[:, nq:], v, kc, vc)  # [N, nq d]
        x += blk.wo(attn)  # [N, H]
        h = F.rms_norm(x, (x.shape[-1],), blk.mlp_norm, eps)
        gate, up = blk.w_gate_up(h).chunk(2, dim=-1)  # [N, F] each
        x += blk.w_down(F.silu(gate).mul_(up))  # [N, H]


class _AttentionPlan:
    """Per-step indexing shared by every block: positions, slots, masks (built once per step).

    Grouped-query attention without repeating K/V: the g query heads sharing a KV head are folded
    into the query-length axis ([nkv, g*T, d] against [nkv, L, d]), so SDPA sees plain MHA."""

    def __init__(self, spans: Sequence[Span], device: torch.device) -> None:
        self.spans = list(spans)
        self.decode_batch = len(spans) > 1 and all(s.length == 1 for s in spans)
        pos = [s.start + t for s in spans for t in range(s.length)]
        self.positions = torch.tensor(pos, dtype=torch.long, device=device)  # [N]
        self.masks = [None if s.length == 1 else _causal_mask(s, device) for s in spans]
        if self.decode_batch:
            self.slots = torch.tensor([s.slot for s in spans], dtype=torch.long, device=device)  # [B]
            keys = torch.arange(max(pos) + 1, device=device)
            visible = (keys[None, :] <= self.positions[:, None])[:, None, None, :]  # [B, 1, 1, L]
            self.batch_bias = torch.zeros(visible.shape, device=device).masked_fill_(~visible, float("-inf"))

    def attend(self, q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
        """q [N, nq, d], k/v [N, nkv, d] -> [N, nq d]; writes k/v into the caches first."""
        if self.decode_batch:
            return self._decode_batch(q, k, v, kc, vc)
        if len(self.spans) == 1:
            return _attend_span(self.spans[0], self.masks[0], q, k, v, kc, vc)
        out, row = [], 0
        for s, mask in zip(self.spans, self.masks, strict=True):
            rows = slice(row, row + s.length)
            out.append(_attend_span(s, mask, q[rows], k[rows], v[rows], kc, vc))
            row += s.length
        return torch.cat(out)

    def _decode_batch(self, q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor) -> Tensor:
        """B requests, one row each, at different positions: one SDPA with a length mask."""
        b, nq, d = q.shape
        nkv = k.shape[1]
        kc[self.slots, :, self.positions] = k  # [B, nkv, d] into [slots, nkv, ctx, d]
        vc[self.slots, :, self.positions] = v
        kv_len = self.batch_bias.shape[-1]
        keys, vals = kc[self.slots, :, :kv_len], vc[self.slots, :, :kv_len]  # [B, nkv, L, d]
        qg = q.view(b, nkv, nq // nkv, d)  # [B, nkv, g, d]
        return _decode_attention(qg, keys, vals, self.batch_bias).reshape(b, nq * d)


def _causal_mask(s: Span, device: torch.device) -> Tensor:
    """[T, L]: query t (position start + t) sees keys 0..start + t."""
    keys = torch.arange(s.end, device=device)
    queries = torch.arange(s.start, s.end, device=device)
    return keys[None, :] <= queries[:, None]


def _attend_span(
    s: Span, mask: Tensor | None, q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor
) -> Tensor:
    """One request's T rows: q [T, nq, d], k/v [T, nkv, d] -> [T, nq d]. mask [T, L] or None (T = 1)."""
    t, nq, d = q.shape
    nkv = k.shape[1]
    g = nq // nkv
    kc[s.slot, :, s.start : s.end] = k.transpose(0, 1)  # [nkv, T, d]
    vc[s.slot, :, s.start : s.end] = v.transpose(0, 1)
    keys, vals = kc[s.slot, :, : s.end], vc[s.slot, :, : s.end]  # [nkv, L, d], views
    if mask is None:  # one row: every cached key is visible
        return _decode_attention(q.view(nkv, g, d), keys, vals).reshape(1, nq * d)
    qg = q.view(t, nkv, g, d).permute(1, 2, 0, 3).reshape(1, nkv, g * t, d)  # [1, nkv, g*T, d]
    out = F.scaled_dot_product_attention(qg, keys[None], vals[None], attn_mask=mask.repeat(g, 1))
    return out.view(nkv, g, t, d).permute(2, 0, 1, 3).reshape(t, nq * d)  # [T, nq d]


def _decode_attention(q: Tensor, keys: Tensor, vals: Tensor, bias: Tensor | None = None) -> Tensor:
    """Attention for single-row queries: q [..., nkv, g, d], keys/vals [..., nkv, L, d] -> [..., nkv, g, d].
    Written out (two matmuls and a softmax in float32) because on the CPU, for these tiny shapes,
    SDPA's generic paths cost several times more than the arithmetic."""
    scores = torch.matmul(q, keys.transpose(-1, -2)).float().mul_(q.shape[-1] ** -0.5)  # [..., nkv, g, L]
    if bias is not None:
        scores += bias
    return torch.matmul(scores.softmax(-1).to(vals.dtype), vals)
