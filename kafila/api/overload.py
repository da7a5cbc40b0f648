"""How much of a member a client it does not know can hold: the API's limits and their bookkeeping.

A member's API shares its process, its event loop and its descriptors with the ring. Connections
that never send a request (or send it a byte at a time) held a descriptor each for good, and once
the descriptors ran out the loop spent itself failing to accept: the ring broke and a re-plan could
not open its files. The bounds, enforced by kafila.api.connections:

- at most `max_connections` open at once, fitted under the descriptor limit (`fitted`), so the
  ring, the weights and a re-plan always have descriptors left;
- at most `max_unauthenticated` of them before they show a key (before their request's headers
  are in, where no key is configured): a new connection past that closes the oldest such one
  once that one has had EVICT_AFTER_S to send them (else the new one is closed), so a client
  with a key gets in while idle connections pile up, and is not pushed out before its headers
  are read by connections accepted in the same burst;
- a request's headers must arrive within `read_timeout_s` of its connection (or of the answer
  before it on a kept-alive connection), and its body within as long again after them;
- what is shed is logged at most once per LOG_EVERY_S per kind (`Throttle`), with a count of
  what was left out.

This module is pure: sizes, the book of open connections and the throttle take `now` and return.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

DEFAULT_MAX_CONNECTIONS = 512
DEFAULT_MAX_UNAUTHENTICATED = 64
DEFAULT_READ_TIMEOUT_S = 10.0
# uvicorn's backlog: the listen queue, and also how many accepts asyncio tries per wake-up (each a
# logged error while descriptors are out); uvicorn's default 2,048 is more than the connections a
# member keeps at all
API_BACKLOG = 128
# descriptors never given to API connections: the ring's sockets, the rendezvous, model and weight
# files a re-plan opens, the trace and log files
DESCRIPTOR_RESERVE = 256
MIN_CONNECTIONS = 8  # the API's least, however low the descriptor limit
# an unauthenticated connection is not pushed out younger than this: asyncio accepts up to the
# backlog at one wake-up, before any of them is read, and a burst of idle ones accepted after a
# client's connection pushed it out before its headers (with its key) were read
EVICT_AFTER_S = 1.0
LOG_EVERY_S = 10.0

C = TypeVar("C", bound=Hashable)


@dataclass(frozen=True)
class ApiLimits:
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_unauthenticated: int = DEFAULT_MAX_UNAUTHENTICATED
    read_timeout_s: float = DEFAULT_READ_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.max_connections < 1 or self.max_unauthenticated < 1:
            raise ValueError(
                f"the API's connection limits must be at least 1, got --api-max-connections "
                f"{self.max_connections} and --api-max-unauthenticated {self.max_unauthenticated}"
            )
        if not self.read_timeout_s > 0:
            raise ValueError(f"--api-read-timeout must be above 0 seconds, got {self.read_timeout_s:g}")

    def fitted(self, descriptors: int | None, backlog: int = API_BACKLOG) -> ApiLimits:
        """These limits with no more connections than `descriptors` (the process's soft limit; None:
        unlimited) leave room for, after the accept backlog (accepted before the cap closes them)
        and DESCRIPTOR_RESERVE; at least MIN_CONNECTIONS; the unauthenticated ones at most all."""
        room = self.max_connections
        if descriptors is not None:
            room = min(room, max(descriptors - backlog - DESCRIPTOR_RESERVE, MIN_CONNECTIONS))
        return replace(self, max_connections=room, max_unauthenticated=min(self.max_unauthenticated, room))


DEFAULT_LIMITS = ApiLimits()


class ConnectionBook(Generic[C]):
    """The connections open on one API and which have not shown a key yet, oldest first."""

    def __init__(self, limits: ApiLimits) -> None:
        self.limits = limits
        self.open: set[C] = set()
        self.unauthenticated: dict[C, float] = {}  # -> when it opened; insertion order: the oldest first

    def admit(self, conn: C, now: float) -> tuple[bool, C | None]:
        """A new connection at `now`: (whether it is kept, the unauthenticated one it pushes out, if
        any). The oldest unauthenticated connection, once EVICT_AFTER_S old, makes room when those
        are at their cap, or when all connections are; else a new one past a cap is refused."""
        evicted = None
        full = len(self.open) >= self.limits.max_connections
        if self.unauthenticated and (full or len(self.unauthenticated) >= self.limits.max_unauthenticated):
            oldest, since = next(iter(self.unauthenticated.items()))
            if now - since < EVICT_AFTER_S:
                return False, None
            evicted = oldest
            self.forget(evicted)
        if len(self.open) >= self.limits.max_connections:
            return False, evicted
        self.open.add(conn)
        self.unauthenticated[conn] = now
        return True, evicted

    def authenticated(self, conn: C) -> None:
        self.unauthenticated.pop(conn, None)

    def forget(self, conn: C) -> None:
        self.open.discard(conn)
        self.unauthenticated.pop(conn, None)


class Throttle:
    """At most one report per `every_s`; the ones in between are counted, and the next report
    says how many were left out."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self.left_out = 0
        self._last: float | None = None

    def due(self, now: float) -> int | None:
        """None: leave this one out. Else report it, with the count left out since the last."""
        if self._last is not None and now - self._last < self.every_s:
            self.left_out += 1
            return None
        left_out, self.left_out, self._last = self.left_out, 0, now
        return left_out
