"""Plan epochs after forming: the host re-plans when a member is lost, and every survivor moves to
the next epoch with the requests in flight carried on. kafila.planner.replan decides (pure); this
shell acts on its decision over the host's control links (kafila.proto.session's epoch messages,
one link message kind of their own, handed over as they arrive: `Link.handlers`).

    host                                          survivor
    its ring breaks naming m, or a survivor
    says `lost` -> replan.on_lost(...)
      End: `ended` (the planner's refusal)  ->    says it, fails what it holds, ends
      Replan: pause the head (requests held) ->   (its ring broke too: paused, requests held)
      `epoch` (plan, cause) to each survivor ->   pause; link the new ring edges (as at forming);
      link its new edges, serve weights,          fetch the tensors it lacks (cache first, then
      load its new stage                          the host); load its stage; start its role
                                             <-   `epoch_ready`
      every survivor ready: resume the head: each request admitted is prefilled again with its
      prompt and the tokens it has (its sampler kept), queued ones keep their places
      `resume`                               ->   serving

A member lost while a re-plan runs abandons it (kafila.planner.moves): the host cancels its move,
decides again over everyone left and sends the epoch after the abandoned one; a survivor that was
moving (or had moved) to the abandoned epoch cancels that and moves to the newer one, and every
message of an older epoch is dropped.

The head stays where it is while present: a re-plan keeps a present serving head
(plan(keep_head=True)). When its member is lost the plan puts it on a survivor, which becomes the
head (kafila.session.ring.promote) and takes the requests in flight from the members that
forwarded them, with the tokens their clients have had. A path that changes while
serving and holds (kafila.session.forming.paths) is re-priced the same way, and re-planned when that
is more than the head margin faster.
A lost host's role passes to the first present member of the succession order it published with
the epoch (kafila.session.forming.takeover), which becomes the `HostEpochs` of the session and
re-plans around it; a host stopped on purpose ends the session (its links close as ended). A host
that hands over (`HostEpochs.hand_over`: SIGUSR1, kafila.cli.host) takes no new request at its
API, lets the ones it answers end, pauses its role, tells every member `handover` (each counts it
gone at once, and the first present of the order takes over as from a lost host) and leaves as a
member does: its links close as leaving, not as ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from kafila.engine.stage import Stage
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from kafila.models.manifest import Manifest
from kafila.net.errors import LinkError
from kafila.net.link import Link
from kafila.net.waits import wait_at_most
from kafila.obs import metrics
from kafila.obs.log import get_logger
from kafila.obs.trace import ReplanRecord, TraceLog
from kafila.planner import moves
from kafila.planner.decide import as_planned, measured
from kafila.planner.devices import DeviceReport
from kafila.planner.drafting import MIN_CIRCUITS, CircuitCounts
from kafila.planner.plan import Plan
from kafila.planner.replan import End, Keep, Membership, PlanTerms, Replan, on_measured, with_path
from kafila.planner.succession import HandOff, Replaced, succession_order
from kafila.proto import session as sm
from kafila.proto.ring import Cause, RingBroken
from kafila.session.channel import Heartbeat, LinkChannel
from kafila.session.errors import SessionError
from kafila.session.forming.links import link_ring
from kafila.session.forming.paths import PathWatch
from kafila.session.progress import off_loop, say
from kafila.session.ring.build import EpochParts, Serving, broken_line, epoch_parts, shard_text
from kafila.session.ring.compute import ModelThread
from kafila.session.ring.head import RingHead
from kafila.session.ring.liveness import cut_off
from kafila.session.ring.member import RingMember
from kafila.session.ring.origins import OriginBook
from kafila.session.ring.promote import promoted
from kafila.session.runtime import MemberRuntime
from kafila.session.terms import Options
from kafila.session.weights.fetch import fetch_shard
from kafila.session.weights.server import WeightServer
from kafila.session.weights.sharing import where_from

log = get_logger("kafila.session.forming.epochs")
COUNTS_EVERY_S = 2.0  # a head on another member than the host tells it its decode counts this often

CONTROL_KIND = 33  # link message kind of the epoch messages (kafila.session.channel's ring is 32)
READY_S = 120.0  # a survivor that is not ready for the next epoch within this ends the session
REPLACED_WAIT_S = 10.0  # a host counted lost waits this long on waking for its successor's word
HAND_OVER_DRAIN_S = 30.0  # a host handing over gives the requests its own API answers this long to end
# a break that names a lost member (not an internal error, not the session ending)
LOST_CAUSES = (Cause.SILENT, Cause.CLOSED, Cause.LEFT, Cause.DISCONNECTED)


class Arrivals(Protocol):
    """What a move asks of the members arriving (kafila.session.forming.arrivals.HostArrivals,
    which imports this module, never the other way round)."""

    async def invite(self, name: str, decision: Replan) -> None:
        """`name` (a newcomer, or a spare planned in) gets the re-plan as its `plan`."""

    async def welcome(self, names: list[str]) -> None:
        """Every member is ready: the newcomers planned in serve."""


def lost_member(broken: RingBroken, plan: Plan, host: str, me: str) -> bool:
    """Whether a ring break names a member the host can re-plan around: one of the plan's, neither
    the host nor this member (`me`: a member frozen past the bound names itself, counted lost by
    the others), gone silent, closed, left or disconnected."""
    return broken.cause in LOST_CAUSES and broken.member in plan.order and broken.member not in (host, me)


async def _send(link: Link, msg: sm.EpochMessage) -> None:
    await link.send(CONTROL_KIND, sm.encode(msg))


def listen_to(link: Link, peer: str, on_message: Callable[[str, sm.EpochMessage], None]) -> None:
    """Hand `peer`'s epoch messages on `link` to `on_message` as they arrive."""

    def heard(data: bytes) -> None:
        try:
            msg = sm.parse_epoch(data)
        except sm.SessionMessageError as exc:
            log.warning("epoch_message_ignored", peer=peer, reason=str(exc))
            return
        on_message(peer, msg)

    link.handlers[CONTROL_KIND] = heard


