"""Products of a few rows with a large fp32 or bf16 weight on the CPU, at close to the memory bandwidth.

A decode step multiplies a few hidden rows (one per request in the batch) by every weight matrix
once, so its cost is reading the weights. torch's CPU products (MKL, oneDNN) pack the weight for
a general matrix product first and, measured on this project's AMD EPYC CI machine with two
threads, read it at 6-14 GB/s for one row and 2-5 GB/s for two to eight rows, against 17 GB/s for
a plain streaming read. This kernel reads each weight row once from memory and dots it with every
input row while it sits in L1, so one row streams at 12-17 GB/s and four rows at about 11 GB/s:
batching decode steps of several users then costs little more than one
(`benchmarks/engine.py`, `benchmarks/users.py`; figures in docs/engine.md).

Each output element is one dot product whose order of additions depends only on `in`, never on
how many rows are in the call, so a request's result is bit-identical alone or in a batch.

bf16 weights are read as their uint16 bits and widened to float32 row by row (exact), so they
cost half the memory traffic; arithmetic is float32. `LlamaModel` sends its products here on the
CPU in fp32 and bf16 up to `llama.KERNEL_ROWS` rows: decode steps, and prefill chunks too, whose
weights also stream from memory once per chunk (there the kernel beats torch's packed product up
to 64 rows in fp32 and at every size in bf16, benchmarks/products.py). Compiled by numba on first
use (a few seconds) and cached on disk afterwards. Threads: numba's pool, sized by
NUMBA_NUM_THREADS, which `kafila.engine.backend` sets to the usable CPUs before the first import.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, prange, types
from numba.extending import intrinsic, overload

TILE = 8  # quadruples of output rows per parallel task


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy, no copy: float32 as float32, bfloat16 as its uint16 bits."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


@intrinsic
def _bits_to_f32(typingctx, bits):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    """The float32 whose bit pattern is the uint32 `bits` (an LLVM bitcast, vectorisable)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def at(w: np.ndarray, o: int, i: int) -> float:
    """w[o, i] as float32, for a float32 or bfloat16-bits 2-D array (compiled: see the overload)."""
    raise NotImplementedError("compiled only")


@overload(at, jit_options={"fastmath": True})
def _at(w, o, i):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    if w.dtype == types.float32:
        return lambda w, o, i: w[o, i]
    if w.dtype == types.uint16:  # bfloat16 bits: the high half of a float32, widened exactly
        return lambda w, o, i: _bits_to_f32(np.uint32(w[o, i]) << np.uint32(16))
    return None


@njit(cache=True, nogil=True)
def bf16_bits(b: np.uint32) -> np.uint32:  # pragma: no cover (compiled)
    """The bfloat16 nearest (ties to even, as torch rounds) to the float32 with bits `b`, as its bits."""
    return (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


def store_row(dst: np.ndarray, j: int, src: np.ndarray) -> None:
    """dst[j] = src (float32), rounded to nearest even when dst holds bfloat16 bits (compiled)."""
    raise NotImplementedError("compiled only")


@overload(store_row, jit_options={"fastmath": True})
def _store_row(dst, j, src):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    if dst.dtype == types.float32:

        def copy(dst, j, src):  # type: ignore[no-untyped-def]
            for i in range(src.shape[0]):
                dst[j, i] = src[i]

        return copy
    if dst.dtype == types.uint16:

        def narrow(dst, j, src):  # type: ignore[no-untyped-def]
            bits = src.view(np.uint32)
            for i in range(src.shape[0]):
                dst[j, i] = np.uint16(bf16_bits(bits[i]))

        return narrow
    return None


@njit(cache=True, nogil=True)
def tiles(w: np.ndarray) -> int:  # pragma: no cover (compiled)
    """Parallel tasks of a product with w: TILE quadruples of output rows each."""
    return ((w.shape[0] + 3) // 4 + TILE - 1) // TILE


@njit(fastmath=True, cache=True, boundscheck=False, nogil=True)
def product_tile(x: np.ndarray, w: np.ndarray, y: np.ndarray, tile: int) -> None:  # pragma: no cover
    """One parallel task of y = x w^T (see `_product`): output rows o in [tile * TILE, (tile + 1) *
    TILE) of the first quarter together with rows o + q, o + 2q, o + 3q (q = out / 4), four memory
    streams at once (measured against two: 15-35% faster for one x row, 20-60% for four in fp32,
    10-18% for one row in bf16). Which rows go together depends on `out` alone, never on N.
    Compiled callers run `for tile in prange(tiles(w))`: a cached function must not call another
    parallel function (numba's cache then crashes on load), so the loop is written where it runs."""
    n, k = x.shape
    out = w.shape[0]
    q = (out + 3) // 4
    for o in range(tile * TILE, min(q, (tile + 1) * TILE)):
        o1, o2, o3 = o + q, o + 2 * q, o + 3 * q
        if o3 < out:
            for r in range(n):
                a0, a1 = np.float32(0.0), np.float32(0.0)
                a2, a3 = np.float32(0.0), np.float32(0.0)
                for i in range(k):
                    xi = x[r, i]
                    a0 += xi * at(w, o, i)
                    a1 += xi * at(w, o1, i)
                    a2 += xi * at(w, o2, i)
                    a3 += xi * at(w, o3, i)
                y[r, o], y[r, o1], y[r, o2], y[r, o3] = a0, a1, a2, a3
        else:  # the last quadruple of an `out` not divisible by 4: its rows one by one
            for row in (o, o1, o2, o3):
                if row < out:
                    for r in range(n):
                        a0 = np.float32(0.0)
                        for i in range(k):
                            a0 += x[r, i] * at(w, row, i)
                        y[r, row] = a0


@njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
def _product(x: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:  # pragma: no cover (compiled)
    """y[r, o] = sum_i x[r, i] w[o, i] for x [N, in] and y [N, out] float32, w [out, in] float32 or
    bfloat16 bits (widened as they are read)."""
    for tile in prange(tiles(w)):
        product_tile(x, w, y, tile)


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in] @ w[out, in]^T -> [N, out] in x's dtype: CPU, fp32 or bf16, w contiguous, few rows."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)  # [N, out]
    _product(x.float().contiguous().numpy(), numpy_view(w), y.numpy())
    return y.to(x.dtype)
