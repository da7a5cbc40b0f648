"""What the head and every other member share in the ring: liveness and the way a ring breaks.

A role sends everything to its next member through one outbox (so frames, frees and notices keep
their order), drains the next member's heartbeats where that link carries nothing else, and, when a
channel fails or a "broken" notice arrives, breaks once: it remembers why (a `RingBroken`), tells
whoever listens (`on_broken`), passes the notice on, and fails what it holds (`_lost`).

Besides its own links, two things break it: `lose(member, cause, detail)`, which the runtime calls
when another signal says a member is gone (the rendezvous's `member_left`), and its own stall: a
role whose process did not run for longer than the ring's bound (kafila.session.ring.liveness) was
counted lost by the others, so it breaks naming itself, and whatever it notices on waking (a late
deadline, a link the peer closed meanwhile) is said as that, never as a neighbour's fault.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kafila.api.service import GenerationError
from kafila.obs.log import get_logger
from kafila.proto import ring as rc
from kafila.proto import tensor as t
from kafila.proto.ring import Cause, RingBroken
from kafila.session.channel import DEFAULT_LOST_AFTER, Channel, ChannelError, Heartbeat, send_marked
from kafila.session.ring.info import RingInfo
from kafila.session.ring.liveness import TICK_S, StallWatch

if TYPE_CHECKING:
    from kafila.engine.stage import Stage

log = get_logger("kafila.session.ring")


class RoleBase:
    """The shared part of RingHead and RingMember; subclasses say what a break fails (`_lost`)."""

    info: RingInfo  # set by the subclass
    stage: Stage  # set by the subclass

    def __init__(self, name: str, next_ch: Channel | None, prev_ch: Channel | None) -> None:
        self.name = name
        self.next, self.prev = next_ch, prev_ch  # both None: the head of a ring of one
        beats = [c.dead_after for c in (next_ch, prev_ch) if isinstance(c, Heartbeat)]
        self.bound = min(beats, default=DEFAULT_LOST_AFTER)  # s: a member silent this long is lost
        self._stall = StallWatch(self.bound, time.monotonic())
        self.broken: RingBroken | None = None
        self.on_broken: Callable[[RingBroken], None] | None = None  # told once, e.g. the console
        self.ending = False  # the host ended the session on purpose: its ring breaking is no fault
        self.on_ended: Callable[[], None] | None = None  # told when a "broken" says the host ended it
        self._outbox: asyncio.Queue[t.Message] = asyncio.Queue()
        # plan epochs (kafila.session.forming.epochs): "serving", "replanning" (a lost member is being planned
        # around: requests are held, not failed), "ended"; the epoch serving; the last change and why
        self.state = "serving"
        self.epoch = 1
        self.change: dict[str, Any] | None = None
        self.ended_reason = ""
        # the runtime re-plans around this break (a member lost, not the host): hold, do not fail
        self.recovers: Callable[[RingBroken], bool] | None = None
        self.spares: list[str] | None = None  # the host's: members waiting as spares (/session)
        # the host's succession order for this epoch: who coordinates, first present first, should
        # the host be lost (kafila.planner.succession; /session shows it)
        self.succession: tuple[str, ...] = ()
        self.coordinator: Callable[[], str] | None = None  # who coordinates the session now (/session)

    @property
    def broken_text(self) -> str | None:
        """Why the ring is broken, as people read it (None: it is not)."""
        return None if self.broken is None else self.broken.text()

    @property
    def broken_fields(self) -> dict[str, Any] | None:
        """Why the ring is broken, for /session: the member it is about, the cause, what was seen,
        and whether that member is this one (counted lost by the others). None: it is not broken."""
        b = self.broken
        if b is None:
            return None
        mine = b.member == self.name
        return {"member": b.member, "cause": b.cause.value, "detail": b.detail, "this_member": mine}

    def _in_flight(self) -> int:
        """Requests a break fails here (for the log line)."""
        return 0

    def _lost(self, broken: RingBroken) -> None:
        """Fail what this role holds because the ring broke: a member the others counted lost
        (`broken` names it) tells its clients that the session goes on without it, and where."""
        self._fail_held("member_lost", self._broken_answer(broken))

    def _broken_answer(self, broken: RingBroken) -> str:
        """The error a request gets from this broken ring."""
        return self._left_out_text(broken) if broken.blames(self.name) else broken.text()

    def _left_out_text(self, broken: RingBroken) -> str:
        """What this member's clients are told when the others counted it lost (a frozen process
        that woke): the session goes on without it, on the members it knew, who the host re-plans
        over. (Its requests are not carried on: the new ring has no way back to it.)"""
        others = [n for n in self.info.order if n != self.name]
        on = f" on the other members ({', '.join(others)})" if others else ""
        return (
            f"{broken.detail}: the session goes on without this member{on}; send the request to one of them"
        )

    def _fail_held(self, code: str, message: str) -> None:
        """Fail every request this role holds (its own clients' and, at the head, everyone's)."""

    def _hold(self) -> None:
        """The ring broke and the runtime re-plans: keep every request; send nothing more."""

    def refuse_new(self) -> None:
        """GenerationError for a new request when this role cannot take one now: 503 with
        Retry-After while re-planning, 503 once the session ended or the ring broke for good."""
        if self.state == "replanning":
            raise GenerationError(
                "replanning", "the session is re-planning after losing a member; ask again in a few seconds"
            )
        if self.state == "ended":
            raise GenerationError("member_lost", self.ended_reason)
        if self.broken is not None:
            raise GenerationError("member_lost", self._broken_answer(self.broken))

    def document(self) -> dict[str, Any]:
        """The /session part every role shares: the ring, its state and plan epoch, the last change."""
        held = self.state in ("replanning", "ended")
        error = self.ended_reason if self.state == "ended" else None if held else self.broken_text
        doc = self.info.document(self.state, error, None if held else self.broken_fields)
        if self.state == "ended":
            doc["state"] = "ended"
        spares = {} if self.spares is None else {"spares": list(self.spares)}
        kv = {"used_bytes": self.stage.kv_bytes_used, "bytes": self.stage.kv_bytes}  # this member's stage
        order = {"succession": list(self.succession)} if self.succession else {}
        host = {"host": self.coordinator()} if self.coordinator is not None else {}
        return doc | {"epoch": self.epoch, "change": self.change, "kv": kv} | spares | order | host

    def changed(self, state: str, cause: str, **more: Any) -> None:
        """Record a change of state (and epoch) for /session, with its cause."""
        self.state = state
        self.change = {"at": time.time(), "state": state, "epoch": self.epoch, "cause": cause, **more}

    def _retire(self, *kept: Channel | None) -> None:
        """The role moves to the next epoch: its old channels stop beating (the next epoch's
        channels would drop their beats as stale; without this each re-plan left them beating on
        their links for the rest of the session). Channels the next epoch `kept` go on."""
        for c in (self.next, self.prev):
            if isinstance(c, Heartbeat) and all(c is not k for k in kept):
                c.stop()

    def go(self) -> None:
        """Every member runs the new epoch: send again (the head; a member only answers frames)."""

    def end(self, reason: str) -> None:
        """The session ended (the host said so): fail what is held with `reason`, take nothing new."""
        self.ended_reason = reason
        self.changed("ended", reason)
        self._fail_held("session_ended", reason)

    def lose(self, member: str, cause: Cause, detail: str) -> None:
        """Another signal than this role's links says `member` is gone (the rendezvous's
        `member_left`): break the ring now, naming it, so every request from now on gets the broken
        answer (503) at once rather than a failure later. A member of another ring, or this one
        itself, is no loss of this ring: ignored."""
        if member != self.name and member in self.info.order:
            self._break(RingBroken(member, cause, detail))

    def _counted_lost(self, stalled_s: float) -> RingBroken:
        """The break of a member whose process did not run for `stalled_s` s, past the bound."""
        return RingBroken(
            self.name,
            Cause.SILENT,
            f"this member ({self.name}) did not run for {stalled_s:.1f} s (its process was stopped, asleep "
            f"or swapping), longer than the ring's bound of {self.bound:g} s, so the other members "
            "counted it lost",
        )

    async def _watch_stall(self) -> None:
        """Notice this process's own stall past the bound, even when nothing else says it."""
        self._stall.last = time.monotonic()
        while True:
            await asyncio.sleep(TICK_S)
            stalled = self._stall.tick(time.monotonic())
            if stalled is not None:
                self._break(self._counted_lost(stalled))

    def _break(self, broken: RingBroken, tell: bool = True) -> None:
        """Break the ring once (a later break keeps the first reason); fail what is held either way."""
        if broken.cause is Cause.ENDED and not self.ending and self.on_ended is not None:
            self.on_ended()  # a neighbour's link closed as ended, or its notice says so: the host ended it
        if self.broken is None:
            stalled = self._stall.stall(time.monotonic())
            # "ended" is the view of a member that ends on purpose (the host ended the session): one
            # that is not ending passes on a closed link, so the notice goes round once, not again
            if self.ending:
                broken = RingBroken(broken.member, Cause.ENDED, broken.detail)
            elif broken.cause is Cause.ENDED:
                broken = RingBroken(broken.member, Cause.CLOSED, broken.detail)
            elif stalled is not None and broken.member != self.name:  # it is this member that was gone
                log.info("ring_break_after_stall", member=self.name, noticed=broken.detail)
                broken = self._counted_lost(stalled)
            self.broken = broken
            level = log.info if self.ending else log.error
            level(
                "ring_broken",
                member=self.name,
                about=broken.member,
                cause=broken.cause.value,
                reason=broken.detail,
                in_flight=self._in_flight(),
                ending=self.ending,
            )
            if self.on_broken is not None:
                self.on_broken(broken)
            if tell and self.next is not None:  # tell the members (those still reachable) why
                self._outbox.put_nowait(rc.control(broken))
            if self.recovers is not None and self.recovers(broken):
                self.changed("replanning", broken.text())
        if self.state == "replanning":
            self._hold()
        elif self.state != "ended":
            self._lost(self.broken)

    def _heard_broken(self, notice: t.Control, tell: bool) -> None:
        """A neighbour's "broken" notice: the ring is broken for the reason it gives."""
        try:
            broken = rc.RingBroken.parse(notice.body)
        except rc.RingMessageError as exc:
            peer = self.prev.peer if self.prev is not None else ""
            broken = RingBroken(peer, Cause.ERROR, f"an unreadable 'broken' notice from member {peer}: {exc}")
        self._break(broken, tell)  # an "ended" notice ends this member too (its host link may close later)

    def _internal_error(self, detail: str) -> None:
        """A loop of this role failed (kafila.session.ring.generation.guarded)."""
        self._break(RingBroken(self.name, Cause.ERROR, detail))

    async def _send_out(self) -> None:
        assert self.next is not None
        try:
            while True:
                await send_marked(self.next, await self._outbox.get(), self.prev)
        except ChannelError as exc:
            self._break(exc.broken(f"member {self.next.peer}: {exc}"))

    async def _watch_next(self) -> None:
        """The next member sends nothing on this link but its beats: hearing them (or not) tells
        whether it is alive, so a dead successor is noticed here too."""
        assert self.next is not None
        try:
            while True:
                await self.next.recv()
        except ChannelError as exc:
            self._break(exc.broken())