async def _after(running: asyncio.Task[None] | None, work: Coroutine[Any, Any, None]) -> None:
    """Cancel the move `running` (if any), wait until it stopped, then do `work`."""
    if running is not None and not running.done():
        running.cancel()
        await asyncio.wait([running])
    await work


def _served(server: WeightServer, member: str) -> int:
    stats = server.stats.get(member)
    return 0 if stats is None else stats.bytes_sent


def _blocks(plan: Plan) -> dict[str, tuple[int, int]]:
    return {s.name: (s.start, s.stop) for s in plan.stages}


def _division(plan: Plan) -> str:
    return ", ".join(f"{s.name} {shard_text(s.start, s.stop, s.head)}" for s in plan.stages)


def _to_fetch(decision: Replan, host: str) -> int:
    """The fewest bytes the survivors must fetch from `host` for the new division: the host's own
    new blocks come from the checkpoint it serves, not over a link."""
    return sum(f.bytes for f in decision.fetches if f.member != host)


def _held(role: RingHead | RingMember) -> tuple[Stage, ModelThread]:
    """The stage `role` serves now and the thread that owns it: the next epoch's stage reuses the
    blocks it holds (Stage.rebuild); the role is paused meanwhile, so the thread is idle."""
    return role.stage, role.model


def _retire(parts: EpochParts) -> None:
    """An abandoned epoch's channels, built but never served: stop their heartbeats."""
    for channel in (parts.next, parts.prev):
        if isinstance(channel, Heartbeat):
            channel.stop()


def _formed(links: dict[str, Link], ids: dict[str, int]) -> dict[int, Link]:
    """The open links a move may reuse, by member id: only one to the member that now has that
    name (a member lost and back joins with a new id; the link to its old self, still open on
    the relay, would be taken for an edge linked, and no offer made to the new one)."""
    return {ids[p]: link for p, link in links.items() if not link.closed and str(ids.get(p)) == link.peer_id}


async def _resume(
    held: MemberRuntime,
    epoch: int,
    parts: EpochParts,
    plan: Plan,
    serving: Serving,
    ckpt: Checkpoint,
    origins: Mapping[str, int],
) -> int:
    """Start this member's role on the next epoch's parts (`origins`: every member's request
    origin tag, the host's); returns the requests the head carried on. A member the plan makes the
    head (the head's member was lost) becomes it (`promoted`): its role, and the service its API
    answers with, are the new head from now on."""
    role = held.ring()
    if isinstance(role, RingHead):
        carried = role.resume(epoch, parts.stage, parts.info, parts.next, parts.prev, parts.lanes, origins)
        role.plan = plan
        metrics.observe_ring(role.describe())  # every series of the ring, rebuilt for this epoch
        return carried
    if parts.index == 0:
        eos = (await off_loop(Tokenizer.from_checkpoint, ckpt)).stop_ids
        terms = serving.terms
        head = promoted(
            role, parts.stage, parts.info, parts.next, parts.prev, parts.lanes, tuple(eos),
            plan.concurrency, terms.chunk, terms.queue, origins,
        )  # fmt: skip
        head.epoch, head.plan = epoch, plan
        held.role = head
        if held.app is not None:
            held.app.state.api.service = head
        carried = head.carrying()
        metrics.observe_ring(head.describe())
        say(f"this member is the head from epoch {epoch} on: {carried} request(s) carried here")
        return carried
    if parts.next is None or parts.prev is None:
        raise SessionError(f"member {role.name} has no ring neighbour in epoch {epoch}")
    role.resume(epoch, parts.index, parts.stage, parts.info, parts.next, parts.prev)
    metrics.observe_ring(role.describe())
    return 0


