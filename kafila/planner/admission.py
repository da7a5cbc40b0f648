"""Admission: the one memory check after a division exists, and refusals that name the device."""

from __future__ import annotations

from collections.abc import Sequence

from kafila.planner.cost import Workload, fmt_bytes, memory_shortfall
from kafila.planner.devices import DeviceReport


def check_memory(
    devices: Sequence[DeviceReport], counts: Sequence[int], head: int, w: Workload
) -> str | None:
    """None if every member holds its share, else the refusal naming each undersized member."""
    short = [
        memory_shortfall(d, w, n, i == head) for i, (d, n) in enumerate(zip(devices, counts, strict=True))
    ]
    reasons = [s for s in short if s]
    return "; ".join(reasons) if reasons else None


def explain_no_division(devices: Sequence[DeviceReport], w: Workload) -> str:
    """Why no division of the model fits these members at all, naming the numbers."""
    k, m = w.n_blocks, len(devices)
    if m > k:
        return f"{m} members but the model has only {k} blocks; every member needs at least one"
    for d in devices:
        if w.limit(d.memory_bytes, head=False) < 1:
            return str(memory_shortfall(d, w, 1, head=False))
    if all(w.limit(d.memory_bytes, head=True) < 1 for d in devices):
        big = max(devices, key=lambda d: d.memory_bytes)
        return f"no member can hold the head: largest is {memory_shortfall(big, w, 1, head=True)}"
    limits = [w.limit(d.memory_bytes, head=False) for d in devices]
    with_head = [w.limit(d.memory_bytes, head=True) for d in devices]
    # with each member that can hold the head (and a block of its own) holding it
    rows = list(zip(devices, limits, with_head, strict=True))
    holds = [(sum(limits) - n + h, d.name) for d, n, h in rows if h >= 1]
    most, holder = max(holds, key=lambda most_name: most_name[0])  # ties: the first in ring order
    per_device = ", ".join(f"{d.name} {n} ({h} with the head)" for d, n, h in rows)
    return (
        f"the members hold at most {most} of {k} blocks with the head ({holder} holding it): "
        f"{k - most} blocks more need {fmt_bytes((k - most) * w.block_resident_bytes)} more memory "
        f"({fmt_bytes(w.block_resident_bytes)} per block at context {w.context} x concurrency "
        f"{w.concurrency}; limits: {per_device})"
    )
