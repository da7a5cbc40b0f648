"""Whether this member's own process stopped running for longer than the ring's bound (pure).

A member frozen (SIGSTOP), asleep or swapping for longer than the bound (`--lost-after`) has been
counted lost by the others, who heard nothing from it meanwhile. When it runs again, whatever it
notices first (a deadline that fired late, a link the peer closed meanwhile, the others' "broken")
is about its own stall, not about a neighbour: the role asks `StallWatch.stall(now)` before it
blames anyone. The role's loop calls `tick(now)` every `tick_s`; a gap between ticks longer than
the bound plus one tick is a stall.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

TICK_S = 0.25  # how often the role's watch runs
RECENT_S = 5.0  # a stall that ended this recently still explains what the member notices now


@dataclass
class StallWatch:
    bound: float  # the ring's bound (s): a member silent this long is counted lost by the others
    last: float  # when the watch last ran
    tick_s: float = TICK_S
    stalled_s: float = 0.0  # the last stall longer than the bound, as measured between ticks
    woke_at: float | None = None  # when that stall ended

    def tick(self, now: float) -> float | None:
        """The watch ran at `now`: the stall that just ended, if longer than the bound (else None)."""
        gap, self.last = now - self.last, now
        if gap <= self.bound + self.tick_s:
            return None
        self.stalled_s, self.woke_at = gap, now
        return gap

    def stall(self, now: float) -> float | None:
        """A stall longer than the bound that explains what is noticed at `now`: one whose end the
        watch has not seen yet (it has not run since), or one that ended within RECENT_S."""
        gap = now - self.last
        if gap > self.bound + self.tick_s:
            return gap
        if self.woke_at is not None and now - self.woke_at <= RECENT_S:
            return self.stalled_s
        return None


def cut_off(heard: Mapping[str, float | None], now: float, quiet_s: float) -> tuple[str, ...] | None:
    """The peers this member heard nothing from for `quiet_s` at `now`, when that is every one of
    them and they are at least two (`heard`: peer -> when its link last heard it, None: never);
    else None. A neighbour gone silent while every other link is silent too, the host's included,
    says this member's own network went (its cable cut, its Wi-Fi gone): the others count it lost.
    With one peer (the host alone), its network and the host's going are the same to it."""
    if len(heard) < 2 or any(t is not None and now - t < quiet_s for t in heard.values()):
        return None
    return tuple(sorted(heard))
