"""Who coordinates a session when its host is lost (pure: what each member knows and `now` in,
events out; the session's shell carries them out).

The host publishes a succession order with each plan epoch (kafila.proto.session's `succession`,
in `plan` and `epoch`): the plan's other members in ring order from the host's next member on
(`succession_order`). Every member therefore names its next coordinator in advance, with no
election and no message. When the coordinator is lost, the first member of the order still
present takes its role (`TakeOver`: re-plan over the survivors); every other survivor turns to
that member (`Follow`) and waits for its epoch. The successor says it is taking over within
`FIRST_NOTICE_S` of its start, and again every `NOTICE_S` while it links and fetches the blocks it
lacks (`working`: its `succeeding` notices, or its range requests to this member's disk): each
moves the wait's deadline to `wait_s` after it (`Waiting`). A successor silent for `wait_s` (no
epoch, no notice) counts as lost in its turn, and the next in the order is turned to. Nobody
left in the order, or survivors that cannot obtain every block (`shortfall`), ends the session
(`Ended`), naming what is missing. A coordinator that was counted lost (frozen past the ring's bound) and
wakes learns from a member or the rendezvous who coordinates now and ends saying so (`Replaced`).

    following c --c lost--> (first present in the order is me) coordinating: TakeOver
                         \\-> awaiting s (Follow, until now + wait_s)
    awaiting s --s's epoch--> following s
               --s's notice, or its range request--> awaiting s (Waiting, until now + wait_s)
               --s lost, or the deadline passes--> the next present in the order, as above
    any --nobody of the order left--> ended (Ended)
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from kafila.models.manifest import Manifest
from kafila.planner.plan import Plan

WAIT_S = 20.0  # a successor silent this long (no epoch, no notice) after the host's loss is passed over
NOTICE_S = 5.0  # a successor says it is taking over this often until its epoch goes out (well within WAIT_S)
FIRST_NOTICE_S = 1.0  # ... first this soon after it starts, unless its epoch went out by then


def succession_order(plan: Plan, host: str) -> tuple[str, ...]:
    """The members that follow `host` as coordinator: the plan's ring from the host's next member
    on, the host left out (a host outside the plan: the ring from its head)."""
    order = plan.order
    at = order.index(host) + 1 if host in order else 0
    return tuple(n for n in order[at:] + order[:at] if n != host)


@dataclass(frozen=True)
class TakeOver:
    """This member coordinates from now on: it re-plans over `survivors` (itself included) for the
    epoch after `epoch`, around `lost` (the coordinator, and whoever went with it)."""

    lost: tuple[str, ...]
    survivors: tuple[str, ...]
    epoch: int


@dataclass(frozen=True)
class Follow:
    """`coordinator` takes over from `lost`: link to it and wait for its epoch until `deadline`."""

    coordinator: str
    lost: tuple[str, ...]
    deadline: float


@dataclass(frozen=True)
class Waiting:
    """The awaited `coordinator` is at work taking over (`why`): wait for it until `deadline`."""

    coordinator: str
    deadline: float
    why: str


@dataclass(frozen=True)
class Ended:
    """The session cannot go on; `reason` says why, naming who or what is missing."""

    reason: str


@dataclass(frozen=True)
class Replaced:
    """This member coordinated, was counted lost, and `by` coordinates since epoch `epoch`."""

    by: str
    epoch: int
    line: str


@dataclass(frozen=True)
class Ignored:
    """An input that changes nothing (a stale epoch, a member already counted lost), and why."""

    why: str


Event = TakeOver | Follow | Waiting | Ended | Replaced | Ignored


@dataclass
class HandOff:
    """One member's view of who coordinates: the host that published the epoch held, the order
    that follows it, the epoch, who coordinates now (`coordinator`: the host, or its successor)
    and every member of that epoch this member has counted lost since."""

    me: str
    host: str  # the coordinator that published the epoch held
    succession: tuple[str, ...]
    members: frozenset[str]  # the epoch's members, the coordinator included
    epoch: int = 1
    wait_s: float = WAIT_S
    state: str = "following"  # "following", "awaiting", "coordinating", "ended", "replaced"
    gone: set[str] = field(default_factory=set)
    deadline: float | None = None  # awaiting: when the awaited successor is passed over
    coordinator: str = field(init=False)  # who coordinates now, or is awaited to

    def __post_init__(self) -> None:
        self.coordinator = self.host
        self.members = self.members | {self.host}
        self.state = "coordinating" if self.host == self.me else self.state

    def published(
        self, coordinator: str, succession: tuple[str, ...], members: Iterable[str], epoch: int
    ) -> Event:
        """The coordinator's new epoch: its order from now on. An epoch not newer than the one
        held is stale (a coordinator that was replaced still sending its own)."""
        if epoch <= self.epoch:
            return Ignored(f"epoch {epoch} from {coordinator} is not newer than epoch {self.epoch}")
        if self.state in ("ended", "replaced"):
            return Ignored(f"this member's part in the session is over ({self.state})")
        self.host = self.coordinator = coordinator
        self.succession, self.epoch = succession, epoch
        self.members = frozenset(members) | {coordinator}
        self.gone = {n for n in self.gone if n not in self.members}
        state = "coordinating" if coordinator == self.me else "following"
        self.state, self.deadline = state, None
        return Ignored(f"{coordinator} coordinates epoch {epoch}")

    def lost(self, member: str, now: float) -> Event:
        """`member` is gone (its links closed or went silent, or the rendezvous says it left)."""
        if self.state in ("ended", "replaced"):
            return Ignored(f"this member's part in the session is over ({self.state})")
        if member == self.me or member not in self.members or member in self.gone:
            return Ignored(f"{member} is not a member this one can lose now")
        self.gone.add(member)
        if member != self.coordinator:
            return Ignored(f"{member} is not the coordinator ({self.coordinator}): it re-plans around it")
        return self._next(now)

    def tick(self, now: float) -> Event:
        """Time passes: an awaited successor past its deadline is passed over."""
        if self.state != "awaiting" or self.deadline is None or now < self.deadline:
            return Ignored("nothing is due")
        waited = self.coordinator
        self.gone.add(waited)
        return self._next(now, f"{waited} sent no epoch and no word within {self.wait_s:g} s")

    def heard(self, coordinator: str, epoch: int, now: float) -> Event:
        """An epoch from `coordinator` arrived: the awaited successor took over; follow it."""
        if coordinator in self.gone:
            return Ignored(f"{coordinator} was counted lost; its epoch {epoch} is not followed")
        if self.state == "awaiting" and coordinator == self.coordinator:
            self.state, self.deadline = "following", None
            return Ignored(f"{coordinator} took over")
        return Ignored(f"epoch {epoch} from {coordinator}: {self.coordinator} coordinates")

    def working(self, coordinator: str, now: float, epoch: int | None = None, doing: str = "") -> Event:
        """`coordinator` says it is taking over from the host of `epoch` (its notice; None: a sign
        of life without one, such as its range request for a block this member holds): the
        awaited successor is alive, so its wait starts again from `now`."""
        if self.state != "awaiting":
            return Ignored(f"{coordinator} is at work, but this member awaits no successor ({self.state})")
        if epoch is not None and epoch != self.epoch:
            held = self.epoch
            return Ignored(f"{coordinator} takes over from epoch {epoch}; this member holds epoch {held}")
        if coordinator in self.gone:
            return Ignored(f"{coordinator} was counted lost; its notice does not bring it back")
        if coordinator != self.coordinator:
            return Ignored(f"{coordinator} is not the member awaited ({self.coordinator})")
        self.deadline = now + self.wait_s
        return Waiting(coordinator, self.deadline, doing or "at work")

    def told_replaced(self, by: str, epoch: int) -> Event:
        """A member or the rendezvous says `by` coordinates since `epoch`: a coordinator that was
        counted lost (frozen past the ring's bound) learns it was replaced and ends, truthfully."""
        if by == self.me:
            return Ignored("this member coordinates")
        if self.coordinator != self.me:
            return Ignored(f"this member does not coordinate ({self.coordinator} does)")
        if epoch <= self.epoch:
            return Ignored(f"epoch {epoch} of {by} is not newer than this member's epoch {self.epoch}")
        self.state = "replaced"
        line = (
            f"this member ({self.me}) was the session's host until epoch {self.epoch}, was counted lost "
            f"by the others, and {by} took over as the session's host in epoch {epoch}; this member ends "
            "(join the session again to come back as a member)"
        )
        return Replaced(by, epoch, line)

    def _next(self, now: float, why: str = "") -> Event:
        """The coordinator (or the awaited successor) is gone: turn to the first present in the order."""
        lost = tuple(n for n in (self.host, *self.succession) if n in self.gone)
        nxt = next((n for n in self.succession if n not in self.gone), None)
        if nxt is None:
            self.state = "ended"
            said = f" ({why})" if why else ""
            return Ended(
                f"the session's host {lost[0]} was lost and so was every member of its succession order "
                f"({', '.join(lost[1:]) or 'none'}){said}: nobody is left to coordinate the session"
            )
        self.coordinator = nxt
        if nxt == self.me:
            self.state, self.deadline = "coordinating", None
            survivors = tuple(n for n in self.succession if n not in self.gone)
            return TakeOver(lost, survivors, self.epoch)
        self.state, self.deadline = "awaiting", now + self.wait_s
        return Follow(nxt, lost, self.deadline)


@dataclass(frozen=True)
class Holding:
    """The blocks (and whether the head's tensors) a member can load without fetching: what it
    keeps, or every block where it holds the whole checkpoint."""

    blocks: frozenset[int]
    head: bool

    @classmethod
    def everything(cls, n_blocks: int) -> Holding:
        return cls(frozenset(range(n_blocks)), True)


@dataclass(frozen=True)
class Shortfall:
    """What no survivor holds: blocks, whether the head's tensors, and their bytes."""

    blocks: tuple[int, ...]
    head: bool
    bytes: int

    def text(self) -> str:
        parts = (
            [f"block{'s' if len(self.blocks) > 1 else ''} {block_ranges(self.blocks)}"] if self.blocks else []
        )
        if self.head:
            parts.append("the head's tensors (embedding, final norm, unembedding)")
        return f"{' and '.join(parts)} ({self.bytes / 1e6:.1f} MB)"


def shortfall(
    manifest: Manifest, holdings: Mapping[str, Holding], survivors: Iterable[str]
) -> Shortfall | None:
    """What the `survivors` cannot obtain among themselves (None: every block is held by one of
    them). A member with no entry in `holdings` holds nothing."""
    held: set[int] = set()
    head = False
    for name in survivors:
        h = holdings.get(name)
        if h is not None:
            held |= h.blocks
            head = head or h.head
    blocks = tuple(b for b in range(manifest.n_blocks) if b not in held)
    if not blocks and head:
        return None
    size = sum(manifest.block_bytes[b] for b in blocks) + (0 if head else manifest.head_resident_bytes)
    return Shortfall(blocks, not head, size)


def block_ranges(blocks: Iterable[int]) -> str:
    """Block indices as ranges: 0-2, 5, 7-8."""
    out: list[str] = []
    run: list[int] = []
    for b in sorted(set(blocks)):
        if run and b != run[-1] + 1:
            out.append(_run(run))
            run = []
        run.append(b)
    if run:
        out.append(_run(run))
    return ", ".join(out)


def _run(run: list[int]) -> str:
    return str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}"
