"""A Llama/Qwen3 block's decode step on the CPU in fp32 or bf16, compiled whole by numba.

A decode step runs each block on a few rows (one per request; up to `llama.KERNEL_ROWS`). In
torch that is about 25 small operations per block, 750 per step for a 30-block model, each costing
10-30 microseconds of dispatch on a 576-wide row: as much time as reading the weights. Here one
compiled call runs a block: the four weight products run `few_rows.product_tile` tasks (each
weight read once from memory for every row), and the norms, RoPE, the KV-cache write, attention
and the SwiGLU run in the same call without dispatch. `LlamaModel.forward` takes this path for
decode-only steps in fp32 and bf16 on the CPU; prefill chunks, fp16 and other devices keep the
torch code, which the reference tests compare against transformers, and this path is held to the
same tests.

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

from kafila.models.torch import quant_cpu
from kafila.models.torch.few_rows import at, bf16_bits, bits_to_f32, product_tile, store_row, tiles

# The contents of few_rows.py these kernels were compiled with (its sha256, first 16 hex digits).
# numba's disk cache keys each function on its own file's time stamp and code, not on the code it
# calls in other files, so without this line a changed few_rows.py would leave the cached kernels
# below running the old products. A test compares it with the file: update it with every change
# there, which changes this file too and makes numba compile these kernels again.
FEW_ROWS_SHA256 = "feb50eb9316af2cb"
# The same for quant_cpu.py, whose packed products block_step runs for int8 and q4 weights.
QUANT_CPU_SHA256 = "c25b8554921d07c7"


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True, inline="always")
def _exp(x: float) -> float:  # pragma: no cover
    """e**x in float32 from arithmetic alone (Cephes' expf: 2**n e**r with |r| <= ln 2 / 2 and a degree-7
    polynomial; within 5 float32 ulps, 1.5 on average), so that loops calling it vectorize, where
    libm's expf is a call per element. Clamped to [-87.3, 88.4]: 1.2e-38 below, 2.4e38 above."""
    x = min(max(x, np.float32(-87.33654)), np.float32(88.37626))  # type: ignore[assignment]  # numpy's stubs
    n = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))  # round(x / ln 2)
    r = x - n * np.float32(0.693359375) - n * np.float32(-2.12194440e-4)  # x - n ln 2, in two parts
    p = np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    return p * bits_to_f32(np.uint32(np.int32(n) + np.int32(127)) << np.uint32(23))  # * 2**n


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def _rms_row(v: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:  # pragma: no cover
    """out [d] = v [d] / rms(v) * w [d]; `out` may be `v` (in place)."""
    d = v.shape[0]
    ss = np.float32(0.0)
    for i in range(d):
        ss += v[i] * v[i]
    scale = np.float32(1.0) / np.sqrt(ss / np.float32(d) + np.float32(eps))
    for i in range(d):
        out[i] = v[i] * scale * w[i]


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def _rms_norm(x: np.ndarray, w: np.ndarray, eps: float, out: np.ndarray) -> None:  # pragma: no cover
    """out [N, H] = each row of x [N, H] / its rms * w [H]."""
    for r in range(x.shape[0]):
        _rms_row(x[r], w, eps, out[r])


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
                _rms_row(head, qk_norm[h], eps, head)  # Qwen3's q_norm / k_norm, in place
            _rope_row(head, cos[p], sin[p], tmp)
        for h in range(nkv):
            store_row(kc[s, h], p, qkv[r, (nq + h) * d : (nq + h + 1) * d])
            store_row(vc[s, h], p, qkv[r, (nq + nkv + h) * d : (nq + nkv + h + 1) * d])


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def _attend_group(
    qkv: np.ndarray,  # [N, (nq + 2 nkv) d]: the rotated queries are read
    kc: np.ndarray,  # [slots, nkv, ctx, d]
    vc: np.ndarray,
    slots: np.ndarray,
    positions: np.ndarray,
    nq: int,
    out: np.ndarray,  # [N, nq d]
    job: int,  # row * nkv + KV head: one parallel task
) -> None:  # pragma: no cover
    """One row's query heads that share a KV head (its group of g = nq / nkv) against their
    cached keys 0..position, softmax in float32. The group's scores are one few-rows product,
    queries [g, d] by keys [length, d] (`product_tile`: each key read once for the whole group,
    four keys at a time, every sum in a fixed order); each value row is read once for the group."""
    nkv, d = kc.shape[1], kc.shape[3]
    g = nq // nkv
    r, kv = job // nkv, job % nkv
    s, length = slots[r], positions[r] + 1
    q = qkv[r, kv * g * d : (kv + 1) * g * d].reshape(g, d)  # [g, d]
    keys = kc[s, kv, :length]  # [length, d]
    vals = vc[s, kv]  # [ctx, d]
    scores = np.empty((g, length), np.float32)  # [g, length]
    for tile in range(tiles(keys)):
        product_tile(q, keys, scores, tile)
    scale = np.float32(1.0 / math.sqrt(d))
    for h in range(g):
        top = np.float32(-np.inf)
        for j in range(length):
            scores[h, j] *= scale
            top = max(top, scores[h, j])
        total = np.float32(0.0)
        for j in range(length):
            scores[h, j] = _exp(scores[h, j] - top)
            total += scores[h, j]
        for j in range(length):
            scores[h, j] /= total
    o = out[r, kv * g * d : (kv + 1) * g * d].reshape(g, d)  # [g, d]
    o[:] = 0.0
    for j in range(length):
        for h in range(g):
            wj = scores[h, j]
            for i in range(d):
                o[h, i] += wj * at(vals, j, i)


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
        bits[i] = bf16_bits(bits[i]) << np.uint32(16)


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True, error_model="numpy")
def _swiglu(gate_up: np.ndarray, out: np.ndarray) -> None:  # pragma: no cover
    """out [N, F] = silu(gate) * up for gate_up [N, 2F] (gate rows first)."""
    n, f = out.shape
    for r in range(n):
        for i in range(f):
            a = gate_up[r, i]
            out[r, i] = a / (np.float32(1.0) + _exp(-a)) * gate_up[r, f + i]


@njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
def block_step(
    x: np.ndarray,  # [N, H], updated in place
    attn_norm: np.ndarray,  # [H]
    wqkv: np.ndarray,  # [(nq + 2 nkv) d, H]; weights: float32, uint16 bfloat16 bits, or packed tuples
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
    """One block's decode step for N rows, in place on x (float32 in both dtypes). The products
    (quant_cpu.run, inlined) and attention are `prange` loops over tasks (see few_rows.product_tile
    for why). A weight is a float array, a packed tuple (quant_cpu: int8, q4, q6k) or a tuple of
    packed tuples (a stacked product of several formats); each compiles its own."""
    n, hidden = x.shape
    nkv = kc.shape[1]
    h = np.empty((n, hidden), np.float32)
    _rms_norm(x, attn_norm, eps, h)
    qkv = np.empty((n, quant_cpu.rows_of(wqkv)), np.float32)
    quant_cpu.run(h, wqkv, qkv)  # a parallel loop over the product's tasks (inlined)
    if bqkv.shape[0] > 0:
        for r in range(n):
            qkv[r] += bqkv
    _prepare_qkv(qkv, qk_norm, cos, sin, kc, vc, slots, positions, nq, nkv, eps)
    attn = np.empty((n, quant_cpu.cols_of(wo)), np.float32)
    for job in prange(n * nkv):
        _attend_group(qkv, kc, vc, slots, positions, nq, attn, job)
    y = np.empty((n, hidden), np.float32)
    quant_cpu.run(attn, wo, y)
    _add_into(x, y)
    _rms_norm(x, mlp_norm, eps, h)
    gate_up = np.empty((n, quant_cpu.rows_of(w_gate_up)), np.float32)
    quant_cpu.run(h, w_gate_up, gate_up)
    act = np.empty((n, quant_cpu.cols_of(w_down)), np.float32)
    _swiglu(gate_up, act)
    quant_cpu.run(act, w_down, y)
    _add_into(x, y)
    if bf16:
        _round_to_bf16(x)


def warm_up() -> None:
    """Compile the kernels for fp32 and bf16 (or load them from numba's disk cache) on tiny arrays.
    The first compile takes 10-30 s; a local fleet calls this before starting its members so that
    they load the cache instead of each compiling at once on the same cores."""
    import torch

    from kafila.models.torch import few_rows

    n, hidden, nq, nkv, d, inter = 1, 8, 2, 1, 4, 8
    rng = np.random.default_rng(0)

    def f32(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape).astype(np.float32)

    for bf16 in (False, True):
        dtype = torch.bfloat16 if bf16 else torch.float32

        def weight(*shape: int, dtype: torch.dtype = dtype) -> np.ndarray:
            return few_rows.numpy_view(torch.from_numpy(f32(*shape)).to(dtype).contiguous())

        cache = [weight(1, nkv, 2, d) for _ in range(2)]
        block_step(
            f32(n, hidden), f32(hidden), weight((nq + 2 * nkv) * d, hidden), f32(0), f32(0, 0),
            weight(hidden, nq * d), f32(hidden), weight(2 * inter, hidden), weight(hidden, inter),
            *cache, f32(2, d), f32(2, d), np.zeros(n, np.int64), np.zeros(n, np.int64), nq, 1e-5, bf16,
        )  # fmt: skip
        few_rows.linear(torch.ones(n, hidden, dtype=dtype), torch.ones(inter, hidden, dtype=dtype))
