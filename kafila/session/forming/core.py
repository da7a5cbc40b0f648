"""Forming a session as two pure state machines: the host's side and a joining member's side.

No sockets, threads or clocks: the asyncio shell (kafila.session.start) feeds a machine what
happened (a member joined or left the session at the rendezvous, a session message arrived, one of
its own steps finished) together with `now` (seconds on any monotonic clock), and carries out what
the machine returns: progress lines for the person (`Say`), messages to send (`Send`), the next
step to take (`PlanNow`, `LinkNow`), a message it ignored (`Rejected`, naming why), the end of the
attempt (`Failed`) or success (`Formed`). Every input first checks the current deadline against
`now`: an event that arrives at or after the deadline finds the attempt already timed out.

    host:   NEW (measuring itself; members may join, be admitted and report) --start(own report)-->
            GATHERING --N reports, each admitted--> PLANNING --planned--> LINKING
            --started--> WAITING_READY --N-1 readies--> FORMED      (refuse / timeout / left: FAILED)
    member: start(own report) -> AWAITING_PLAN --plan--> LINKING --linked--> FETCHING
            --fetched--> STARTING --started--> CONFIRMING --formed--> FORMED
                                                                     (refused / timeout / left: FAILED)

A member's report counts only once the member is admitted: the host links with it as soon as it
joins (`Admit`; the link that will carry its weights), while both still measure themselves, and
the link's authentication proves that the member holds the session code's secret words. One that
does not (a mistyped word, or someone who found only the public part of the code) is refused and
removed from the session at the rendezvous (`Remove`) within a second or so of joining, not after
its probe, so a right member can still join with the same code; the others do not notice.

A member is formed only when the host says every member is ready (`formed`): a member that was
ready while another failed to start is told (`refused`, or the host or that member leaving) and
ends, instead of serving a ring that never formed.

Session messages travel as signaling payloads `{"kafila_session": 1, "op": ...}`, typed and parsed
strictly in kafila.proto.session:
`report` (member -> host: its DeviceReport), `plan` (host -> members: the Plan, member ids, model,
prefill chunk, queue limit, the session's dtype, compared divisions), `refused` (host -> members: the reason),
`ready` (member -> host), `formed` (host -> members: every member is ready), `failed` (member ->
host: why it cannot go on, e.g. its links did not authenticate; the host ends the attempt with it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from kafila.planner.devices import DeviceReport
from kafila.planner.plan import Plan
from kafila.planner.succession import succession_order
from kafila.proto import session as sm
from kafila.proto import speaks
from kafila.proto.session import KEY as KEY
from kafila.proto.session import SessionMessageError
from kafila.proto.session import payload as payload
from kafila.session.ring.origins import OriginBook


class FormationError(RuntimeError):
    """The shell called a step in a state that does not take it (a bug in the caller)."""


# ------------------------------------------------------------------ inputs


@dataclass(frozen=True)
class Joined:
    """A member entered the session at the rendezvous."""

    member: int
    name: str


@dataclass(frozen=True)
class Left:
    """A member left the session at the rendezvous ("left", "timed_out", "disconnected", "removed")."""

    member: int
    reason: str

    @property
    def went(self) -> str:
        """How it went, for a sentence: "beta {went} before the session formed"."""
        return _WENT.get(self.reason, f"left ({self.reason})")


_WENT = {
    "left": "left",
    "disconnected": "lost its connection to the rendezvous",
    "timed_out": "went silent at the rendezvous",
    "removed": "was removed by the host",
}


@dataclass(frozen=True)
class Message:
    """A session payload from `sender` (its `op` says which)."""

    sender: int
    body: dict[str, Any]


@dataclass(frozen=True)
class OtherVersion:
    """A session payload from `sender` in another session-message version than this member's
    (`version`): its body is not read (kafila.proto.speaks)."""

    sender: int
    version: int


Event = Joined | Left | Message | OtherVersion


# ------------------------------------------------------------------ outputs


@dataclass(frozen=True)
class Say:
    """A progress line for the person at the terminal."""

    text: str


@dataclass(frozen=True)
class Send:
    """Send `body` to member `to` over signaling."""

    to: int
    body: dict[str, Any]


@dataclass(frozen=True)
class Rejected:
    """An input that does not fit was ignored; `reason` names it (the shell logs it)."""

    member: int
    reason: str


@dataclass(frozen=True)
class Failed:
    """The attempt is over; `reason` is the one line the person reads."""

    reason: str
    host_left: bool = False  # a member's: the rendezvous said the host left


@dataclass(frozen=True)
class PlanNow:
    """Host: every member reported; plan over these devices (ids: device name -> member id)."""

    devices: tuple[DeviceReport, ...]
    ids: dict[str, int]


@dataclass(frozen=True)
class LinkNow:
    """Member: the host's plan arrived; link its edges and the control link to the host."""

    plan: Plan
    ids: dict[str, int]
    me: str
    host: str
    terms: sm.SessionTerms  # what the host decided: model, dtype, chunk, queue, ...
    alternatives: dict[str, Any] | None  # the divisions the host compared, for /session
    epoch: int = 1  # the plan epoch to start in (later than 1: joining a serving session)
    origins: dict[str, int] = field(default_factory=dict)  # request origin tags by name (the host's)
    succession: tuple[str, ...] = ()  # who coordinates, first present first, should the host be lost
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)  # every member's probe, by name


