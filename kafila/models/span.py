"""What a batched step tells a model about each request (backend-neutral, pure)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One request's rows in a step: `length` rows at positions start.. start+length-1, which read and
    write KV-cache `slot`. A step's hidden rows are the spans' rows stacked in order."""

    slot: int
    start: int
    length: int

    @property
    def end(self) -> int:
        return self.start + self.length
