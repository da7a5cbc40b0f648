"""Plan epochs in flight: what the host does when members are lost, also while it is already moving
the session to a new epoch (pure: the membership, the move in flight, a loss or an answer and `now`
in; the next step out; kafila.session.forming.epochs acts on it).

A loss while no move runs starts one (`replan.on_lost`). A loss while one runs abandons it: the next
decision is the same planner's over everyone present less every member lost since the epoch that
serves, and it moves the session to the epoch after the abandoned one, so whatever the abandoned
epoch still sends is stale everywhere (members accept only an epoch newer than any they have seen:
`newer`). Fetches are counted from the serving division, the one every survivor surely holds. If the
rest cannot hold the model, the session ends with the planner's refusal, which names the device, as
one loss does. A lost head moves like any other member's share: the planner, anchored at the host
where the serving head is gone, places the head anew, and the requests in flight are carried to it
by the members that forwarded them (kafila.session.ring: prompt and the tokens streamed so far,
prefilled again). A present head is never moved (the planner keeps it: `replan.keeps_head`).

    serving (epoch e) --loss--> Moving(e+1) --loss--> Moving(e+2) --...--> all ready: committed
                                    \\--------------------\\--> End (the rest cannot hold the model)
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from kafila.models.manifest import Manifest
from kafila.planner.fetching import after_plan
from kafila.planner.replan import End, Keep, Membership, PlanTerms, Replan, on_lost


@dataclass(frozen=True)
class Move:
    """A re-plan the host is carrying out: its decision, every member lost since the serving epoch
    (all planned around), when the first of those losses was noticed, and who said it is ready."""

    decision: Replan
    gone: frozenset[str]
    lost_at: float
    ready: frozenset[str] = frozenset()

    @property
    def epoch(self) -> int:
        return self.decision.epoch

    def waits_for(self, host: str) -> frozenset[str]:
        """The members of the new plan that must say they are ready (all but the host)."""
        return frozenset(self.decision.plan.order) - {host} - self.ready


@dataclass(frozen=True)
class Start:
    """Carry out `move`; `abandoned`: the epoch of the move it replaces (None: none was running)."""

    move: Move
    abandoned: int | None


@dataclass(frozen=True)
class Ignored:
    """Nothing to do: `member` is already planned around, or not one the host can lose."""

    why: str


Step = Start | Keep | End | Ignored


def on_loss(
    m: Membership,
    moving: Move | None,
    member: str,
    cause: str,
    now: float,
    manifest: Manifest,
    terms: PlanTerms,
) -> Step:
    """Member `member` stopped answering (`cause`), noticed at `now`; `moving`: the move in flight."""
    gone = moving.gone if moving is not None else frozenset()
    if member in gone:
        return Ignored(f"{member} is already planned around")
    if member not in {r.name for r in m.reports}:
        return Ignored(f"{member} is not a member of this session")
    if member not in m.present:
        return Ignored(f"{member} left earlier and is already planned around")
    base = m if moving is None else replace(m, epoch=moving.epoch, present=m.present - gone)
    decision = on_lost(base, member, cause, manifest, terms)
    if moving is not None:
        decision = _after(moving, decision)
    if isinstance(decision, Keep | End):
        return decision
    lost_at = now if moving is None else moving.lost_at
    abandoned = None if moving is None else moving.epoch
    return Start(Move(decision, gone | {member}, lost_at), abandoned)


def _after(moving: Move, decision: Replan | Keep | End) -> Replan | Keep | End:
    """A decision taken while `moving` ran, its cause told after the first one's."""
    if isinstance(decision, Replan):
        return replace(decision, cause=f"{moving.decision.cause}, then {decision.cause}")
    if isinstance(decision, End):
        return End(f"{moving.decision.cause}, then {decision.reason}")
    return decision


def on_ready(moving: Move | None, member: str, epoch: int) -> Move | None:
    """`member` says it is ready for `epoch`: the move with it counted, or None when that is not the
    move in flight (an abandoned epoch's answer, stale: dropped)."""
    if moving is None or epoch != moving.epoch or member not in moving.decision.plan.order:
        return None
    return replace(moving, ready=moving.ready | {member})


def is_current(moving: Move | None, epoch: int) -> bool:
    """Whether an answer about `epoch` (ready, failed) concerns the move in flight."""
    return moving is not None and moving.epoch == epoch


def committed(m: Membership, moving: Move) -> Membership:
    """The membership once every member of `moving` serves its epoch, its reports holding what
    that plan left on the members' disks (their shares and replicas; kafila.planner.fetching)."""
    new = moving.decision.plan
    return replace(
        m, epoch=moving.epoch, plan=new, present=m.present - moving.gone, reports=after_plan(m.reports, new)
    )


def newer(seen: int, epoch: int) -> bool:
    """A member's rule: move to `epoch` only when it is newer than every epoch it has seen (serving
    or half moved to); an older one is a stale message of an abandoned or past move."""
    return epoch > seen