@dataclass(frozen=True)
class Admit:
    """Host: link with this member now (the control link its weights will come over); the link's
    authentication proves it holds the session's secret words. Report back with `admitted` or
    `not_admitted`."""

    member: int
    name: str  # its name at the rendezvous (its report may rename it)


@dataclass(frozen=True)
class Remove:
    """Host: remove this member from the session at the rendezvous (it was not admitted)."""

    member: int
    reason: str


@dataclass(frozen=True)
class Spared:
    """Member: the host keeps it as a spare (`reason`: why); its API relays to the host meanwhile."""

    host: int  # the host's member id
    reason: str


@dataclass(frozen=True)
class Formed:
    """Every member is ready (host) / the host confirmed that every member is ready (member)."""

    members: tuple[str, ...]


Output = Say | Send | Rejected | Failed | PlanNow | LinkNow | Admit | Remove | Spared | Formed


class Step(enum.Enum):
    NEW = "new"
    GATHERING = "gathering reports"
    PLANNING = "planning"
    AWAITING_PLAN = "awaiting the plan"
    LINKING = "linking"
    FETCHING = "fetching weights"
    STARTING = "starting"
    CONFIRMING = "waiting for the host to confirm"
    WAITING_READY = "waiting for ready members"
    FORMED = "formed"
    FAILED = "failed"


DONE = (Step.FORMED, Step.FAILED)
GATHERS = (Step.NEW, Step.GATHERING)  # the host's steps that take members' joins, admissions and reports


@dataclass
class _Machine:
    step: Step = Step.NEW
    deadline: float | None = None  # when the current step times out (None: no limit)
    now: float = 0.0  # the `now` of the latest input

    def _require(self, *steps: Step) -> None:
        if self.step not in steps:
            want = " or ".join(s.value for s in steps)
            raise FormationError(f"step taken while {self.step.value}; it needs {want}")

    def _fail(self, reason: str, out: list[Output] | None = None, host_left: bool = False) -> list[Output]:
        self.step, self.deadline = Step.FAILED, None
        return [*(out or []), Failed(reason, host_left)]

    def _expired(self, now: float) -> bool:
        return self.step not in DONE and self.deadline is not None and now >= self.deadline

    def _timed_out(self) -> list[Output]:
        raise NotImplementedError

    def tick(self, now: float) -> list[Output]:
        """The clock moved on: a step past its deadline fails with a message naming it."""
        self.now = now
        return self._timed_out() if self._expired(now) else []

    def handle(self, event: Event, now: float) -> list[Output]:
        """One thing that happened at the rendezvous or arrived from a member."""
        self.now = now
        if self._expired(now):
            return self._timed_out()
        if isinstance(event, OtherVersion):
            return self._other_version(event)
        if self.step in DONE:
            who = event.sender if isinstance(event, Message) else event.member
            return [Rejected(who, f"{type(event).__name__.lower()} after the session was {self.step.value}")]
        if isinstance(event, Joined):
            return self._joined(event)
        if isinstance(event, Left):
            return self._left(event)
        return self._message(event.sender, str(event.body.get("op")), event.body)

    def _joined(self, event: Joined) -> list[Output]:
        return []

    def _left(self, event: Left) -> list[Output]:
        raise NotImplementedError

    def _other_version(self, event: OtherVersion) -> list[Output]:
        raise NotImplementedError

    def _message(self, sender: int, op: str, body: dict[str, Any]) -> list[Output]:
        raise NotImplementedError


