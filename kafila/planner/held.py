"""What a member holds of the session's checkpoint on disk: the blocks it holds in full and whether
it holds the head's tensors (embedding, final norm, unembedding). A member reports it when it joins
(its weight cache, kafila.session.weights.holding); the host adds each plan's shares as they are
fetched (kafila.planner.fetching.after_plan). The planner prefers, among plans about as fast,
the one that fetches the fewest bytes from the host (kafila.planner.fetching)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

MAX_BLOCKS = 100_000  # a report naming a block beyond this is refused (a model has far fewer)


@dataclass(frozen=True)
class Held:
    blocks: frozenset[int] = frozenset()
    head: bool = False

    def __post_init__(self) -> None:
        bad = [b for b in self.blocks if not 0 <= b < MAX_BLOCKS]
        if bad:
            raise ValueError(f"held blocks must be from 0 to {MAX_BLOCKS - 1}, got {sorted(bad)[:3]}")

    @property
    def empty(self) -> bool:
        return not self.blocks and not self.head

    def union(self, blocks: Iterable[int], head: bool) -> Held:
        return Held(self.blocks | frozenset(blocks), self.head or head)

    def to_dict(self) -> dict[str, Any]:
        """Blocks as [start, stop) runs: a shard of 36 blocks is one pair."""
        return {"blocks": [list(r) for r in runs(self.blocks)], "head": self.head}

    @classmethod
    def from_dict(cls, d: Any) -> Held:
        if not isinstance(d, dict) or not isinstance(d.get("blocks"), list):
            raise ValueError(f"held must be an object with a list of block runs, got {d!r:.80}")
        blocks: set[int] = set()
        for run in d["blocks"]:
            if not (isinstance(run, list) and len(run) == 2 and all(_is_int(x) for x in run)):
                raise ValueError(f"a held block run must be [start, stop), got {run!r:.40}")
            a, b = run
            if not 0 <= a < b <= MAX_BLOCKS:
                raise ValueError(f"held block run [{a}, {b}) is not within [0, {MAX_BLOCKS})")
            blocks.update(range(a, b))
        return cls(frozenset(blocks), bool(d.get("head", False)))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def runs(blocks: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted blocks as [start, stop) runs of consecutive indices."""
    out: list[tuple[int, int]] = []
    for b in sorted(blocks):
        if out and out[-1][1] == b:
            out[-1] = (out[-1][0], b + 1)
        else:
            out.append((b, b + 1))
    return out
