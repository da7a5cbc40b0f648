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

The head stays where it is: the planner keeps the session's opener at the head while the model
fits with room (its throughput tier); a plan that would move the head ends the session, saying so.
A lost host ends the session (every member hears its links close as the host ends).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from kafila.models.manifest import Manifest
from kafila.net.errors import LinkError
from kafila.net.link import Link
from kafila.obs import metrics
from kafila.obs.log import get_logger
from kafila.obs.trace import ReplanRecord, TraceLog
from kafila.planner.plan import Plan
from kafila.planner.replan import End, Keep, Membership, PlanTerms, Replan, on_lost
from kafila.proto import session as sm
from kafila.proto.ring import Cause, RingBroken
from kafila.session.channel import LinkChannel
from kafila.session.errors import SessionError
from kafila.session.forming.links import link_ring
from kafila.session.progress import say
from kafila.session.ring.build import EpochParts, Serving, broken_line, epoch_parts, shard_text
from kafila.session.ring.compute import ModelThread
from kafila.session.ring.head import RingHead
from kafila.session.ring.member import RingMember
from kafila.session.runtime import MemberRuntime
from kafila.session.terms import Options
from kafila.session.weights.fetch import fetch_shard
from kafila.session.weights.server import WeightServer

if TYPE_CHECKING:
    from kafila.session.forming.arrivals import HostArrivals

log = get_logger("kafila.session.forming.epochs")

CONTROL_KIND = 33  # link message kind of the epoch messages (kafila.session.channel's ring is 32)
READY_S = 120.0  # a survivor that is not ready for the next epoch within this ends the session
# a break that names a lost member (not an internal error, not the session ending)
LOST_CAUSES = (Cause.SILENT, Cause.CLOSED, Cause.LEFT, Cause.DISCONNECTED)


def lost_member(broken: RingBroken, plan: Plan, host: str, me: str) -> bool:
    """Whether a ring break names a member the host can re-plan around: one of the plan's, neither
    the host nor this member (`me`: a member frozen past the bound names itself, counted lost by
    the others), gone silent, closed, left or disconnected."""
    return broken.cause in LOST_CAUSES and broken.member in plan.order and broken.member not in (host, me)


async def _send(link: Link, msg: sm.EpochMessage) -> None:
    await link.send(CONTROL_KIND, sm.encode(msg))


def _listen(link: Link, peer: str, on_message: Callable[[str, sm.EpochMessage], None]) -> None:
    def heard(data: bytes) -> None:
        try:
            msg = sm.parse_epoch(data)
        except sm.SessionMessageError as exc:
            log.warning("epoch_message_ignored", peer=peer, reason=str(exc))
            return
        on_message(peer, msg)

    link.handlers[CONTROL_KIND] = heard


_BACKGROUND: set[asyncio.Task[object]] = set()


def _spawn(work: Coroutine[Any, Any, object]) -> None:
    """Run `work` on its own, keeping a reference until it is done."""
    task = asyncio.ensure_future(work)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)


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