@dataclass
class HostFormation(_Machine):
    """The host's side: admits members as they join (also while it measures itself, before
    `start`), gathers N reports (its own at `start`), has the shell plan, sends the plan or the
    refusal, and waits for every other member's `ready` after its own ring has started."""

    members: int = 1  # N, the host included
    wait_s: float = 300.0  # how long to wait for the reports, and again for the readies
    host_id: int = 1
    host_name: str = ""  # known before its report: members that join meanwhile are named apart from it
    joined: dict[int, str] = field(default_factory=dict)  # member id -> name at the rendezvous
    devices: dict[int, DeviceReport] = field(default_factory=dict)  # member id -> its report
    ids: dict[str, int] = field(default_factory=dict)  # the plan's members: device name -> id
    admitted_ids: set[int] = field(default_factory=set)  # members whose link authenticated
    origins: OriginBook = field(default_factory=OriginBook)  # request origin tags, by member id
    removed: dict[int, str] = field(default_factory=dict)  # not admitted: removed at the rendezvous (names)
    ready: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        if self.host_name:
            self.joined[self.host_id] = self.host_name
            self.ids[self.host_name] = self.host_id

    @classmethod
    def taken_over(
        cls, host_id: int, host_name: str, ids: dict[str, int], origins: OriginBook
    ) -> HostFormation:
        """The formed session as a member that took over from its lost host holds it: `ids` the
        members present (this one among them), their tags in `origins`. Joins from now on are
        arrivals at a serving session (kafila.session.forming.arrivals), as for the host."""
        joined = {member: name for name, member in ids.items()}
        return cls(
            members=len(ids), host_id=host_id, host_name=host_name, joined=joined, ids=dict(ids),
            admitted_ids=set(joined), origins=origins, step=Step.FORMED,
        )  # fmt: skip

    def start(self, me: DeviceReport, now: float) -> list[Output]:
        self._require(Step.NEW)
        if self.host_name and me.name != self.host_name:
            raise FormationError(f"the host reported as {me.name!r}, not as {self.host_name!r}")
        self.joined[self.host_id] = me.name
        self.devices[self.host_id] = me
        self.ids[me.name] = self.host_id
        self.step, self.deadline, self.now = Step.GATHERING, now + self.wait_s, now
        return [*self._waiting(), *self._maybe_plan()]

    def _waiting(self) -> list[Output]:
        """What the host says once it has measured itself: whom it waits for, if anyone."""
        came, up_to = self._count(), f"up to {self.wait_s:g} s"
        if self.members == 1:
            return [Say("a session of one member: nobody to wait for")]
        if came == 1:
            return [Say(f"waiting for {self.members - 1} member(s) ({up_to})")]
        if came < self.members:  # some joined and reported while the host measured itself
            return [
                Say(f"{came}/{self.members} members joined; waiting for {self.members - came} more ({up_to})")
            ]
        return []

    def admitted(self, member: int, now: float) -> list[Output]:
        """The shell's link with `member` authenticated: its report counts."""
        if (late := self._check_admission(member, now)) is not None:
            return late
        self.admitted_ids.add(member)
        if member not in self.devices:  # still measuring itself
            return [Say(f"{self._name(member)} holds the session code; waiting for its report")]
        return [Say(f"{self._name(member)} joined ({self._count()}/{self.members})"), *self._maybe_plan()]

    def _count(self) -> int:
        """Members that reported and were admitted, the host included."""
        return 1 + sum(m in self.admitted_ids for m in self.devices if m != self.host_id)

    def not_admitted(self, member: int, why: str, now: float) -> list[Output]:
        """The shell's link with `member` failed (its code's secret words differ from the host's,
        or no path): refuse it and remove it from the session, and go on waiting for members."""
        if (late := self._check_admission(member, now)) is not None:
            return late
        name = self._name(member)
        self._forget(member)
        self.removed[member] = name
        reason = f"{name} was not admitted: {why}"
        told = (
            f"this member could not link with the host ({why}); join again with the exact code the "
            "host printed"
        )
        waiting = f"{self._count()}/{self.members} members joined"
        return [
            Send(member, sm.Refused(told).body()),
            Remove(member, reason),
            Say(f"{reason}; removed from the session, {waiting}"),
        ]

    def _check_admission(self, member: int, now: float) -> list[Output] | None:
        """None where `member`'s admission may be decided now, else what to return instead."""
        self.now = now
        if self._expired(now):
            return self._timed_out()
        if self.step not in GATHERS or member not in self.joined or member in self.admitted_ids:
            why = f"admission of member {member} while {self.step.value}"
            return [Rejected(member, why + ("" if member in self.joined else ", after it left"))]
        return None

    def _forget(self, member: int) -> None:
        """Drop `member`'s report (it left or was not admitted)."""
        self.joined.pop(member, None)
        self.admitted_ids.discard(member)
        self.ready.discard(member)
        device = self.devices.pop(member, None)
        if device is not None:
            del self.ids[device.name]

    def planned(
        self, plan: Plan, now: float, terms: sm.SessionTerms, alternatives: dict[str, Any] | None = None
    ) -> list[Output]:
        """The shell planned a feasible session: send it, with its terms, to every other member."""
        self._require(Step.PLANNING)
        host = next((n for n, i in self.ids.items() if i == self.host_id), self.host_name)
        origins, succession = self.origins.named(self.ids), succession_order(plan, host)
        probes = {d.name: d.to_dict() for d in self.devices.values()}
        body = sm.PlanMessage(
            plan.to_dict(),
            self.ids,
            terms,
            alternatives,
            origins=origins,
            succession=succession,
            probes=probes,
        ).body()
        self.step, self.deadline = Step.LINKING, None
        return [Send(m, body) for m in self._others()]

    def refuse(self, reason: str, now: float) -> list[Output]:
        """The shell found no feasible plan: tell every other member why, and fail with it."""
        self._require(Step.PLANNING)
        return self._refuse(reason, self._others())

    def link_failed(self, reason: str, now: float) -> list[Output]:
        """The host's own links to the plan's members failed (a member with a wrong secret word):
        tell the others why, and fail with it."""
        self._require(Step.LINKING)
        return self._refuse(reason, self._others())

    def started(self, now: float) -> list[Output]:
        """The host's own ring role is running: wait (up to wait_s) for the others' `ready`."""
        self.now = now
        if self._expired(now):
            return self._timed_out()
        self._require(Step.LINKING)
        self.step, self.deadline = Step.WAITING_READY, now + self.wait_s
        return self._maybe_formed()

    def handle(self, event: Event, now: float) -> list[Output]:
        if self.step is Step.FORMED and isinstance(event, Joined) and event.member not in self.joined:
            reason = "this session has formed and takes no more members; ask the host for a new session"
            told = f"{event.name} tried to join the formed session; told it takes no more members"
            return [Send(event.member, sm.Refused(reason).body()), Say(told)]
        return super().handle(event, now)

    def _others(self) -> list[int]:
        return [m for m in self.ids.values() if m != self.host_id]

    def _other_version(self, event: OtherVersion) -> list[Output]:
        """A member whose session messages are of another version: refused in its own envelope and
        removed at the rendezvous before anything is planned with it (in any step: a newcomer of a
        serving session too); the session goes on."""
        if event.sender in self.ids.values():
            return [
                Rejected(event.sender, f"session messages v{event.version} from {self._name(event.sender)}")
            ]
        name = self._name(event.sender)
        why = speaks.other_session_version(event.version)
        self._forget(event.sender)
        self.removed[event.sender] = name
        return [
            Send(event.sender, speaks.refusal_in(event.version, why)),
            Remove(event.sender, f"{name} was not admitted: {why}"),
            Say(f"{name} was not admitted: {why}"),
        ]

    def _refuse(self, reason: str, members: list[int]) -> list[Output]:
        """Fail with `reason`, telling `members` (so none waits out its own deadline)."""
        return self._fail(reason, [Send(m, sm.Refused(reason).body()) for m in members])

    def _name(self, member: int) -> str:
        device = self.devices.get(member)
        return (
            device.name if device else self.joined.get(member) or self.removed.get(member, f"member {member}")
        )

    def name_of(self, member: int) -> str:
        """Member `member`'s name as far as the host knows it ("member 7" if not)."""
        return self._name(member)

    def _timed_out(self) -> list[Output]:
        if self.step is Step.GATHERING:  # those who came are told, not left waiting for a plan
            arrived = [self.host_id, *(m for m in self.devices if m in self.admitted_ids - {self.host_id})]
            names = ", ".join(self._name(m) for m in arrived)
            others = [m for m in self.joined if m != self.host_id]
            checking = [self._name(m) for m in others if m not in self.admitted_ids]
            measuring = [self._name(m) for m in others if m in self.admitted_ids and m not in self.devices]
            still = f"; still linking with {', '.join(checking)}" if checking else ""
            still += f"; still measuring itself: {', '.join(measuring)}" if measuring else ""
            reason = (
                f"only {self._count()} of {self.members} members arrived within "
                f"{self.wait_s:g} s (joined: {names}{still}); ask the others to run `kafila join` "
                "with the code"
            )
            came = [m for m in self.joined if m != self.host_id]
            return self._refuse(reason, came)
        missing = ", ".join(self._name(m) for m in self._others() if m not in self.ready)
        return self._fail(
            f"only {len(self.ready)} of {self.members - 1} members became ready within {self.wait_s:g} s "
            f"(not ready: {missing})"
        )

    def _joined(self, event: Joined) -> list[Output]:
        if event.member in self.joined:
            return [Rejected(event.member, f"member {event.member} ({event.name}) joined twice")]
        taken = event.name in self.joined.values() or event.name in self.ids  # another member has it
        if self.step in GATHERS and len(self.joined.keys() | {self.host_id}) >= self.members:
            why = f"this session already has its {self.members} members"  # as the rendezvous says
            return [Send(event.member, sm.Refused(why).body()), Rejected(event.member, why)]
        self.joined[event.member] = event.name
        if self.step not in GATHERS:
            return []
        who = f"another member named {event.name} (member {event.member})" if taken else event.name
        return [
            Say(f"{who} connected; linking with it to check its session code"),
            Admit(event.member, event.name),
        ]

    def _left(self, event: Left) -> list[Output]:
        if event.member in self.removed:  # the rendezvous carried out our Remove
            del self.removed[event.member]
            return []
        if event.member not in self.joined:
            return [Rejected(event.member, f"member {event.member} left but never joined")]
        name = self._name(event.member)
        if event.member in self.ids.values() and self.step not in GATHERS:
            reason = (
                f"member {name} {event.went} before the session formed; the plan counted on it, so a "
                "new session is needed (the host runs `kafila host` again, everyone joins its new code)"
            )
            others = [m for m in self._others() if m != event.member]
            return self._refuse(reason, others)
        self._forget(event.member)
        return [Say(f"{name} {event.went}; {self._count()}/{self.members} members joined")]

    def _message(self, sender: int, op: str, body: dict[str, Any]) -> list[Output]:
        if sender not in self.joined:
            return [Rejected(sender, f"'{op}' from member {sender}, which is not in this session")]
        if op == "report":
            return self._report(sender, body)
        if op == "ready":
            try:
                sm.Ready.parse(body)
            except SessionMessageError as exc:
                return [Rejected(sender, f"unreadable ready from {self._name(sender)}: {exc}")]
            return self._ready(sender)
        if op == "failed" and sender in self._others() and self.step in (Step.LINKING, Step.WAITING_READY):
            try:
                why = sm.Failed.parse(body).reason
            except SessionMessageError as exc:
                why = f"failed (its reason unreadable: {exc})"
            reason = f"member {self._name(sender)} {why}"
            others = [m for m in self._others() if m != sender]
            return self._refuse(reason, others)
        return [Rejected(sender, f"unexpected '{op}' from {self._name(sender)}")]

    def _report(self, sender: int, body: dict[str, Any]) -> list[Output]:
        if sender in self.devices:
            return [Rejected(sender, f"duplicate report from {self._name(sender)}")]
        if self.step not in GATHERS:
            return [Rejected(sender, f"report from {self._name(sender)} after the plan was made")]
        try:
            device = DeviceReport.from_dict(sm.Report.parse(body).device)
        except (KeyError, TypeError, ValueError) as exc:
            return [Rejected(sender, f"unreadable report from member {sender}: {exc!r}")]
        renamed = ""
        if device.name in self.ids:  # two members of one name: the later one gets its id appended
            renamed = f" (as {device.name} is taken)"
            device = DeviceReport.from_dict({**device.to_dict(), "name": f"{device.name}-{sender}"})
        self.devices[sender] = device
        self.ids[device.name] = sender
        if sender not in self.admitted_ids:
            return [Say(f"{device.name} reported{renamed}; still linking with it to check its session code")]
        return [
            Say(f"{device.name} reported{renamed}: joined ({self._count()}/{self.members})"),
            *self._maybe_plan(),
        ]

    def _maybe_plan(self) -> list[Output]:
        if self.step is not Step.GATHERING or self._count() < self.members:
            return []
        self.step, self.deadline = Step.PLANNING, None
        # the host's report first, however early the others came: the planner anchors there (the
        # head stays with the host unless another member beats it by the head margin)
        devices = [self.devices[self.host_id], *(d for i, d in self.devices.items() if i != self.host_id)]
        return [PlanNow(tuple(devices), dict(self.ids))]

    def _ready(self, sender: int) -> list[Output]:
        name = self._name(sender)
        if self.step in (*GATHERS, Step.PLANNING):  # NEW too: the host is still measuring itself
            return [Rejected(sender, f"ready from {name} before the plan was sent")]
        if sender not in self._others():
            return [Rejected(sender, f"ready from {name}, which is not in the plan")]
        if sender in self.ready:
            return [Rejected(sender, f"duplicate ready from {name}")]
        self.ready.add(sender)
        out: list[Output] = [Say(f"{name} ready ({len(self.ready)}/{self.members - 1})")]
        return out + self._maybe_formed()

    def _maybe_formed(self) -> list[Output]:
        if self.step is not Step.WAITING_READY or len(self.ready) < len(self._others()):
            return []
        self.step, self.deadline = Step.FORMED, None
        return [*(Send(m, sm.AllReady().body()) for m in self._others()), Formed(tuple(self.ids))]