@dataclass
class HostEpochs:
    """The host's side: keeps the membership, decides on each loss, leads every move."""

    held: MemberRuntime
    membership: Membership
    manifest: Manifest
    terms: PlanTerms
    ids: dict[str, int]  # member name -> member id (the link layer's)
    folder: Path  # the checkpoint the host loads from and serves
    server: WeightServer
    opts: Options
    serving: Serving
    traces: TraceLog | None = None
    probed: tuple[DeviceReport, ...] = ()  # the members' reports as they sent them (round trips)
    arrivals: Arrivals | None = None  # members joining the serving session (forming.arrivals)
    origins: OriginBook = field(default_factory=OriginBook)  # request origin tags, by member id

    def __post_init__(self) -> None:
        self._moving: moves.Move | None = None  # the re-plan in flight (kafila.planner.moves)
        self._ready: asyncio.Future[None] | None = None  # every member of it said it is ready
        self._job: asyncio.Task[None] | None = None
        self._ending = False  # the session ends (`_end`): no loss re-plans any more
        self._handing = False  # it hands its role over (`hand_over`)
        self._measured: dict[tuple[str, str], bool] = {}  # (a, b) -> its link runs direct, settled
        self._paths = PathWatch(lambda peer, direct: self.path(self.held.name, peer, direct))
        self._counts: tuple[str, sm.DecodeCounts] | None = None  # the head's last, where it is another member

    def start(self) -> None:
        """Listen to every member's control link and to the host's own ring breaking."""
        role = self.held.ring()
        role.recovers = lambda b: lost_member(b, self.membership.plan, self.membership.host, self.held.name)
        role.on_broken = self._broken
        role.succession = succession_order(self.membership.plan, self.membership.host)
        for peer, link in self.held.links.items():
            listen_to(link, peer, self._heard)
        self._paths.watch(self.held.links)
        if self.held.ended is None:  # a member that took over keeps the one its console waits on
            self.held.ended = asyncio.get_running_loop().create_future()
        self.held.on_lost = self._lost_while_moving
        self.held.hand_over = self.hand_over

    async def hand_over(self) -> None:
        """Hand the coordinating role over to the first present member of the succession order and
        leave: no new request at this member's API (503 with Retry-After), the ones it answers get
        HAND_OVER_DRAIN_S to end, the role pauses (the requests other members took are carried on by
        the next epoch, as after a loss), every member is told `handover`, and `ended` says so (the
        links then close as a member leaving: the session goes on). With nobody to take over, the
        session ends as on SIGTERM."""
        held = self.held
        if self._handing:  # a second SIGUSR1 while it hands over changes nothing
            return
        self._handing = True
        await self.idle()  # a re-plan running finishes first
        m = self.membership
        order = [n for n in succession_order(m.plan, m.host) if n in m.present and self._linked(n)]
        ended = held.ended
        if self._ending or not order:
            why = "the session is ending" if self._ending else "no other member of the plan is present"
            if ended is not None and not ended.done():
                ended.set_result(f"nobody to hand the session's host role over to ({why}): the session ends")
            return
        to = order[0]
        self._ending = True  # no loss or arrival re-plans from now on
        self._paths.close()
        left = await self._drain(to)
        role = held.ring()
        role.on_broken, role.recovers = None, None
        await role.pause()
        held.handed_to, held.host = to, to
        for peer in m.plan.order:
            if peer != held.name and self._linked(peer):
                with contextlib.suppress(LinkError):
                    await _send(held.links[peer], sm.HandOver(to, m.epoch))
        cut = (
            f"; {left} request(s) at its API did not end within {HAND_OVER_DRAIN_S:g} s and are cut"
            if left
            else ""
        )
        log.info("handed_over", to=to, epoch=m.epoch, cut=left)
        if ended is not None and not ended.done():
            ended.set_result(
                f"this member handed the session's host role over to {to} in epoch {m.epoch}{cut}; it "
                "leaves (join the session again with the same code to come back as a member)"
            )

    def priced(self) -> Membership:
        """The membership with its plan priced for the tokens per circuit the serving head measured
        (this member's, or the counts the head's member last told, `counted`), so a re-plan weighs
        times per token of that yield; plain figures until it counted MIN_CIRCUITS circuits."""
        m, role = self.membership, self.held.role
        if isinstance(role, RingHead):
            return replace(m, plan=measured(m.plan, role.counts, role.assumed_share()))
        if self._counts is None or self._counts[0] != m.plan.head:  # none yet, or a head since lost
            return replace(m, plan=as_planned(m.plan))
        c = self._counts[1]
        counts = CircuitCounts(c.circuits, c.drafted, c.accepted)
        return replace(m, plan=measured(m.plan, counts, c.row_share))

    def counted(self, peer: str, msg: sm.DecodeCounts) -> None:
        """The head's member `peer` told its decode counts: /session here prices the plan for them."""
        if peer != self.membership.plan.head:
            log.info("epoch_message_ignored", peer=peer, op=msg.OP, reason="not the serving head")
            return
        self._counts = (peer, msg)
        self._show_priced()

    def _show_priced(self) -> None:
        """/session on a host that is not the head: the plan's figures priced for what the head
        told ("chosen"), next to them as planned ("planned") and the counts ("decode")."""
        role = self.held.ring()
        if isinstance(role, RingHead) or self._counts is None:
            return  # the head's own document prices it; nothing told yet
        head, c = self._counts
        planned = as_planned(self.membership.plan)
        priced = self.priced().plan
        role.info.plan["chosen"] = priced.summary()
        role.info.plan["planned"] = planned.summary()
        role.info.plan["decode"] = {
            "head": head,
            "circuits": c.circuits,
            "drafted": c.drafted,
            "accepted": c.accepted,
            "row_share": c.row_share,
            "prices_plan": head == planned.head and c.circuits >= MIN_CIRCUITS,
        }

    def _linked(self, peer: str) -> bool:
        link = self.held.links.get(peer)
        return link is not None and not link.closed

    async def _drain(self, to: str) -> int:
        """This member's API takes no new request; returns how many it still answers after
        HAND_OVER_DRAIN_S (0: every one ended)."""
        drain = self.held.drain
        if drain is None:
            return 0
        drain.close(
            f"this member ({self.held.name}) hands the session's host role over to {to} and leaves: ask "
            "another member's API, or this one again once it has joined back"
        )
        say(
            f"handing the session's host role over to {to}: this member's API takes no new request; "
            f"the {drain.active} it answers get up to {HAND_OVER_DRAIN_S:g} s to end"
        )
        return await drain.drained(HAND_OVER_DRAIN_S)

    def _broken(self, broken: RingBroken) -> None:
        if lost_member(broken, self.membership.plan, self.membership.host, self.held.name):
            self.lost(broken.member, broken.cause.value, broken.detail)
            return
        if broken.blames(self.held.name) and len(self.membership.plan.order) > 1:
            order = ", ".join(succession_order(self.membership.plan, self.membership.host))
            say(
                f"{broken.text()}: the first present of this host's succession order ({order}) takes "
                "over; this member ends once it hears who did"
            )
            self.held.spawn(self._counted_lost(broken), "counted_lost")
            return
        say(broken_line(self.held.name, broken))

    async def _counted_lost(self, broken: RingBroken) -> None:
        """This host did not run past the ring's bound (frozen, asleep): the members counted it lost
        and its successor takes over. The successor's word (`replaced`) ends it; without that word
        within REPLACED_WAIT_S it ends all the same, saying what its succession order does."""
        ended = self.held.ended
        if ended is not None:
            with contextlib.suppress(TimeoutError):
                await wait_at_most(asyncio.shield(ended), REPLACED_WAIT_S)
                return
        if self._ending:
            return
        m, held = self.membership, self.held
        order = ", ".join(succession_order(m.plan, m.host))
        line = (
            f"{broken.detail}. The others re-plan without this host under the first present of its "
            f"succession order ({order}); no member answered it within {REPLACED_WAIT_S:g} s, so this "
            "member ends (join the session again to come back as a member)"
        )
        log.warning("host_counted_lost", detail=broken.detail)
        self._ending = True
        self._paths.close()
        held.left_out = True  # its links close as a member leaving: the session goes on without it
        held.host = next(iter(succession_order(m.plan, m.host)), held.host)
        await self._replaced(line)

    def _heard(self, peer: str, msg: sm.EpochMessage) -> None:
        if isinstance(msg, sm.MemberLost):
            if msg.member in self.membership.plan.order and msg.member != self.membership.host:
                self.lost(msg.member, msg.cause, msg.detail)
        elif isinstance(msg, sm.EpochReady):
            self.ready(peer, msg.epoch)
        elif isinstance(msg, sm.EpochFailed):
            self.failed(peer, msg.epoch, f"member {peer} could not move to epoch {msg.epoch}: {msg.reason}")
        elif isinstance(msg, sm.PathReport):
            self.path(peer, msg.peer, msg.direct)
        elif isinstance(msg, sm.DecodeCounts):
            self.counted(peer, msg)
        elif isinstance(msg, sm.Replaced):
            self.replaced(peer, msg.by, msg.epoch)
        else:
            log.warning("epoch_message_ignored", peer=peer, op=msg.OP, reason="not for the host")

    def replaced(self, peer: str, by: str, epoch: int) -> None:
        """`peer` says `by` coordinates the session since `epoch`: this host was counted lost (frozen
        past the ring's bound) and replaced. It ends saying so; its links close as a member
        leaving, so the session goes on (kafila.planner.succession decides whether it is true)."""
        m, held = self.membership, self.held
        if held.handed_to is not None:  # it handed its role over: the word is expected, nothing ends
            log.info("replaced_after_hand_over", by=by, epoch=epoch, told_by=peer)
            return
        view = HandOff(held.name, m.host, succession_order(m.plan, m.host), frozenset(m.plan.order), m.epoch)
        told = view.told_replaced(by, epoch)
        if not isinstance(told, Replaced):
            log.info("replaced_ignored", peer=peer, by=by, epoch=epoch, why=getattr(told, "why", ""))
            return
        log.warning("host_replaced", by=by, epoch=epoch, told_by=peer)
        self._ending = True
        self._paths.close()
        held.left_out, held.host = True, by  # its links close as a member leaving: the session goes on
        held.spawn(self._replaced(told.line), "replaced")

    async def _replaced(self, line: str) -> None:
        role = self.held.ring()
        await role.pause()
        role.ending, role.on_broken = True, None
        role.end(line)
        metrics.observe_state("ended")
        ended = self.held.ended
        if ended is not None and not ended.done():
            ended.set_result(line)

    def ready(self, peer: str, epoch: int | None = None) -> None:
        """`peer` is ready for `epoch` (None: the move in flight's; a newcomer's `ready` over
        signaling names none): once every member of the move is, it resumes."""
        at = epoch if epoch is not None else (self._moving.epoch if self._moving is not None else 0)
        moving = moves.on_ready(self._moving, peer, at)
        if moving is None:
            log.info("epoch_message_stale", peer=peer, op="epoch_ready", epoch=epoch)
            return
        self._moving = moving
        if not moving.waits_for(self.membership.host) and self._ready is not None and not self._ready.done():
            self._ready.set_result(None)

    def failed(self, peer: str, epoch: int | None, why: str) -> None:
        """`peer` cannot move to `epoch` (None: the move in flight's): that move fails, with `why`."""
        if epoch is not None and not moves.is_current(self._moving, epoch):
            log.info("epoch_message_stale", peer=peer, op="epoch_failed", epoch=epoch)
        elif self._ready is not None and not self._ready.done():
            self._ready.set_exception(SessionError(why))

    def moving_into(self, name: str) -> bool:
        """Whether the move in flight waits for `name` to say it is ready."""
        return self._moving is not None and name in self._moving.waits_for(self.membership.host)

    def path(self, a: str, b: str, direct: bool) -> None:
        """Member `a`'s link to `b` has settled on a path (kafila.session.forming.paths): re-price
        the ring with it now, or once a running re-plan is over. A link to a member lost (or not
        yet admitted) measures nothing about the ring: it is left out."""
        present = self.membership.present
        if a not in present or b not in present:
            return
        self._measured[(a, b) if a < b else (b, a)] = direct  # either end's latest word on the link
        self._show_path(a, b, direct)
        if not self.busy():
            self._reprice()

    def _show_path(self, a: str, b: str, direct: bool) -> None:
        """/session on the host shows a member's own measurement of its edge, not the plan's guess."""
        info = self.held.ring().info
        for key in (f"{a}->{b}", f"{b}->{a}"):
            if key in info.edges and info.measured_by.get(key) in (None, a):
                info.edges[key] = "direct" if direct else "relay"
                info.measured_by[key] = a

    def _reprice(self) -> None:
        """Fold every settled path into the members' reports; act on the planner's decision."""
        m = self.membership
        if self._ending:
            return
        reports, changed = m.reports, []
        for pair, direct in self._measured.items():
            got = with_path(reports, self.probed, pair, direct, self.terms.rule)
            if got is not None:
                reports = got
                changed.append(
                    f"{pair[0]}->{pair[1]} runs {'direct again' if direct else 'through the relay'}"
                )
        if not changed:
            return
        decision = on_measured(self.priced(), reports, self.manifest, self.terms, "; ".join(changed))
        log.info("plan_paths_measured", changed=changed, decision=type(decision).__name__)
        if isinstance(decision, Replan):
            self.membership = replace(m, reports=reports)
            self._moving = move = moves.Move(decision, frozenset(), time.monotonic())
            self._job = self.held.spawn(self._move(move), "replan")
        elif isinstance(decision, Keep):
            kept = as_planned(decision.plan)  # the head's counts price it anew
            self.membership = replace(m, reports=reports, plan=kept)
            self.held.plan = kept
            role = self.held.ring()
            role.info.plan["chosen"] = kept.summary()
            if isinstance(role, RingHead):
                role.plan = kept
            self._show_priced()
            say(f"plan corrected with the measured paths: {decision.reason}")

    def _lost_while_moving(self, member: str, cause: str, detail: str) -> None:
        """The rendezvous says `member` left while the ring is broken: a loss during a re-plan."""
        if self.busy():
            self.lost(member, cause, detail)

    def lost(self, member: str, cause: str, detail: str) -> None:
        """Member `member` is gone (`cause`, as `detail` says): re-plan around it, also when a
        re-plan is running already (that one is abandoned for the next epoch)."""
        if self._ending:
            return
        m, now = self.membership, time.monotonic()
        priced = self.priced()
        step = moves.on_loss(priced, self._moving, member, detail or cause, now, self.manifest, self.terms)
        if isinstance(step, moves.Ignored):
            log.info("member_lost_ignored", member=member, cause=cause, why=step.why)
            return
        log.warning("member_lost", member=member, cause=cause, detail=detail)
        if isinstance(step, Keep):
            say(step.reason)
            self.membership = replace(m, present=m.present - {member})
            return
        running, self._moving = self._job, step.move if isinstance(step, moves.Start) else None
        if isinstance(step, moves.Start) and step.abandoned is not None:
            say(f"{member} was lost during the move to epoch {step.abandoned}: that move is abandoned")
            log.warning("replan_abandoned", epoch=step.abandoned, member=member)
        self._ending = isinstance(step, End)  # set now: a later loss must not cancel the ending
        work = self._end(step.reason) if isinstance(step, End) else self._move(step.move)
        self._job = self.held.spawn(_after(running, work), "replan")

    async def _move(self, move: moves.Move) -> None:
        decision = move.decision
        try:
            await self._carry_out(move)
        except (SessionError, LinkError, TimeoutError, OSError, ValueError) as exc:
            why = "a survivor was not ready in time" if isinstance(exc, TimeoutError) else str(exc)
            await self._end(f"{decision.cause}; re-planning failed: {why}")

    async def _carry_out(self, move: moves.Move) -> None:
        """Move every member to `move`'s epoch; cancelled when another loss abandons it."""
        held, m, decision, lost_at = self.held, self.membership, move.decision, move.lost_at
        new = decision.plan
        role = held.ring()
        role.changed("replanning", decision.cause)
        metrics.observe_state("replanning")
        say(
            f"{decision.cause}: re-planning for epoch {decision.epoch}: {_division(new)} "
            f"(at least {_to_fetch(decision, held.name) / 1e6:.1f} MB to fetch)"
        )
        await role.pause()
        survivors = [n for n in new.order if n != held.name]
        arriving = [n for n in survivors if n not in m.plan.order]  # joined, or spares planned in
        self._ready = ready = asyncio.get_running_loop().create_future()
        if not move.waits_for(held.name):  # a ring of the host alone
            ready.set_result(None)
        sent_before = {n: _served(self.server, n) for n in survivors}
        origins = self.origins.named(self.ids)
        order = succession_order(new, held.name)
        probes = {r.name: r.to_dict() for r in m.reports}
        message = sm.NewEpoch(
            decision.epoch, new.to_dict(), decision.cause, dict(self.ids), origins, order, probes
        )
        for n in survivors:
            if n in arriving:
                await self._invite(n, decision)
            else:
                await _send(held.links[n], message)
        # weights go on the control links in the new epoch's records: what is left there of the
        # old epoch (frames the ring was carrying) is dropped undecoded (kafila.proto.epoch)
        channels = [LinkChannel(held.links[n], n, decision.epoch) for n in survivors]
        serves = [asyncio.ensure_future(self.server.serve(c)) for c in channels]
        parts: EpochParts | None = None
        try:
            node, code = held.node, held.code
            assert node is not None and code is not None
            formed = _formed(held.links, self.ids)
            links = await link_ring(node, new, held.name, self.ids, held.name, formed)
            held.links.update(links)
            for peer, link in links.items():
                listen_to(link, peer, self._heard)
            ckpt = Checkpoint.open(self.folder)
            parts = await epoch_parts(
                held.name, code, new, ckpt, links, self.opts, self.serving, decision.epoch, _held(role)
            )
            await wait_at_most(asyncio.shield(ready), READY_S)
        except asyncio.CancelledError:  # abandoned: the channels built for this epoch stop beating
            if parts is not None:
                _retire(parts)
            raise
        finally:
            for job in serves:
                if not job.done():
                    job.cancel()
        ready_s = time.monotonic() - lost_at
        fetched = sum(
            (self.server.stats[n].bytes_sent if n in self.server.stats else 0) - sent_before[n]
            for n in survivors
        )
        resumed = await _resume(held, decision.epoch, parts, new, self.serving, ckpt, origins)
        role = held.ring()  # the head now, where the head moved to the host
        role.succession = order
        head = isinstance(role, RingHead)
        first = role.first_token() if isinstance(role, RingHead) else None
        # the new epoch is in place: a loss from now on re-plans from it
        self.membership, self._moving = moves.committed(self.membership, move), None
        self._show_priced()
        held.plan = new
        carried = resumed if head else None  # only the head knows
        for n in survivors:
            with contextlib.suppress(LinkError):
                await _send(held.links[n], sm.Resume(decision.epoch))
        if arriving and self.arrivals is not None:
            await self.arrivals.welcome(arriving)
        role.changed("serving", decision.cause, lost_to_ready_s=round(ready_s, 3), bytes_fetched=fetched)
        role.go()  # a head sends again from now on: every member's new role is running
        metrics.observe_plan(decision.epoch)
        metrics.observe_state("serving")
        say(
            f"epoch {decision.epoch} serving: ring {' -> '.join(new.order)}; "
            + (f"{carried} request(s) carried on, " if carried is not None else "")
            + f"{fetched / 1e6:.1f} MB fetched, ready {ready_s:.1f} s after the change"
        )
        record = ReplanRecord(
            session=code.public,
            epoch=decision.epoch,
            cause=decision.cause,
            old_blocks=_blocks(m.plan),
            new_blocks=_blocks(new),
            bytes_fetched=fetched,
            bytes_minimum=_to_fetch(decision, held.name),
            ready_s=ready_s,
            carried=carried,
        )
        held.spawn(self._record_first_token(record, first, lost_at), "replan_record")
        self._paths.watch(held.links)  # the new epoch's links; paths settled meanwhile count now
        self._reprice()

    # ------------------------------------------------------------ members that arrive (forming.arrivals)

    def admit(self, name: str, member: int, link: Link) -> None:
        """`name` (member id `member`) joined the serving session and proved the code on `link`,
        its control link from now on; a name lost before is a member coming back, with a new
        request origin tag (OriginsSpent: none is left to give it)."""
        self.origins.tag(member)
        self.ids[name] = member
        self.held.links[name] = link
        listen_to(link, name, self._heard)
        if self.held.weights is not None:
            self.held.weights.attach({name: link})  # it may fetch ranges from this host

    def busy(self) -> bool:
        """A re-plan is running (a change waits for it)."""
        return self._job is not None and not self._job.done()

    async def idle(self) -> None:
        """Until no re-plan runs: one change at a time, and one may chain another (a loss while
        moving), so this waits for whichever job is current once the last ends."""
        while self.busy():
            assert self._job is not None
            await asyncio.wait([self._job])

    async def arrive(self, decision: Replan, at: float) -> None:
        """Move to `decision`, a re-plan that takes in a member that arrived (or ends the session
        if the move fails, as a loss's re-plan does; a loss meanwhile abandons it, as any move)."""
        self._moving = move = moves.Move(decision, frozenset(), at)
        self._job = asyncio.current_task()
        await self._move(move)

    async def _invite(self, name: str, decision: Replan) -> None:
        if self.arrivals is None:
            raise SessionError(f"the plan for epoch {decision.epoch} names {name}, which is not in the ring")
        await self.arrivals.invite(name, decision)

    async def _record_first_token(
        self, record: ReplanRecord, first: asyncio.Future[float] | None, lost_at: float
    ) -> None:
        """The trace's re-plan record, once the first token after the loss came (or 60 s passed;
        a host that is not the head does not see the tokens)."""
        with contextlib.suppress(TimeoutError):
            if first is not None:
                at = await wait_at_most(asyncio.shield(first), 60.0)
                record = replace(record, first_token_s=max(0.0, at - lost_at))
        log.info("replanned", **record.to_json())
        role = self.held.ring()
        if role.change is not None and record.first_token_s is not None:
            role.change["lost_to_first_token_s"] = round(record.first_token_s, 3)
        if self.traces is not None:
            self.traces.write(record)

    async def _end(self, reason: str) -> None:
        """The session ends: every member is told why, every request fails with it, the host stops."""
        self._ending = True
        self._paths.close()
        say(f"the session ends: {reason}")
        log.warning("session_ended", reason=reason)
        for peer in self.membership.plan.order:
            link = self.held.links.get(peer)
            if link is not None and not link.closed:
                with contextlib.suppress(LinkError):
                    await _send(link, sm.SessionEnded(reason))
        role = self.held.ring()
        await role.pause()
        role.end(reason)
        metrics.observe_state("ended")
        ended = self.held.ended
        if ended is not None and not ended.done():
            ended.set_result(f"the session ended: {reason}")


