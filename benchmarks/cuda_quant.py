"""Weight-only q4 products on a card: torch's int4 matmul against bf16 weights and the dequantized tiles.

One decode row (bfloat16) times each matrix of a Qwen3-8B block (q/k/v stacked, o, gate/up stacked,
down; random weights packed as Kafila's q4, Q4_1's numbers), three ways, each timed over --repeats
calls after a warm-up (CUDA events): `PackedLinear.int4_product` (torch's `_weight_int4pack_mm`,
what a q4 stage on CUDA runs), a plain bf16 matmul with the same weights widened (the bf16 stage's
cost), and the dequantized-tile path (the fallback). Prints microseconds per product and the GB/s of
each format's bytes. On the CPU (`--device cpu`, a smoke test) the int4 product runs torch's CPU
variant of the op.

    python3 benchmarks/cuda_quant.py [--device cuda] [--repeats 50] [--scale 1.0]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from kafila.models import quant
from kafila.models.torch.packed import TILE_ROWS, PackedLinear

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (24576, 4096), "down": (4096, 12288)}


def timed(fn, device: torch.device, repeats: int) -> float:  # type: ignore[no-untyped-def]
    """Seconds per call of fn(), best of three batches of `repeats`."""
    fn()
    best = float("inf")
    for _ in range(3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeats):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t) / repeats)
    return best


def measure(
    rng: np.random.Generator, out: int, k: int, device: torch.device, dtype: torch.dtype, repeats: int
) -> str:
    """One matrix [out, k] three ways (see the module's docstring), as a line of figures."""
    cpu_lin = PackedLinear.from_packed(
        quant.quantize(rng.standard_normal((out, k)).astype(np.float32), "q4"), torch.device("cpu")
    )
    assert cpu_lin.mins is not None
    lin = PackedLinear(
        cpu_lin.fmt, cpu_lin.data.to(device), cpu_lin.scales.to(device), cpu_lin.mins.to(device)
    )
    wide = lin.dequantized(slice(None), dtype)  # [out, k]
    x = torch.randn(1, k, dtype=dtype, device=device)
    ref = x.double() @ wide.double().T
    err = float((lin.int4_product(x).double() - ref).abs().max() / ref.abs().max())

    def tiles() -> torch.Tensor:
        parts = [
            x @ lin.dequantized(slice(a, min(a + TILE_ROWS, out)), dtype).T for a in range(0, out, TILE_ROWS)
        ]
        return torch.cat(parts, dim=1)

    runs = {
        "int4 matmul": (timed(lambda: lin.int4_product(x), device, repeats), lin.nbytes),
        f"{str(dtype)[6:]} weights": (
            timed(lambda: x @ wide.T, device, repeats),
            wide.numel() * wide.element_size(),
        ),
        "dequantized tiles": (timed(tiles, device, repeats), lin.nbytes),
    }
    cells = "  ".join(f"{k_}: {s * 1e6:8.1f} ({b / s / 1e9:6.1f})" for k_, (s, b) in runs.items())
    return f"{cells}  int4 rel. error {err:.1e}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", help="cuda (the card) or cpu (a smoke test)")
    p.add_argument("--repeats", type=int, default=50, help="calls per timed batch")
    p.add_argument("--scale", type=float, default=1.0, help="shrink the shapes (0.0625 for a CPU smoke test)")
    args = p.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rng = np.random.default_rng(0)
    print(
        f"device {device}  compute {dtype}  one row; microseconds per product (GB/s of that format's bytes)"
    )
    for name, (out, k) in SHAPES.items():
        out, k = max(64, int(out * args.scale) // 64 * 64), max(64, int(k * args.scale) // 64 * 64)
        print(f"{name:8} [{out}, {k}]  {measure(rng, out, k, device, dtype, args.repeats)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