@dataclass
class MemberFormation(_Machine):
    """A joining member's side: sends its report, waits for the host's plan (or refusal), then is
    told by the shell when its links are up, its weights fetched and its ring role started, and
    finally tells the host it is ready. The weight fetch has no deadline (it shows progress and a
    large model takes long); waiting for the plan and linking do."""

    host_id: int = 1
    me_id: int = 2
    wait_s: float = 300.0  # how long to wait for the plan
    link_s: float | None = None  # how long linking may take (None: the links' own timeouts)
    ids: dict[str, int] = field(default_factory=dict)  # the plan's members, once it arrived
    name: str = ""  # the name this member reported (the host renames a second member of one name)

    def name_of(self, member: int) -> str:
        """Member `member`'s name once the plan named it; before, "the host" or "member 7"."""
        names = {m: n for n, m in self.ids.items()}
        return names.get(member, "the host" if member == self.host_id else f"member {member}")

    def start(self, me: DeviceReport, now: float) -> list[Output]:
        self._require(Step.NEW)
        self.name = me.name
        self.step, self.deadline = Step.AWAITING_PLAN, now + self.wait_s
        report = sm.Report(me.to_dict()).body()
        return [Send(self.host_id, report), Say("waiting for the host's plan")]

    def linked(self, now: float) -> list[Output]:
        return self._advance(Step.LINKING, Step.FETCHING, now)

    def fetched(self, now: float) -> list[Output]:
        return self._advance(Step.FETCHING, Step.STARTING, now)

    def started(self, now: float) -> list[Output]:
        """This member's ring role runs: tell the host, and wait (up to wait_s) for its `formed`."""
        out = self._advance(Step.STARTING, Step.CONFIRMING, now)
        if self.step is Step.CONFIRMING:
            self.deadline = now + self.wait_s
            out += [Send(self.host_id, sm.Ready().body()), Say("ready; waiting for the other members")]
        return out

    def _advance(self, here: Step, to: Step, now: float) -> list[Output]:
        self.now = now
        if self._expired(now):
            return self._timed_out()
        self._require(here)
        self.step, self.deadline = to, None
        return []

    def _timed_out(self) -> list[Output]:
        if self.step is Step.AWAITING_PLAN:
            return self._fail(f"no plan from the host within {self.wait_s:g} s")
        if self.step is Step.CONFIRMING:
            return self._fail(
                f"the host did not confirm the session within {self.wait_s:g} s of this member's ready"
            )
        return self._fail(f"the links of this session were not up within {self.link_s:g} s")

    def _other_version(self, event: OtherVersion) -> list[Output]:
        if event.sender != self.host_id:
            return [Rejected(event.sender, f"session messages v{event.version} from member {event.sender}")]
        return self._fail(speaks.host_speaks_other(event.version))

    def _left(self, event: Left) -> list[Output]:
        if event.member == self.host_id:
            return self._fail(f"the host {event.went} before the session formed", host_left=True)
        if event.member in self.ids.values():
            return self._fail(f"member {self.name_of(event.member)} {event.went} before the session formed")
        return []

    def _message(self, sender: int, op: str, body: dict[str, Any]) -> list[Output]:
        if sender != self.host_id:
            return [Rejected(sender, f"'{op}' from member {sender}, which is not the host")]
        if op == "refused":
            try:
                why = sm.Refused.parse(body).reason
            except SessionMessageError as exc:
                why = f"(its reason unreadable: {exc})"
            return self._fail(f"the host refused the session: {why}")
        if op == "formed" and self.step is Step.CONFIRMING:
            try:
                sm.AllReady.parse(body)
            except SessionMessageError as exc:
                return [Rejected(sender, f"an unreadable 'formed' from the host: {exc}")]
            self.step, self.deadline = Step.FORMED, None
            return [Formed(tuple(self.ids))]
        if op == "spare" and self.step is Step.AWAITING_PLAN:
            return self._spare(sender, body)
        if op != "plan":
            return [Rejected(sender, f"unexpected '{op}' from the host")]
        if self.step is not Step.AWAITING_PLAN:
            return [Rejected(sender, f"a second plan from the host while {self.step.value}")]
        return self._plan(body)

    def _spare(self, sender: int, body: dict[str, Any]) -> list[Output]:
        """The session serves without this member for now: it waits as a spare, with no deadline,
        for a plan (when a member is lost, or a later change makes it worth planning in)."""
        try:
            why = sm.Spare.parse(body).reason
        except SessionMessageError as exc:
            return [Rejected(sender, f"an unreadable 'spare' from the host: {exc}")]
        self.deadline = None
        return [
            Say(
                f"the host keeps this member as a spare ({why}); it is planned in when a member is "
                "lost or it would make the session faster"
            ),
            Spared(sender, why),
        ]

    def _plan(self, body: dict[str, Any]) -> list[Output]:
        try:
            msg = sm.PlanMessage.parse(body)
            plan, ids, terms = Plan.from_dict(msg.plan), msg.ids, msg.terms
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # SessionMessageError: a ValueError
            return self._fail(f"the host's plan is unreadable: {exc!r}")
        names = {m: n for n, m in ids.items()}
        if self.me_id not in names or self.host_id not in names:
            who = "this member" if self.me_id not in names else "the host"
            return self._fail(f"the host's plan leaves out {who}")
        self.ids = ids
        self.step = Step.LINKING
        self.deadline = None if self.link_s is None else self.now + self.link_s
        alternatives = msg.alternatives
        me, host = names[self.me_id], names[self.host_id]
        renamed = (
            [Say(f"this member is {me} in the session: {self.name} was taken")] if me != self.name else []
        )
        if me not in msg.origins:
            return self._fail(f"the host's plan gives this member ({me}) no request origin")
        return [
            *renamed,
            LinkNow(
                plan, ids, me, host, terms, alternatives, msg.epoch, msg.origins, msg.succession, msg.probes
            ),
        ]
