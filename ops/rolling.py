"""The order of a rolling upgrade (pure: what each member runs and what it should run in, the steps
out; kafila-ops' `fleet up` on a serving fleet carries them out, ops.upgrade.roll).

A member whose image (docker) or kafila version (native) differs from what the fleet now names
is replaced on its own: it leaves the session (which the host plans around), starts on the new
build and joins again (planned back in, or kept as a spare), and the session serves again before
the next one goes. Spares go first (nothing re-plans), then ring members from the ring's tail
towards its head (the head's requests are carried on last), and the member that coordinates the
session (its host) last: it hands its role over (SIGUSR1: the first present member of its
succession order takes over at once, and the session goes on), starts on the new build and joins
again with the session's code like any member. Nothing stops when any new build cannot join the
running session (kafila.proto.speaks), when the session cannot serve without a member that would
go, or when the host must go and has nobody to hand over to. A host whose build cannot hand over
(its /session names no `host`) is kept: `fleet down` then `fleet up` replaces it, a new session.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from kafila.proto.speaks import Build, cannot_join


@dataclass(frozen=True)
class Member:
    """One member as the operator's machine read it: what it runs and what the fleet names now
    (an image id for a docker member, a kafila version for a native one), and the build the new
    one is (None: not asked, as nothing changes)."""

    device: str
    site: str
    runtime: str
    running: str
    wanted: str
    new_build: Build | None = None

    @property
    def changes(self) -> bool:
        return self.running != self.wanted


@dataclass(frozen=True)
class Replace:
    """One step: `device` leaves, starts on `wanted` and joins again; `hand_over`: it coordinates
    the session and hands its role over to the first present member of `hand_over` (its
    succession order as read before the upgrade) before it goes."""

    device: str
    site: str
    runtime: str
    running: str
    wanted: str
    hand_over: tuple[str, ...] | None = None

    def describe(self) -> str:
        what = "image" if self.runtime == "docker" else "kafila"
        on = f"starts on {what} {_short(self.wanted)} (now {_short(self.running)})"
        where = f"{self.device} (site {self.site}, {self.runtime})"
        if self.hand_over is not None:
            return (
                f"{where}: the session's host: hands its role over to the first present of "
                f"{', '.join(self.hand_over)} and leaves, {on}, joins again with the session's code; the "
                "session serves under its successor throughout"
            )
        return f"{where}: leaves, {on}, joins again; the session serves again before the next"


@dataclass(frozen=True)
class Rollout:
    """The steps in order, the members left as they are and why, and why nothing may stop."""

    steps: tuple[Replace, ...]
    kept: tuple[tuple[str, str], ...]
    refused: tuple[str, ...]

    def describe(self) -> str:
        if self.refused:
            return "refused; nothing was stopped:\n  " + "\n  ".join(self.refused)
        lines = [f"{i}. {s.describe()}" for i, s in enumerate(self.steps, 1)] or ["nothing to replace"]
        return "\n".join(lines + [f"kept: {d}: {why}" for d, why in self.kept])


def _short(ident: str) -> str:
    return ident[:19] if ident.startswith("sha256:") else ident


def plan_rollout(
    members: Sequence[Member],
    session_host: str,
    ring: Sequence[str],
    session_build: Build,
    serves_without: Mapping[str, str | None],
    succession: Sequence[str] = (),
    hands_over: bool = True,
) -> Rollout:
    """The rolling upgrade of a serving session: `session_host` the member that coordinates it,
    `ring` its order (head first), `succession` the host's succession order, `session_build` what
    the host runs, `serves_without` per member None when the session can be planned without it,
    else why not, `hands_over` whether the host's build can hand its role over. Refused (no steps)
    when a member that changes could not join again or could not leave."""
    changing = [m for m in members if m.changes]
    kept = [(m.device, "runs what the fleet names") for m in members if not m.changes]
    refused: list[str] = []
    for m in changing:
        if m.new_build is None:
            refused.append(f"{m.device}: its new build's wire versions are unknown")
            continue
        refused += [f"{m.device}: {p}" for p in cannot_join(session_build, m.new_build)]
    host = next((m for m in changing if m.device == session_host), None)
    if host is not None and not hands_over:
        changing.remove(host)
        kept.append(
            (
                host.device,
                f"the session host keeps {_short(host.running)} (its build cannot hand its role over: "
                "`fleet down` then `fleet up` replaces it, a new session)",
            )
        )
        host = None
    if host is not None and not succession:
        refused.append(f"{host.device}: the session host has no succession order to hand its role over to")
    for m in changing:
        why = serves_without.get(m.device)
        if why is not None:
            refused.append(f"{m.device}: the session cannot serve while it is away: {why}")
    if refused:
        return Rollout((), tuple(kept), tuple(refused))
    position = {name: i for i, name in enumerate(ring)}
    # spares (not in the ring) first, then the ring from its tail towards its head, the host last
    order = sorted(
        changing,
        key=lambda m: (m is host, m.device in position, -position.get(m.device, 0), m.device),
    )
    steps = tuple(
        Replace(m.device, m.site, m.runtime, m.running, m.wanted, tuple(succession) if m is host else None)
        for m in order
    )
    return Rollout(steps, tuple(kept), ())
