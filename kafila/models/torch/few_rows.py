"""Products of a few rows with a large fp32 weight on the CPU, at close to the memory bandwidth.

A decode step multiplies 1-16 hidden rows (one per request in the batch) by every weight matrix
once, so its cost is reading the weights. torch's CPU products (MKL, oneDNN) pack the weight for
a general matrix product first and, measured on this project's AMD EPYC CI machine with two
threads, read it at 6-14 GB/s for one row and 2-5 GB/s for two to eight rows, against 17 GB/s for
a plain streaming read. This kernel reads each weight row once from memory and dots it with every
input row while it sits in L1, so one row streams at 12-17 GB/s and four rows at about 11 GB/s:
batching decode steps of several users then costs little more than one
(`benchmarks/engine.py`, `benchmarks/users.py`; figures in docs/engine.md).

Each output element is one dot product whose order of additions depends only on `in`, never on
how many rows are in the call, so a request's result is bit-identical alone or in a batch.

`LlamaModel` sends products of at most `llama.FEW_ROWS` rows here (fp32, CPU). Compiled by numba
on first use (a few seconds) and cached on disk afterwards. Threads: numba's
pool, sized by NUMBA_NUM_THREADS, which `kafila.engine.backend` sets to the usable CPUs before the
first import.
"""

from __future__ import annotations

import numpy as np
import torch
from numba import njit, prange

_OUT_TILE = 32  # output rows per parallel task


@njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
def _product(x: np.ndarray, w: np.ndarray, y: np.ndarray) -> None:  # pragma: no cover (compiled)
    """y[r, o] = sum_i x[r, i] w[o, i] for x [N, in], w [out, in], y [N, out], all float32."""
    n, k = x.shape
    out = w.shape[0]
    for tile in prange((out + _OUT_TILE - 1) // _OUT_TILE):
        for o in range(tile * _OUT_TILE, min(out, (tile + 1) * _OUT_TILE)):
            for r in range(n):
                acc = np.float32(0.0)
                for i in range(k):
                    acc += x[r, i] * w[o, i]
                y[r, o] = acc


def linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [N, in] @ w[out, in]^T -> [N, out]: float32 CPU tensors, w contiguous, few rows."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)  # [N, out]
    _product(x.contiguous().numpy(), w.numpy(), y.numpy())
    return y
