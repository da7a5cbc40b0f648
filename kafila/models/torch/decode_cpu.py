"""A Llama/Qwen3 block's decode step on the CPU in fp32 or bf16, compiled whole by numba.

A decode step runs each block on 1-16 rows (one per request). In torch that is about 25 small
operations per block, 750 per step for a 30-block model, each costing 10-30 microseconds of
dispatch on a 576-wide row: as much time as reading the weights. Here one compiled call runs a
block: the four weight products go through `few_rows._product` (each weight read once from
memory for every row), and the norms, RoPE, the KV-cache write, attention and the SwiGLU run in
the same call without dispatch. `LlamaModel.forward` takes this path for decode-only steps in fp32
and bf16 on the CPU; prefill chunks, fp16 and other devices keep the torch code, which the
reference tests compare against transformers, and this path is held to the same tests.

In bf16, weights and KV caches stay bf16 in memory (read as uint16 bits, widened exactly) and the
arithmetic is float32; the residual stream is rounded to bf16 after every block, as it is when it
crosses to the next member, so a division of the blocks never changes the result.

Row r's arithmetic depends only on its own inputs and cache, never on the other rows in the call,
so a request decodes bit-identically alone or in a batch.

Shapes: N rows, H hidden, nq/nkv query/KV heads, d head_dim, g = nq / nkv, F intermediate,
slots x ctx KV cache per block.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange

from kafila.models.torch.few_rows import _product, f32_row, store_row


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:  # pragma: no cover
    """out [N, H] = x [N, H] / rms(x) * w [H]."""
    n, h = x.shape
    for r in range(n):
        ss = np.float32(0.0)
        for i in range(h):
            ss += x[r, i] * x[r, i]
        scale = np.float32(1.0) / np.sqrt(ss / np.float32(h) + np.float32(eps))
        for i in range(h):
            out[r, i] = x[r, i] * scale * w[i]


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def _rope_row(v: np.ndarray, cos: np.ndarray, sin: np.ndarray, tmp: np.ndarray) -> None:  # pragma: no cover
    """In place on one head v [d]: v * cos + roll(v, d/2) * sin (sin signed, see kafila.models.rope)."""
    d = v.shape[0]
    half = d // 2
    for i in range(d):
        tmp[i] = v[i]
    for i in range(d):
        v[i] = tmp[i] * cos[i] + tmp[(i + half) % d] * sin[i]


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def _head_norm(v: np.ndarray, w: np.ndarray, eps: float) -> None:  # pragma: no cover
    """In place on one head v [d]: Qwen3's q_norm / k_norm."""
    d = v.shape[0]
    ss = np.float32(0.0)
    for i in range(d):
        ss += v[i] * v[i]
    scale = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
    for i in range(d):
        v[i] = v[i] * scale * w[i]


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def _prepare_qkv(
    qkv: np.ndarray,  # [N, (nq + 2 nkv) d], rotated/normed in place
    qk_norm: np.ndarray,  # [nq + nkv, d], or [0, 0] when the model has none
    cos: np.ndarray,  # [ctx, d]
    sin: np.ndarray,  # [ctx, d]
    kc: np.ndarray,  # [slots, nkv, ctx, d]
    vc: np.ndarray,
    slots: np.ndarray,  # [N] int64
    positions: np.ndarray,  # [N] int64
    nq: int,
    nkv: int,
    eps: float,
) -> None:  # pragma: no cover
    """q/k head norms (Qwen3), RoPE on q and k, and k/v written into the caches at each row's slot."""
    n = qkv.shape[0]
    d = kc.shape[3]
    tmp = np.empty(d, np.float32)
    for r in range(n):
        p, s = positions[r], slots[r]
        for h in range(nq + nkv):
            head = qkv[r, h * d : (h + 1) * d]
            if qk_norm.shape[0] > 0:
                _head_norm(head, qk_norm[h], eps)
            _rope_row(head, cos[p], sin[p], tmp)
        for h in range(nkv):
            store_row(kc[s, h], p, qkv[r, (nq + h) * d : (nq + h + 1) * d])
            store_row(vc[s, h], p, qkv[r, (nq + nkv + h) * d : (nq + nkv + h + 1) * d])


@njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
def _attend(
    qkv: np.ndarray,  # [N, (nq + 2 nkv) d]: the rotated queries are read
    kc: np.ndarray,  # [slots, nkv, ctx, d]
    vc: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    nq: int,
    out: np.ndarray,  # [N, nq d]
) -> None:  # pragma: no cover
    """Each row's query heads against its cached keys 0..position (softmax in float32)."""
    n = qkv.shape[0]
    nkv, d = kc.shape[1], kc.shape[3]
    g = nq // nkv
    scale = np.float32(1.0 / math.sqrt(d))
    for job in prange(n * nq):
        r, h = job // nq, job % nq
        s, length = slots[r], positions[r] + 1
        kv = h // g
        q = qkv[r, h * d : (h + 1) * d]
        keys, vals = kc[s, kv], vc[s, kv]  # [ctx, d]
        buf = np.empty(d, np.float32)
        scores = np.empty(length, np.float32)
        top = np.float32(-np.inf)
        for j in range(length):
            key = f32_row(keys, j, buf)
            acc = np.float32(0.0)
            for i in range(d):
                acc += q[i] * key[i]
            scores[j] = acc * scale
            top = max(top, scores[j])
        total = np.float32(0.0)
        for j in range(length):
            scores[j] = np.exp(scores[j] - top)
            total += scores[j]
        o = out[r, h * d : (h + 1) * d]
        o[:] = 0.0
        for j in range(length):
            val = f32_row(vals, j, buf)
            wj = scores[j] / total
            for i in range(d):
                o[i] += wj * val[i]


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def _add_into(x: np.ndarray, y: np.ndarray) -> None:  # pragma: no cover
    n, h = x.shape
    for r in range(n):
        for i in range(h):
            x[r, i] += y[r, i]


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def _round_to_bf16(x: np.ndarray) -> None:  # pragma: no cover
    """In place on float32 x [N, H]: the nearest bf16 value (ties to even), as torch rounds."""
    bits = x.reshape(-1).view(np.uint32)
    for i in range(bits.shape[0]):
        b = bits[i]
        bits[i] = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> 16) << 16


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def _swiglu(gate_up: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """out [N, F] = silu(gate) * up for gate_up [N, 2F] (gate rows first)."""
    n, f = out.shape
    for r in range(n):
        for i in range(f):
            a = gate_up[r, i]
            out[r, i] = a / (np.float32(1.0) + np.exp(-a)) * gate_up[r, f + i]


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def block_step(
    x: np.ndarray,  # [N, H], updated in place
    attn_norm: np.ndarray,  # [H]
    wqkv: np.ndarray,  # [(nq + 2 nkv) d, H]; weights: float32, or uint16 bfloat16 bits
    bqkv: np.ndarray,  # [(nq + 2 nkv) d], or [0] without attention bias
    qk_norm: np.ndarray,  # [nq + nkv, d], or [0, 0]
    wo: np.ndarray,  # [H, nq d]
    mlp_norm: np.ndarray,  # [H]
    w_gate_up: np.ndarray,  # [2F, H]
    w_down: np.ndarray,  # [H, F]
    kc: np.ndarray,  # [slots, nkv, ctx, d], float32 or bf16 bits like the weights
    vc: np.ndarray,
    cos: np.ndarray,  # [ctx, d] float32
    sin: np.ndarray,
    slots: np.ndarray,  # [N] int64
    positions: np.ndarray,  # [N] int64
    nq: int,
    eps: float,
    bf16: bool,  # round the residual stream to bf16 at the end
) -> None:  # pragma: no cover
    """One block's decode step for N rows, in place on x (float32 in both dtypes)."""
    n, hidden = x.shape
    nkv = kc.shape[1]
    h = np.empty((n, hidden), np.float32)
    _rms_norm(x, attn_norm, eps, h)
    qkv = np.empty((n, wqkv.shape[0]), np.float32)
    _product(h, wqkv, qkv)
    if bqkv.shape[0] > 0:
        for r in range(n):
            qkv[r] += bqkv
    _prepare_qkv(qkv, qk_norm, cos, sin, kc, vc, slots, positions, nq, nkv, eps)
    attn = np.empty((n, wo.shape[1]), np.float32)
    _attend(qkv, kc, vc, slots, positions, nq, attn)
    y = np.empty((n, hidden), np.float32)
    _product(attn, wo, y)
    _add_into(x, y)
    _rms_norm(x, mlp_norm, eps, h)
    gate_up = np.empty((n, w_gate_up.shape[0]), np.float32)
    _product(h, w_gate_up, gate_up)
    act = np.empty((n, w_down.shape[1]), np.float32)
    _swiglu(gate_up, act)
    _product(act, w_down, y)
    _add_into(x, y)
    if bf16:
        _round_to_bf16(x)
