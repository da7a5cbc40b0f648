"""Repeated timing: a figure's median and spread over repetitions (pure arithmetic)."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Figure:
    """One measured quantity: median, and spread as the half-range over the median (0.05 = +-5%)."""

    median: float
    spread: float
    lo: float
    hi: float
    n: int
    unit: str

    @classmethod
    def of(cls, samples: Sequence[float], unit: str) -> Figure:
        if not samples:
            raise ValueError("a figure needs at least one sample")
        med = statistics.median(samples)
        lo, hi = min(samples), max(samples)
        return cls(med, (hi - lo) / 2 / med if med else 0.0, lo, hi, len(samples), unit)

    def to_dict(self) -> dict[str, float | int | str]:
        return {
            "median": self.median,
            "spread": self.spread,
            "lo": self.lo,
            "hi": self.hi,
            "n": self.n,
            "unit": self.unit,
        }

    @classmethod
    def from_dict(cls, d: dict[str, float | int | str]) -> Figure:
        return cls(
            float(d["median"]),
            float(d["spread"]),
            float(d["lo"]),
            float(d["hi"]),
            int(d["n"]),
            str(d["unit"]),
        )


def rates(seconds: Sequence[float], work: float) -> list[float]:
    """Per-call seconds -> rates (work per second), e.g. bytes read -> bytes/s."""
    return [work / s for s in seconds]
