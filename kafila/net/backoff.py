"""The reconnection schedule: capped exponential back-off with jitter (pure: the random draw is an input).

    schedule = Backoff()                      # 0.5 s doubling to 30 s, up to half of it drawn off
    delay = schedule.delay(attempt, random.random())

Attempt 1 waits about `base_s`, each next one `factor` times longer, never more than `cap_s`; the
jitter takes a random part of up to `jitter` of each wait off, so members that lost the
rendezvous at the same moment (it restarted) do not all come back in the same instant.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    base_s: float = 0.5  # the first wait (before jitter)
    cap_s: float = 30.0  # no wait is longer
    factor: float = 2.0  # each wait this many times the one before, up to the cap
    jitter: float = 0.5  # up to this fraction of a wait is drawn off at random

    def __post_init__(self) -> None:
        if not (math.isfinite(self.base_s) and 0 < self.base_s <= self.cap_s and math.isfinite(self.cap_s)):
            raise ValueError(
                f"back-off: need 0 < base_s <= cap_s, finite; got {self.base_s} and {self.cap_s}"
            )
        if not (math.isfinite(self.factor) and self.factor >= 1):
            raise ValueError(f"back-off: factor must be at least 1, got {self.factor}")
        if not 0 <= self.jitter < 1:
            raise ValueError(f"back-off: jitter must be in [0, 1), got {self.jitter}")

    def ceiling(self, attempt: int) -> float:
        """The wait before attempt `attempt` (1, 2, ...) without jitter."""
        if attempt < 1:
            raise ValueError(f"attempts count from 1, got {attempt}")
        if self.factor == 1:
            return self.base_s
        # past the cap once factor^(attempt-1) >= cap/base: no float overflow for any attempt
        if attempt - 1 >= math.log(self.cap_s / self.base_s, self.factor):
            return self.cap_s
        return min(self.cap_s, self.base_s * self.factor ** (attempt - 1))

    def delay(self, attempt: int, draw: float) -> float:
        """The wait before attempt `attempt`; `draw` is a uniform random number in [0, 1)."""
        if not 0 <= draw < 1:
            raise ValueError(f"draw must be in [0, 1), got {draw}")
        return self.ceiling(attempt) * (1 - self.jitter * draw)