@dataclass
class MemberEpochs:
    """A survivor's side: tells the host what its ring saw, moves when the host says so."""

    held: MemberRuntime
    ids: dict[str, int]
    opts: Options
    serving: Serving
    local: list[Path] | None  # folders a shard may be loaded from as they are (None: the default)
    # what the host published with the epoch serving: request origin tags and every member's probe,
    # which this member needs should it take over as the host (kafila.session.forming.takeover)
    origins: dict[str, int] = field(default_factory=dict)
    probes: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._job: asyncio.Task[None] | None = None
        self._seen = 1  # the newest epoch this member serves or was told to move to
        self._paths = PathWatch(self._report_path)
        self._telling: asyncio.Task[Any] | None = None  # `_tell_counts`, from `start`
        # told when the ring breaks naming the host and the host published a succession order
        self.on_host_lost: Callable[[RingBroken], None] | None = None
        self.on_member_lost: Callable[[str], None] | None = None  # another member's loss, as said
        self.on_epoch: Callable[[str, int], None] | None = None  # an epoch arrived from a peer
        # a member of the succession order says it is taking over (its `succeeding` notice)
        self.on_succeeding: Callable[[str, sm.Succeeding], None] | None = None

    def start(self) -> None:
        held = self.held
        role = held.ring()
        plan = held.plan
        assert plan is not None
        role.recovers = lambda b: (
            held.plan is not None and (lost_member(b, held.plan, held.host, held.name) or self._host_lost(b))
        )
        role.on_broken = self._broken
        self._seen = max(self._seen, role.epoch)  # a member that joined a serving session starts later
        self._listen_all()
        self._watch_paths()
        self._telling = self.held.spawn(self._tell_counts(), "tell_decode_counts")

    def _listen_all(self) -> None:
        """Epoch messages on every link: the host's, and a successor's should the host be lost (a
        member that did not notice the loss itself hears of it by the successor's epoch)."""
        for peer, link in self.held.links.items():
            listen_to(link, peer, self._heard)

    def _watch_paths(self) -> None:
        """This member's links to other members (the host measures its own side of its links)."""
        self._paths.watch({p: link for p, link in self.held.links.items() if p != self.held.host})

    async def _tell_counts(self) -> None:
        """Where this member is the head (or becomes it in a later epoch), its decode counts to the
        host every COUNTS_EVERY_S while they changed, for the host to price its plan (`counted`)."""
        told: sm.DecodeCounts | None = None
        while True:
            await asyncio.sleep(COUNTS_EVERY_S)
            role, link = self.held.role, self.held.links.get(self.held.host)
            if not isinstance(role, RingHead) or link is None or link.closed:
                continue
            c = role.counts
            msg = sm.DecodeCounts(c.circuits, c.drafted, c.accepted, c.priced_share(role.assumed_share()))
            if msg != told:
                await self.tell(link, msg)
                told = msg

    def _report_path(self, peer: str, direct: bool) -> None:
        link = self.held.links.get(self.held.host)
        if link is not None and not link.closed:
            self.held.spawn(self.tell(link, sm.PathReport(peer, direct)), "tell_path")

    def _broken(self, broken: RingBroken) -> None:
        held = self.held
        if held.plan is not None and broken.blames(held.name):
            held.spawn(self._left_out(broken), "left_out")
            return
        isolated = self._cut_off(broken)
        if isolated is not None:  # not the neighbour's fault: every link went quiet at once
            held.spawn(self._left_out(isolated), "left_out")
            return
        if self._host_lost(broken) and self.on_host_lost is not None:
            metrics.observe_state("replanning")
            held.spawn(held.ring().pause(), "pause")
            self.on_host_lost(broken)  # its successor takes over (kafila.session.forming.takeover)
            return
        if held.plan is None or not lost_member(broken, held.plan, held.host, held.name):
            self._say_broken(broken)
            return
        say(f"{broken.text()}; waiting for the host's new plan")
        metrics.observe_state("replanning")
        if self.on_member_lost is not None:  # should the host be lost too, its successor plans around it
            self.on_member_lost(broken.member)
        link = held.links.get(held.host)
        if link is not None:
            lost = sm.MemberLost(broken.member, broken.cause.value, broken.detail)
            held.spawn(self.tell(link, lost), "tell_lost")
        held.spawn(held.ring().pause(), "pause")

    def _say_broken(self, broken: RingBroken) -> None:
        """Say the ring broke for good, unless the host ending the session explains the break (a
        neighbour's link that closed as ended breaks the ring as "ended": RingRole._break)."""
        ended = self.held.ended
        if ended is None or not ended.done():
            say(broken_line(self.held.name, broken))

    def _host_lost(self, broken: RingBroken) -> bool:
        """The break names the host, gone, and the host named who takes over (its succession order)."""
        held = self.held
        return (
            broken.member == held.host
            and broken.cause in LOST_CAUSES
            and held.name in held.ring().succession
            and self.on_host_lost is not None
        )

    def _took_over(self, peer: str, msg: sm.EpochMessage) -> bool:
        """An epoch from a member of the host's succession order: the host was lost and `peer`
        took over (this member may not have noticed the loss: its links to the host are not its
        ring edges). It coordinates from now on."""
        held = self.held
        if not isinstance(msg, sm.NewEpoch) or peer not in held.ring().succession or self.on_epoch is None:
            return False
        log.warning("host_replaced_by", host=held.host, by=peer, epoch=msg.epoch)
        say(f"{peer} took over as the session's host from {held.host} (the host's succession order)")
        held.host = peer
        return True

    def heard_from_host(self, peer: str, msg: sm.EpochMessage) -> None:
        """An epoch message from whoever coordinates (the host, or the successor that took over)."""
        self._heard(peer, msg)

    def stop(self) -> None:
        """This member coordinates from now on (it took over as the host): its member side ends."""
        self._paths.close()
        if self._telling is not None:
            self._telling.cancel()

    async def end_with(self, reason: str) -> None:
        """The session ends on this member for `reason` (no successor, or no weights to go on with)."""
        await self._ended_with(reason, f"the session ended: {reason}")

    def _cut_off(self, broken: RingBroken) -> RingBroken | None:
        """A neighbour gone silent while every link of this member is silent too (half the bound
        or more, the host's link included): this member's network went, and the others count it
        lost. The break that says so, naming this member (None: the neighbour is the one gone)."""
        held, role = self.held, self.held.ring()
        if broken.cause is not Cause.SILENT or held.plan is None:
            return None
        now = asyncio.get_running_loop().time()  # (links of members re-planned away are not asked)
        heard = {peer: link.last_heard for peer, link in held.links.items() if peer in held.plan.order}
        peers = cut_off(heard, now, role.bound / 2)
        if peers is None:
            return None
        quiet = now - max((t for t in heard.values() if t is not None), default=now)
        return RingBroken(
            held.name,
            Cause.SILENT,
            f"this member ({held.name}) heard nothing from any other member ({', '.join(peers)}) for "
            f"{quiet:.1f} s: its own network went (a cable cut, Wi-Fi gone), and past the ring's bound of "
            f"{role.bound:g} s the others counted it lost",
        )

    @staticmethod
    async def tell(link: Link, msg: sm.EpochMessage) -> None:
        with contextlib.suppress(LinkError):
            await _send(link, msg)

    def _heard(self, peer: str, msg: sm.EpochMessage) -> None:
        role = self.held.ring()
        if isinstance(msg, sm.Succeeding):  # from the successor, not (yet) the host: the hand-off judges it
            if self.on_succeeding is not None:
                self.on_succeeding(peer, msg)
            return
        if peer != self.held.host and not self._took_over(peer, msg):
            log.info("epoch_message_ignored", peer=peer, op=msg.OP, reason="not from the host")
            return
        if isinstance(msg, sm.NewEpoch):
            if not moves.newer(max(self._seen, role.epoch), msg.epoch):
                log.info("epoch_message_stale", peer=peer, op=msg.OP, epoch=msg.epoch, seen=self._seen)
                return
            if self.on_epoch is not None:
                self.on_epoch(peer, msg.epoch)
            self._seen, running = msg.epoch, self._job  # a newer epoch abandons the move running
            self._job = self.held.spawn(_after(running, self._move(msg)), "move")
        elif isinstance(msg, sm.Resume):
            if msg.epoch == role.epoch == self._seen:  # not an epoch a newer move abandoned
                role.changed("serving", role.change["cause"] if role.change else "re-planned")
                role.go()
                metrics.observe_state("serving")
                metrics.observe_plan(msg.epoch)
                plan = self.held.plan
                ring = " -> ".join(plan.order) if plan is not None else "?"
                say(f"epoch {msg.epoch} serving: ring {ring}")
        elif isinstance(msg, sm.SessionEnded):
            self.held.spawn(self._ended(msg.reason), "ended")
        elif isinstance(msg, sm.HandOver):
            self._handed_over(peer, msg)
        else:
            log.warning("epoch_message_ignored", peer=peer, op=msg.OP, reason="not for a member")

    def _handed_over(self, host: str, msg: sm.HandOver) -> None:
        """The host leaves on purpose and hands its role over: it counts as gone now (its links
        closing would say so a moment later), and the succession runs as for a lost host."""
        role = self.held.ring()
        detail = f"the host {host} handed its role over to {msg.to} in epoch {msg.epoch} and left"
        log.info("host_handed_over", host=host, to=msg.to, epoch=msg.epoch)
        if host in role.info.order and role.broken is None:
            role.lose(host, Cause.LEFT, detail)  # the ring breaks naming it: _broken runs the succession
            return
        broken = RingBroken(host, Cause.LEFT, detail)
        if self._host_lost(broken) and self.on_host_lost is not None:  # a host outside the ring
            metrics.observe_state("replanning")
            self.on_host_lost(broken)

    async def _ended(self, reason: str) -> None:
        await self._ended_with(reason, f"the host ended the session: {reason}")

    async def _ended_with(self, reason: str, line: str) -> None:
        """Fail what is held with `reason`, take nothing new, and end this member saying `line`."""
        self._paths.close()
        if self._job is not None and not self._job.done():  # a move the session will not serve
            self._job.cancel()
        role = self.held.ring()
        await role.pause()
        role.ending, role.on_broken = True, None  # the links closing now are the session ending
        role.end(reason)
        metrics.observe_state("ended")
        ended = self.held.ended
        if ended is not None and not ended.done():
            ended.set_result(line)

    async def _left_out(self, broken: RingBroken) -> None:
        """This member was counted lost (frozen or cut off past the bound): the host re-plans, or
        re-planned, around it, so its old ring serves nobody. It ends, saying so, rather than
        answer 503 for good; the survivors drop whatever its old epoch still sends."""
        why = broken.text()
        if not broken.detail.startswith(f"this member ({self.held.name})"):
            why += ": that is this member, whose process did not run in time, so the others counted it lost"
        reason = (
            f"{why}. The session goes on without this member (the host re-plans around a member it "
            "lost); this member ends: join the session again to come back"
        )
        self.held.left_out = True  # its links close as a member leaving: the session goes on
        await self._ended_with(reason, reason)

    async def _move(self, msg: sm.NewEpoch) -> None:
        held = self.held
        link = held.links[held.host]
        try:
            await self._move_to(msg)
        except Exception as exc:  # whatever it is, the host must hear it rather than wait for READY_S
            log.error("epoch_move_failed", epoch=msg.epoch, error=repr(exc), exc_info=exc)
            await self.tell(link, sm.EpochFailed(msg.epoch, f"{type(exc).__name__}: {exc}"))
            return
        await self.tell(link, sm.EpochReady(msg.epoch))
        self._listen_all()
        self._watch_paths()  # the new epoch's links

    async def _move_to(self, msg: sm.NewEpoch) -> None:
        held, name = self.held, self.held.name
        role = held.ring()
        role.changed("replanning", msg.cause)
        await role.pause()
        plan = Plan.from_dict(msg.plan)
        if msg.ids is not None:  # a member that joined is in the plan: its id, to link with it
            self.ids.update(msg.ids)
        if name not in plan.order:
            raise SessionError(f"the host's plan for epoch {msg.epoch} leaves {name} out")
        node, code = held.node, held.code
        assert node is not None and code is not None
        a, b = plan.block_range(name)
        head = plan.head == name
        say(f"{msg.cause}: moving to epoch {msg.epoch}, {shard_text(a, b, head)}")
        formed = _formed(held.links, self.ids)
        links = await link_ring(node, plan, name, self.ids, held.host, formed)
        held.links.update(links)
        sharing = held.weights
        if sharing is not None:
            sharing.attach(links)  # a newcomer may ask this member for what it holds
        channel = LinkChannel(links[held.host], held.host, msg.epoch)  # as the host serves it
        shard = await fetch_shard(
            channel,
            range(a, b),
            head,
            cache=self.opts.cache,
            local=self.local,
            label=name,
            progress=False,
            sources=[] if sharing is None else sharing.sources(links, held.host),
        )
        fetched = f"{shard.bytes_fetched / 1e6:.1f} MB fetched from {where_from(shard)}"
        say(f"weights for {shard_text(a, b, head)}: {fetched}")
        ckpt = Checkpoint.open(shard.path)
        opts, serving = self.opts, self.serving
        parts = await epoch_parts(name, code, plan, ckpt, links, opts, serving, msg.epoch, _held(role))
        held.plan = plan
        await _resume(held, msg.epoch, parts, plan, serving, ckpt, msg.origins)
        if sharing is not None:
            sharing.keep_replicas(plan, name, links, held.host)
        held.ring().succession = msg.succession  # the role of this epoch (the head, if promoted)
        self.origins, self.probes = msg.origins, msg.probes
