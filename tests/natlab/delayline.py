"""What a WAN edge does to packets, as a pure core: packets and `now` go in, the packets due by a
later `now` come out. Per edge (source node, destination node): a one-way delay, jitter (without
reordering unless asked), Bernoulli loss and a token-bucket rate cap with a drop-tail queue.
The TUN shell that feeds it real packets is tests/natlab/wanrouter.py."""

from __future__ import annotations

import heapq
import random
from collections.abc import Mapping
from dataclasses import dataclass, field

Edge = tuple[str, str]  # (source node, destination node)


@dataclass(frozen=True)
class Shape:
    """One direction of one edge. Times in seconds, `rate` in bytes per second (None: no cap)."""

    delay: float = 0.0  # one-way delay every packet is held for
    jitter: float = 0.0  # each packet's delay is drawn from delay +- jitter (never below 0)
    loss: float = 0.0  # probability that a packet is dropped
    rate: float | None = None  # token-bucket rate cap
    burst: int = 64 * 1024  # bucket depth in bytes
    queue: int = 4 * 1024 * 1024  # bytes waiting for tokens before new packets are dropped
    reorder: bool = False  # jitter may reorder packets (False: released in arrival order)

    def __post_init__(self) -> None:
        if self.delay < 0 or self.jitter < 0:
            raise ValueError(f"delay {self.delay} s and jitter {self.jitter} s must be >= 0")
        if not 0.0 <= self.loss <= 1.0:
            raise ValueError(f"loss {self.loss} must be within [0, 1]")
        if self.rate is not None and self.rate <= 0:
            raise ValueError(f"rate {self.rate} bytes/s must be > 0 (or None for no cap)")


@dataclass
class EdgeCounts:
    passed: int = 0
    lost: int = 0  # dropped by the loss draw
    overflowed: int = 0  # dropped because the rate cap's queue was full
    bytes: int = 0  # bytes passed


@dataclass
class _EdgeState:
    last_release: float = float("-inf")  # when this edge's previous packet leaves
    depart: float = float("-inf")  # when the bucket lets the previous packet go
    tokens: float = 0.0
    stamp: float = float("-inf")  # when `tokens` was counted
    counts: EdgeCounts = field(default_factory=EdgeCounts)


class DelayLine:
    """Holds packets per edge; `push` takes one, `release` gives back those due, in order."""

    def __init__(self, shapes: Mapping[Edge, Shape], default: Shape, rng: random.Random) -> None:
        self.shapes, self.default, self.rng = dict(shapes), default, rng
        self._held: list[tuple[float, int, bytes]] = []
        self._seq = 0
        self._edges: dict[Edge, _EdgeState] = {}

    def reshape(self, shapes: Mapping[Edge, Shape], default: Shape) -> None:
        """New shapes for packets pushed from now on (held packets keep their release times)."""
        self.shapes, self.default = dict(shapes), default

    def shape(self, edge: Edge) -> Shape:
        return self.shapes.get(edge, self.default)

    def counts(self, edge: Edge) -> EdgeCounts:
        return self._state(edge).counts

    def edges(self) -> list[Edge]:
        """Every edge that has seen a packet."""
        return list(self._edges)

    def _state(self, edge: Edge) -> _EdgeState:
        if edge not in self._edges:
            self._edges[edge] = _EdgeState()
        return self._edges[edge]

    def push(self, packet: bytes, edge: Edge, now: float) -> bool:
        """Take one packet that arrived at `now`; False when the edge drops it."""
        shape, st = self.shape(edge), self._state(edge)
        if shape.loss and self.rng.random() < shape.loss:
            st.counts.lost += 1
            return False
        sent = self._bucket(st, shape, len(packet), now)
        if sent is None:
            st.counts.overflowed += 1
            return False
        delay = shape.delay
        if shape.jitter:
            delay = max(0.0, delay + self.rng.uniform(-shape.jitter, shape.jitter))
        at = sent + delay
        if not shape.reorder:
            at = max(at, st.last_release)
        st.last_release = at
        st.counts.passed += 1
        st.counts.bytes += len(packet)
        self._seq += 1
        heapq.heappush(self._held, (at, self._seq, packet))
        return True

    @staticmethod
    def _bucket(st: _EdgeState, shape: Shape, size: int, now: float) -> float | None:
        """When the rate cap lets a `size`-byte packet go (now without a cap); None: queue full."""
        if shape.rate is None:
            return now
        start = max(now, st.depart)
        if (start - now) * shape.rate > shape.queue:
            return None
        tokens = shape.burst if st.stamp == float("-inf") else st.tokens + (start - st.stamp) * shape.rate
        tokens = min(float(shape.burst), tokens)
        if tokens < size:
            start += (size - tokens) / shape.rate
            tokens = float(size)
        st.tokens, st.stamp, st.depart = tokens - size, start, start
        return start

    def next_due(self) -> float | None:
        """When the earliest held packet is due (None: nothing held)."""
        return self._held[0][0] if self._held else None

    def release(self, now: float) -> list[bytes]:
        """The held packets due by `now`, earliest first (ties in arrival order)."""
        out = []
        while self._held and self._held[0][0] <= now:
            out.append(heapq.heappop(self._held)[2])
        return out

    def __len__(self) -> int:
        return len(self._held)
