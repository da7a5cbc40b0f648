"""Weight matrices on transparent huge pages (Linux), for the CPU kernels that stream them.

A decode step reads every weight of a stage once, hundreds of MB, at close to the memory
bandwidth (few_rows). With 4 KB pages that stream crosses a page every 4 KB: a TLB miss and a page
walk each time, and the CPU's own prefetchers stop at page boundaries. With 2 MB pages it crosses
one every 2 MB. Measured on the project's AMD EPYC (Zen 4) VM, the two alternated in one process
(`benchmarks/products.py` prints this comparison): products of one and two rows took 0.91-0.95x
the time of the same weights on 4 KB pages, four to nineteen rows 0.95-1.00x; a whole
single-process decode ran 6-12% faster (docs/engine.md, "Prefetch distance per pass, weights on
huge pages").

Linux backs anonymous memory with huge pages where its transparent huge pages (THP) setting is
`always`, or `madvise` and the region asks for them (`MADV_HUGEPAGE`). `HugePages` hands out
weight tensors from 2 MB-aligned anonymous slabs that ask; a tensor keeps its slab alive. Where THP
is off (`never`) or absent (macOS, Windows), and for tensors under 64 KB, tensors stay where torch
put them: the bits are the same either way, only the time to read them changes.
"""

from __future__ import annotations

import contextlib
import mmap
from pathlib import Path

import numpy as np
import torch

HUGE_PAGE = 2 << 20  # x86-64's and most arm64 Linux kernels' PMD size
SLAB = 64 << 20  # one anonymous mapping holds several matrices (at most one slab's tail is unused)
ALIGN = 64  # each tensor starts on a cache line
SMALLEST = 64 << 10  # smaller tensors (norms, biases) stay where they are
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def thp_mode(setting: Path = THP_SETTING) -> str | None:
    """The kernel's THP mode ("always", "madvise" or "never": the bracketed word of the setting),
    or None where there is no such setting (not Linux, or a kernel without THP)."""
    try:
        text = setting.read_text()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1 : end] if 0 <= start < end else None


def usable(mode: str | None) -> bool:
    """Whether weights can be given huge pages under this THP mode."""
    return mode in ("always", "madvise") and hasattr(mmap, "MADV_HUGEPAGE")


class _Slab:
    """One 2 MB-aligned anonymous private mapping that asks for huge pages; `used` bytes handed out."""

    def __init__(self, nbytes: int) -> None:
        self.map = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        address = np.frombuffer(self.map, dtype=np.uint8).ctypes.data
        self.start = -address % HUGE_PAGE  # the first 2 MB boundary in the mapping
        self.size, self.used = nbytes, 0
        with contextlib.suppress(OSError):  # refused (a kernel built without THP): 4 KB pages, same bits
            self.map.madvise(mmap.MADV_HUGEPAGE, self.start, nbytes)

    def take(self, nbytes: int) -> int | None:
        """The offset in the mapping of `nbytes` more bytes, or None if they do not fit."""
        at = -(-self.used // ALIGN) * ALIGN
        if at + nbytes > self.size:
            return None
        self.used = at + nbytes
        return self.start + at


class HugePages:
    """Hands out weight tensors in memory backed by huge pages (see the module docstring)."""

    def __init__(self, slab_bytes: int = SLAB) -> None:
        self.slab_bytes = slab_bytes
        self._slab: _Slab | None = None
        self.bytes_placed = 0

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised CPU tensor in huge-page memory, packed after the ones before it (a plain
        torch.empty under SMALLEST bytes). The caller writes it at once (copy_, or cat's out=), so
        a weight never exists twice beyond the parts it is made from."""
        count = int(np.prod(shape))
        nbytes = count * dtype.itemsize
        if nbytes < SMALLEST:
            return torch.empty(shape, dtype=dtype)
        slab, at = self._slab, None
        if slab is not None:
            at = slab.take(nbytes)
        if slab is None or at is None:
            size = max(self.slab_bytes, -(-nbytes // HUGE_PAGE) * HUGE_PAGE)
            slab = _Slab(size)
            at = slab.take(nbytes)
            assert at is not None  # a fresh slab holds at least nbytes
            if nbytes < size:
                self._slab = slab  # later tensors fill the rest
        self.bytes_placed += nbytes
        return torch.frombuffer(slab.map, dtype=dtype, count=count, offset=at).view(shape)


def for_device(device: torch.device) -> HugePages | None:
    """A HugePages for a CPU model where this system offers huge pages, else None."""
    return HugePages() if device.type == "cpu" and usable(thp_mode()) else None
