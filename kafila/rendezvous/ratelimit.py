"""Token buckets keyed by a string (source address, session code), and the exponential back-off of
addresses that failed; pure: callers pass `now`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class _Bucket:
    tokens: float
    stamp: float


class TokenBuckets:
    """`rate` tokens per second up to `burst`; `take(key, now)` spends one if available.

    A cost above `burst` (a datagram larger than one second's bytes) is taken from a full bucket and
    leaves it in debt, so it passes at the average rate instead of never.
    """

    def __init__(self, rate: float, burst: float, max_keys: int = 100_000) -> None:
        self.rate = rate
        self.burst = float(burst)
        self.max_keys = max_keys
        self._buckets: dict[str, _Bucket] = {}

    def _level(self, bucket: _Bucket, now: float) -> float:
        return min(self.burst, bucket.tokens + max(0.0, now - bucket.stamp) * self.rate)

    def take(self, key: str, now: float, cost: float = 1.0) -> bool:
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self.prune(now)
            bucket = self._buckets[key] = _Bucket(self.burst, now)
        bucket.tokens = self._level(bucket, now)
        bucket.stamp = now
        if bucket.tokens < min(cost, self.burst):
            return False
        bucket.tokens -= cost
        return True

    def retry_after(self, key: str, now: float, cost: float = 1.0) -> float:
        """Seconds until `take(key)` would succeed."""
        bucket = self._buckets.get(key)
        if bucket is None or self.rate <= 0:
            return 0.0 if bucket is None else float("inf")
        return max(0.0, (min(cost, self.burst) - self._level(bucket, now)) / self.rate)

    def prune(self, now: float) -> None:
        """Forget buckets that have refilled (they behave exactly like absent ones)."""
        full = [k for k, b in self._buckets.items() if self._level(b, now) >= self.burst]
        for key in full:
            del self._buckets[key]

    def __len__(self) -> int:
        return len(self._buckets)


@dataclass(slots=True)
class _Failures:
    count: int
    last: float


class Backoff:
    """Addresses that failed (a wrong proof), each waiting `base * 2^(n-1)` seconds (at most `cap`)
    after its n-th failure; one forgotten `memory` seconds after its last failure."""

    def __init__(self, base: float, cap: float, memory: float, max_keys: int = 100_000) -> None:
        self.base, self.cap, self.memory, self.max_keys = base, cap, memory, max_keys
        self._failed: dict[str, _Failures] = {}

    def failed_before(self, key: str, now: float) -> bool:
        entry = self._failed.get(key)
        return entry is not None and now - entry.last < self.memory

    def wait(self, key: str, now: float) -> float:
        """Seconds until `key` may be tried again (0 for one that never failed)."""
        entry = self._failed.get(key)
        if entry is None or now - entry.last >= self.memory:
            return 0.0
        return max(0.0, entry.last + min(self.cap, self.base * 2 ** (entry.count - 1)) - now)

    def fail(self, key: str, now: float) -> None:
        entry = self._failed.get(key)
        if entry is None or now - entry.last >= self.memory:
            if len(self._failed) >= self.max_keys:
                self.prune(now)
            if len(self._failed) < self.max_keys:  # memory stays bounded under any number of sources
                self._failed[key] = _Failures(1, now)
        else:
            entry.count, entry.last = min(entry.count + 1, 64), now

    def prune(self, now: float) -> None:
        for key in [k for k, e in self._failed.items() if now - e.last >= self.memory]:
            del self._failed[key]

    def __len__(self) -> int:
        return len(self._failed)
