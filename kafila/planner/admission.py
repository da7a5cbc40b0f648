"""Admission: the one memory check after a division exists, and refusals that name the device."""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def explain_no_division(devices: Sequence[DeviceReport], w: Workload, head_at: int | None = None) -> str:
    """Why no division of the model fits these members at all, naming the numbers, and the smaller
    declared context or concurrency that would fit, if one would. `head_at`: the one member that
    may hold the head (None: any)."""
    k, m = w.n_blocks, len(devices)
    if m > k:
        return f"{m} members but the model has only {k} blocks; every member needs at least one"
    return _why_short(devices, w, head_at) + _smaller_that_fits(devices, w, head_at)


def _why_short(devices: Sequence[DeviceReport], w: Workload, head_at: int | None) -> str:
    for d in devices:
        if w.limit(d.memory_bytes, head=False) < 1:
            return str(memory_shortfall(d, w, 1, head=False))
    most = _most_with_head(devices, w, head_at)
    if most is None:
        big = max(devices, key=lambda d: d.memory_bytes) if head_at is None else devices[head_at]
        return f"no member can hold the head: largest is {memory_shortfall(big, w, 1, head=True)}"
    held, holder = most
    per_device = ", ".join(
        f"{d.name} {w.limit(d.memory_bytes, head=False)} ({w.limit(d.memory_bytes, head=True)} with the head)"
        for d in devices
    )
    k = w.n_blocks
    return (
        f"the members hold at most {held} of {k} blocks with the head ({holder} holding it): "
        f"{k - held} {'block more needs' if k - held == 1 else 'blocks more need'} "
        f"{fmt_bytes((k - held) * w.block_resident_bytes)} more memory "
        f"({fmt_bytes(w.block_resident_bytes)} per block at context {w.context} x concurrency "
        f"{w.concurrency}; limits: {per_device})"
    )


def _most_with_head(
    devices: Sequence[DeviceReport], w: Workload, head_at: int | None
) -> tuple[int, str] | None:
    """The most blocks the members hold with one of them (`head_at`, or any) holding the head and a
    block of its own, and which one; None when none can hold the head. Ties: the first in ring order."""
    limits = [w.limit(d.memory_bytes, head=False) for d in devices]
    holds = [
        (sum(limits) - n + h, d.name)
        for i, (d, n) in enumerate(zip(devices, limits, strict=True))
        if head_at in (None, i) and (h := w.limit(d.memory_bytes, head=True)) >= 1
    ]
    return max(holds, key=lambda held_name: held_name[0]) if holds else None


def fits(devices: Sequence[DeviceReport], w: Workload, head_at: int | None = None) -> bool:
    """Whether some division holds the whole model: every member a block at least, one (`head_at`,
    or any) the head."""
    if len(devices) > w.n_blocks or any(w.limit(d.memory_bytes, head=False) < 1 for d in devices):
        return False
    most = _most_with_head(devices, w, head_at)
    return most is not None and most[0] >= w.n_blocks


def _smaller_that_fits(devices: Sequence[DeviceReport], w: Workload, head_at: int | None) -> str:
    """'; it fits with concurrency at most U, or with context at most C (...)' from the largest that
    fit with the other as declared; '' if neither does."""
    ways = []
    if w.concurrency > 1 and (
        u := _largest(w.concurrency - 1, lambda u: fits(devices, w.at(w.context, u), head_at))
    ):
        ways.append(f"concurrency at most {u}")
    if w.context > 1 and (
        c := _largest(w.context - 1, lambda c: fits(devices, w.at(c, w.concurrency), head_at))
    ):
        ways.append(f"context at most {c}")
    return f"; it fits with {', or with '.join(ways)} (--concurrency, --context)" if ways else ""


def _largest(top: int, ok: Callable[[int], bool]) -> int:
    """The largest n in [1, top] with ok(n), for ok true up to some n and false above; 0 if none."""
    lo, hi = 0, top
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if ok(mid) else (lo, mid - 1)
    return lo
