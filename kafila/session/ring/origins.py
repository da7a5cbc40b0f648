"""Request identity: whose API took a request, for the session's whole life.

A request id is `tag << ORIGIN_SHIFT | n`: `tag` is the origin tag of the member whose API took
the request, `n` that member's own count. The host gives every member id one tag when it admits
it (at forming, or joining the serving session, spares too) and never gives a tag again, so a
member coming back under its old name (a new member id) gets a new tag, and no member ever takes
another's answers for its own however the ring is re-ordered. The head names the member that
asked by the tag. (Pure: no I/O.)
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from kafila.proto.session import MAX_ORIGIN, ORIGIN_BITS

ORIGIN_SHIFT = 32 - ORIGIN_BITS  # request ids are u32 on the ring (kafila.proto.tensor)
PER_ORIGIN = (1 << ORIGIN_SHIFT) - 1  # ids one member numbers before its count wraps (n from 1)


class OriginsSpent(ValueError):
    """Every origin tag was given: the session admits no other member."""


def origin_of(rid: int) -> int:
    return rid >> ORIGIN_SHIFT


class RequestIds:
    """One member's request ids: its tag, and 1, 2, ... (wrapping past PER_ORIGIN, never 0: an
    error of request id 0 is about the link, kafila.proto.tensor)."""

    def __init__(self, origin: int) -> None:
        if not 0 <= origin <= MAX_ORIGIN:
            raise ValueError(f"origin tag {origin} is outside 0 to {MAX_ORIGIN}")
        self.origin, self._n = origin, itertools.count(0)

    def next(self) -> int:
        return self.origin << ORIGIN_SHIFT | (next(self._n) % PER_ORIGIN + 1)


class OriginBook:
    """The host's: each member id's origin tag, from 1 up, given once and never again.

    The host gives the k-th tag to the k-th member id it admits, and the rendezvous gives member
    ids from 1 up and never again, so no tag ever given exceeds the highest member id given. A
    member taking over from a lost host knows the tags published with the last epoch, not those
    given since (a spare admitted, a newcomer being planned in): its book starts above `floor`,
    the highest member id it heard of, and so above every tag the lost host gave; its own tags
    keep the bound (each new one goes to a newer member id).
    """

    def __init__(self, given: Mapping[int, int] | None = None, floor: int = 0) -> None:
        self.tags: dict[int, int] = dict(given or {})  # member id -> its tag
        self._last = max([*self.tags.values(), floor])

    def tag(self, member: int) -> int:
        """Member id `member`'s tag: the one it was given, or the next never given."""
        if member not in self.tags:
            if self._last >= MAX_ORIGIN:
                raise OriginsSpent(
                    f"member id {member} cannot be admitted: all {MAX_ORIGIN} request origins of this "
                    "session were given to members that joined before"
                )
            self._last += 1
            self.tags[member] = self._last
        return self.tags[member]

    def named(self, ids: Mapping[str, int]) -> dict[str, int]:
        """The tags of `ids`' members (name -> member id), by name, each given if it was not."""
        return {name: self.tag(member) for name, member in ids.items()}


def first_origins(order: tuple[str, ...] | list[str]) -> dict[str, int]:
    """Tags of a ring made without a host (tests, one process): by first ring position."""
    return {name: i for i, name in enumerate(order)}