def _resume(role: RingHead | RingMember, epoch: int, parts: EpochParts) -> int:
    """Start `role` on the next epoch's parts; returns the requests the head carried on."""
    if isinstance(role, RingHead):
        return role.resume(epoch, parts.stage, parts.info, parts.next, parts.prev, parts.lanes)
    if parts.next is None or parts.prev is None:
        raise SessionError(f"member {role.name} has no ring neighbour in epoch {epoch}")
    role.resume(epoch, parts.index, parts.stage, parts.info, parts.next, parts.prev)
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
    arrivals: HostArrivals | None = None  # members joining the serving session (forming.arrivals)

    def __post_init__(self) -> None:
        self._ready: dict[str, asyncio.Future[None]] = {}
        self._job: asyncio.Task[None] | None = None
        self._gone: set[str] = set()

    def start(self) -> None:
        """Listen to every member's control link and to the host's own ring breaking."""
        role = self.held.ring()
        role.recovers = lambda b: lost_member(b, self.membership.plan, self.membership.host, self.held.name)
        role.on_broken = self._broken
        for peer, link in self.held.links.items():
            _listen(link, peer, self._heard)
        self.held.ended = asyncio.get_running_loop().create_future()

    def _broken(self, broken: RingBroken) -> None:
        if lost_member(broken, self.membership.plan, self.membership.host, self.held.name):
            self.lost(broken.member, broken.cause.value, broken.detail)
        else:
            say(broken_line(self.held.name, broken))

    def _heard(self, peer: str, msg: sm.EpochMessage) -> None:
        if isinstance(msg, sm.MemberLost):
            if msg.member in self.membership.plan.order and msg.member != self.membership.host:
                self.lost(msg.member, msg.cause, msg.detail)
        elif isinstance(msg, sm.EpochReady):
            ready = self._ready.get(peer)
            if ready is not None and not ready.done() and msg.epoch == self.membership.epoch + 1:
                ready.set_result(None)
        elif isinstance(msg, sm.EpochFailed):
            ready = self._ready.get(peer)
            if ready is not None and not ready.done():
                ready.set_exception(
                    SessionError(f"member {peer} could not move to epoch {msg.epoch}: {msg.reason}")
                )
        else:
            log.warning("epoch_message_ignored", peer=peer, op=msg.OP, reason="not for the host")

    def lost(self, member: str, cause: str, detail: str) -> None:
        """Member `member` is gone (`cause`, as `detail` says): re-plan, once per member."""
        if member in self._gone or (self._job is not None and not self._job.done()):
            return  # already known; a loss during a re-plan ends in its timeout or link failure
        self._gone.add(member)
        log.warning("member_lost", member=member, cause=cause, detail=detail)
        self._job = asyncio.ensure_future(self._replan(member, detail or cause, time.monotonic()))

    async def _replan(self, member: str, cause: str, lost_at: float) -> None:
        m = self.membership
        decision = on_lost(m, member, cause, self.manifest, self.terms)  # "b was lost (<cause>)"
        if isinstance(decision, Keep):
            say(decision.reason)
            self.membership = replace(m, present=m.present - {member})
            return
        if isinstance(decision, End):
            await self._end(decision.reason)
            return
        if decision.plan.head != m.plan.head:
            await self._end(
                f"{decision.cause}; the new plan moves the head from {m.plan.head} to {decision.plan.head}, "
                "which this version cannot do with requests in flight"
            )
            return
        try:
            await self._move(decision, lost_at)
        except (SessionError, LinkError, TimeoutError, OSError, ValueError) as exc:
            why = "a survivor was not ready in time" if isinstance(exc, TimeoutError) else str(exc)
            await self._end(f"{decision.cause}; re-planning failed: {why}")

    async def _move(self, decision: Replan, lost_at: float) -> None:
        held, m, new = self.held, self.membership, decision.plan
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
        loop = asyncio.get_running_loop()
        self._ready = {n: loop.create_future() for n in survivors}
        sent_before = {n: _served(self.server, n) for n in survivors}
        message = sm.NewEpoch(decision.epoch, new.to_dict(), decision.cause, dict(self.ids))
        for n in survivors:
            if n in arriving:
                await self._invite(n, decision)
            else:
                await _send(held.links[n], message)
        # weights go on the control links in the new epoch's records: what is left there of the
        # old epoch (frames the ring was carrying) is dropped undecoded (kafila.proto.epoch)
        channels = [LinkChannel(held.links[n], n, decision.epoch) for n in survivors]
        serves = [asyncio.ensure_future(self.server.serve(c)) for c in channels]
        try:
            node, code = held.node, held.code
            assert node is not None and code is not None
            formed = {self.ids[p]: link for p, link in held.links.items() if not link.closed}
            links = await link_ring(node, new, held.name, self.ids, held.name, formed)
            held.links.update(links)
            for peer, link in links.items():
                _listen(link, peer, self._heard)
            ckpt = Checkpoint.open(self.folder)
            parts = await epoch_parts(
                held.name, code, new, ckpt, links, self.opts, self.serving, decision.epoch, _held(role)
            )
            await asyncio.wait_for(asyncio.gather(*self._ready.values()), READY_S)
        finally:
            for job in serves:
                if not job.done():
                    job.cancel()
        ready_s = time.monotonic() - lost_at
        fetched = sum(
            (self.server.stats[n].bytes_sent if n in self.server.stats else 0) - sent_before[n]
            for n in survivors
        )
        head = isinstance(role, RingHead)
        first = role.first_token() if isinstance(role, RingHead) else None
        resumed = _resume(role, decision.epoch, parts)
        carried = resumed if head else None  # only the head knows
        for n in survivors:
            with contextlib.suppress(LinkError):
                await _send(held.links[n], sm.Resume(decision.epoch))
        if arriving and self.arrivals is not None:
            await self.arrivals.welcome(arriving)
        self.membership = replace(m, epoch=decision.epoch, plan=new, present=m.present - self._gone)
        held.plan = new
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
        _spawn(self._record_first_token(record, first, lost_at))

    # ------------------------------------------------------------ members that arrive (forming.arrivals)

    def admit(self, name: str, member: int, link: Link) -> None:
        """`name` (member id `member`) joined the serving session and proved the code on `link`,
        its control link from now on; a name lost before is a member coming back."""
        self.ids[name] = member
        self.held.links[name] = link
        self._gone.discard(name)
        _listen(link, name, self._heard)

    def busy(self) -> bool:
        """A re-plan is running (a change waits for it)."""
        return self._job is not None and not self._job.done()

    def ready_of(self, name: str) -> asyncio.Future[None] | None:
        """What `name`'s readiness for the epoch being formed settles (None: none is)."""
        return self._ready.get(name)

    async def arrive(self, decision: Replan, at: float) -> None:
        """Move to `decision`, a re-plan that takes in a member that arrived (or ends the session
        if the move fails, as a loss's re-plan does)."""
        self._job = asyncio.current_task()
        try:
            await self._move(decision, at)
        except (SessionError, LinkError, TimeoutError, OSError, ValueError) as exc:
            why = "a member was not ready in time" if isinstance(exc, TimeoutError) else str(exc)
            await self._end(f"{decision.cause}; re-planning failed: {why}")

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
                at = await asyncio.wait_for(asyncio.shield(first), 60.0)
                record = replace(record, first_token_s=max(0.0, at - lost_at))
        log.info("replanned", **record.to_json())
        role = self.held.ring()
        if role.change is not None and record.first_token_s is not None:
            role.change["lost_to_first_token_s"] = round(record.first_token_s, 3)
        if self.traces is not None:
            self.traces.write(record)

    async def _end(self, reason: str) -> None:
        """The session ends: every member is told why, every request fails with it, the host stops."""
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

    def __post_init__(self) -> None:
        self._job: asyncio.Task[None] | None = None

    def start(self) -> None:
        held = self.held
        role = held.ring()
        plan = held.plan
        assert plan is not None
        role.recovers = lambda b: held.plan is not None and lost_member(b, held.plan, held.host, held.name)
        role.on_broken = self._broken
        link = held.links.get(held.host)
        if link is not None:
            _listen(link, held.host, self._heard)

    def _broken(self, broken: RingBroken) -> None:
        held = self.held
        if held.plan is not None and broken.blames(held.name):
            _spawn(self._left_out(broken))
            return
        if held.plan is None or not lost_member(broken, held.plan, held.host, held.name):
            say(broken_line(held.name, broken))
            return
        say(f"{broken.text()}; waiting for the host's new plan")
        metrics.observe_state("replanning")
        link = held.links.get(held.host)
        if link is not None:
            lost = sm.MemberLost(broken.member, broken.cause.value, broken.detail)
            _spawn(self._tell(link, lost))
        _spawn(held.ring().pause())

    @staticmethod
    async def _tell(link: Link, msg: sm.EpochMessage) -> None:
        with contextlib.suppress(LinkError):
            await _send(link, msg)

    def _heard(self, peer: str, msg: sm.EpochMessage) -> None:
        role = self.held.ring()
        if isinstance(msg, sm.NewEpoch):
            if self._job is None or self._job.done():
                self._job = asyncio.ensure_future(self._move(msg))
        elif isinstance(msg, sm.Resume):
            if msg.epoch == role.epoch:
                role.changed("serving", role.change["cause"] if role.change else "re-planned")
                role.go()
                metrics.observe_state("serving")
                metrics.observe_plan(msg.epoch)
                plan = self.held.plan
                ring = " -> ".join(plan.order) if plan is not None else "?"
                say(f"epoch {msg.epoch} serving: ring {ring}")
        elif isinstance(msg, sm.SessionEnded):
            _spawn(self._ended(msg.reason))
        else:
            log.warning("epoch_message_ignored", peer=peer, op=msg.OP, reason="not for a member")

    async def _ended(self, reason: str) -> None:
        await self._ended_with(reason, f"the host ended the session: {reason}")

    async def _ended_with(self, reason: str, line: str) -> None:
        """Fail what is held with `reason`, take nothing new, and end this member saying `line`."""
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
            await self._tell(link, sm.EpochFailed(msg.epoch, f"{type(exc).__name__}: {exc}"))
            return
        await self._tell(link, sm.EpochReady(msg.epoch))

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
        formed = {self.ids[p]: link for p, link in held.links.items() if not link.closed and p in self.ids}
        links = await link_ring(node, plan, name, self.ids, held.host, formed)
        held.links.update(links)
        channel = LinkChannel(links[held.host], held.host, msg.epoch)  # as the host serves it
        shard = await fetch_shard(
            channel, range(a, b), head, cache=self.opts.cache, local=self.local, label=name, progress=False
        )
        say(f"weights for {shard_text(a, b, head)}: {shard.bytes_fetched / 1e6:.1f} MB fetched from the host")
        ckpt = Checkpoint.open(shard.path)
        opts, serving = self.opts, self.serving
        parts = await epoch_parts(name, code, plan, ckpt, links, opts, serving, msg.epoch, _held(role))
        held.plan = plan
        _resume(role, msg.epoch, parts)
