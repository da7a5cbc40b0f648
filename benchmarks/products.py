"""Products of few and prefill-sized rows: torch's `F.linear` against the few_rows kernel, weights
read from memory, the kernel against itself without its weight prefetch, and with its weights on
2 MB pages against 4 KB pages.

A prefill chunk multiplies its N rows by every weight of a block once, so, as in a decode step,
each weight comes from memory, not from cache. This script times one block's four products (the
default model's shapes: wqkv, o, gate+up, down) over enough distinct blocks (~340 MB in fp32) that
every product reads its weight cold, for several N, side by side in one run, and prints the time
per block of each and the ratio; then the kernel without its software prefetch of the weight rows
(`few_rows.PREFETCH`, which depends on the CPU), alternated with it, and that ratio (above 1:
the prefetch helps); then the same weights copied onto transparent huge pages (`hugepages`, as a
model places them where Linux offers THP), alternated too, and that ratio (above 1: huge pages
help). Every block's weights (kernel, no prefetch) are torch's allocations on 4 KB pages.
`kafila.models.torch.llama.KERNEL_ROWS` (up to which N the kernel is used, per dtype) comes from
these figures.

    python3 benchmarks/products.py [--dtype fp32|bf16] [--threads T] [--rows 1,16,19,32,64,96,128]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    p.add_argument("--threads", type=int, default=1, help="threads for torch and numba (default 1)")
    p.add_argument("--rows", default="1,16,19,32,48,64,76,96,128", help="N values, comma-separated")
    p.add_argument("--blocks", type=int, default=24, help="distinct blocks of weights (default 24)")
    args = p.parse_args()
    os.environ["NUMBA_NUM_THREADS"] = str(args.threads)  # before numba loads

    import torch
    import torch.nn.functional as F
    from llvmlite import binding as llvm

    from kafila.models.torch import few_rows, hugepages

    torch.set_num_threads(args.threads)

    def no_prefetch(x: Any, w: Any) -> Any:
        return few_rows.linear(x, w, prefetch=False)

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's [out, in]
    blocks = [[torch.randn(o, i).to(dtype) for o, i in shapes] for _ in range(args.blocks)]
    pages = hugepages.HugePages() if hugepages.usable(hugepages.thp_mode()) else None
    huge = [[on_pages(pages, w) for w in block] for block in blocks] if pages else None
    print(f"{args.dtype}, {args.threads} thread(s), {args.blocks} blocks of {shapes}")
    cpu, pf = llvm.get_host_cpu_name(), few_rows.PREFETCH
    ahead = pf.bf16 if args.dtype == "bf16" else pf.fp32
    print(f"CPU {cpu}: a first pass of 1-4 rows prefetches {ahead} bytes ahead, locality {pf.locality}")
    if huge is None:
        print(f"no huge pages here (THP: {hugepages.thp_mode()}): the last two columns stay empty")
    head = f"{'rows':>5} {'torch ms':>9} {'kernel ms':>10} {'torch/kernel':>13}"
    print(f"{head} {'no prefetch ms':>15} {'ratio':>6} {'huge pages ms':>14} {'ratio':>6}")
    for n in [int(r) for r in args.rows.split(",")]:
        x = {i: torch.randn(n, i).to(dtype) for i in (576, 1536)}  # [N, in]

        per_block(blocks, x, F.linear), per_block(blocks, x, few_rows.linear)  # warm up (and compile)
        per_block(blocks, x, no_prefetch)
        t = min(per_block(blocks, x, F.linear) for _ in range(2))
        k, u, h = [], [], []
        for _ in range(4):  # alternated: the machine's drift falls on all alike
            k.append(per_block(blocks, x, few_rows.linear))
            u.append(per_block(blocks, x, no_prefetch))
            if huge is not None:
                h.append(per_block(huge, x, few_rows.linear))
        kernel, plain = min(k), min(u)
        row = f"{n:>5} {t * 1e3:>9.2f} {kernel * 1e3:>10.2f} {t / kernel:>13.2f}"
        row += f" {plain * 1e3:>15.2f} {plain / kernel:>6.2f}"
        print(row + (f" {min(h) * 1e3:>14.2f} {kernel / min(h):>6.2f}" if h else ""))
    return 0


def on_pages(pages: Any, w: Any) -> Any:
    """w copied into memory from `pages` (kafila.models.torch.hugepages.HugePages)."""
    out = pages.empty(tuple(w.shape), w.dtype)
    out.copy_(w)
    return out


def per_block(blocks: list[list[Any]], x: dict[int, Any], product: Callable[[Any, Any], Any]) -> float:
    """Seconds per block for `product(x [N, in], w [out, in])` over every block's weights."""
    start = time.perf_counter()
    for block in blocks:
        for w in block:
            product(x[w.shape[1]], w)
    return (time.perf_counter() - start) / len(blocks)


if __name__ == "__main__":
    raise SystemExit(main())
