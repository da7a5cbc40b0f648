"""Which wire versions a build speaks, and whether two builds can share a session (pure, no I/O).

Every protocol a member uses with others has a version of its own: the rendezvous' signaling, the
forming and epoch messages (`session`), the session terms, the ring's control messages, the tensor
records and the UDP datagrams. A build speaks a range of each (`SPEAKS`: oldest to newest; today
one version each). A running session speaks its host's versions; a member may join it when its
build speaks every one of them, whatever its kafila version: builds whose wire versions overlap
(adjacent releases that bumped none, or one that keeps the older version too) share a session.

A joiner whose session messages are of another version is refused by the host in the joiner's own
envelope (`refusal_in`): the `refused` message has kept its shape (`reason` only) in every
version, so a member of any version reads why, with both versions named.

`python -m kafila.proto.speaks` prints this build's `Build` as JSON (kafila-ops asks a new image or
a native host's interpreter this before it replaces a member).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kafila import __version__
from kafila.proto import ring, session, signaling, tensor, udp

# protocol -> (oldest, newest) version this build speaks
SPEAKS: dict[str, tuple[int, int]] = {
    "signaling": (signaling.VERSION, signaling.VERSION),
    "session": (session.SESSION_VERSION, session.SESSION_VERSION),
    "terms": (session.TERMS_VERSION, session.TERMS_VERSION),
    "ring": (ring.RING_VERSION, ring.RING_VERSION),
    "tensor": (tensor.VERSION, tensor.VERSION),
    "udp": (udp.VERSION, udp.VERSION),
}
NAMES = {
    "signaling": "signaling messages",
    "session": "session messages",
    "terms": "session terms",
    "ring": "ring-control messages",
    "tensor": "tensor records",
    "udp": "UDP datagrams",
}


class BuildError(ValueError):
    """A build description that does not parse; the message names the field."""


@dataclass(frozen=True)
class Build:
    """A kafila build: its package version and the range of each wire version it speaks."""

    kafila: str
    speaks: Mapping[str, tuple[int, int]]

    def running(self) -> dict[str, int]:
        """The versions a session this build hosts runs: the newest of each."""
        return {p: hi for p, (_lo, hi) in self.speaks.items()}

    def to_dict(self) -> dict[str, Any]:
        return {"kafila": self.kafila, "speaks": {p: list(r) for p, r in sorted(self.speaks.items())}}

    @classmethod
    def from_dict(cls, body: Any) -> Build:
        if not isinstance(body, Mapping) or set(body) != {"kafila", "speaks"}:
            raise BuildError(f"a build is an object of kafila and speaks, got {body!r:.200}")
        version, speaks = body["kafila"], body["speaks"]
        if not isinstance(version, str) or not version:
            raise BuildError(f"kafila must be a version text, got {version!r:.80}")
        if not isinstance(speaks, Mapping):
            raise BuildError(f"speaks must map protocols to [oldest, newest], got {speaks!r:.200}")
        ranges: dict[str, tuple[int, int]] = {}
        for name, r in speaks.items():
            if (
                not isinstance(r, list)
                or len(r) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in r)
                or r[0] > r[1]
            ):
                raise BuildError(f"speaks[{name!r}] must be [oldest, newest] versions from 1, got {r!r:.80}")
            ranges[str(name)] = (r[0], r[1])
        return cls(version, ranges)


THIS = Build(__version__, SPEAKS)


def _span(r: tuple[int, int]) -> str:
    return f"v{r[0]}" if r[0] == r[1] else f"v{r[0]}-v{r[1]}"


def cannot_join(session_build: Build, joiner: Build) -> list[str]:
    """Why `joiner` cannot join a session `session_build` hosts (it runs the newest of each of its
    versions): one line per protocol the joiner does not speak at that version, naming both
    builds and both versions; empty when it can."""
    problems = []
    for proto, version in sorted(session_build.running().items()):
        have = joiner.speaks.get(proto)
        if have is not None and have[0] <= version <= have[1]:
            continue
        theirs = "none" if have is None else _span(have)
        problems.append(
            f"{NAMES.get(proto, proto)}: the session (kafila {session_build.kafila}) runs v{version}, "
            f"kafila {joiner.kafila} speaks {theirs}"
        )
    return problems


def other_session_version(seen: int, ours: Build = THIS) -> str:
    """The reason a member whose session messages are version `seen` is refused by a host of
    build `ours`, naming both versions."""
    lo, hi = ours.speaks["session"]
    newer = "an older" if seen > hi else "a newer"
    return (
        f"this member speaks session messages v{seen}; the session's host (kafila {ours.kafila}) speaks "
        f"{_span((lo, hi))}: join with {newer} kafila that speaks v{hi}"
    )


def host_speaks_other(seen: int, ours: Build = THIS) -> str:
    """Why a member of build `ours` stops when the host's session messages are version `seen`."""
    return (
        f"the session's host speaks session messages v{seen}; this member (kafila {ours.kafila}) speaks "
        f"{_span(ours.speaks['session'])}: join with a kafila that speaks v{seen}"
    )


def refusal_in(seen: int, reason: str) -> dict[str, Any]:
    """A `refused` session message in version `seen`'s envelope (its shape is the same in every
    version), so a member of that version reads `reason`."""
    return {session.KEY: seen, "op": session.Refused.OP, "reason": reason[: session.MAX_REASON]}


def session_version_of(payload: Mapping[str, Any]) -> int | None:
    """The session-message version a signaling payload claims (None: not a session message)."""
    v = payload.get(session.KEY)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


if __name__ == "__main__":
    print(json.dumps(THIS.to_dict(), sort_keys=True))
