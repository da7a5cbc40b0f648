"""Losing the host: its successor takes the coordinating role and the others turn to it (the
asyncio shell of kafila.planner.succession's `HandOff`; it decides, this acts).

    every survivor: its ring breaks naming the host (its links went silent or closed, or the
    rendezvous says it left): the requests are held, not failed -> HandOff.lost(host)
      TakeOver (the first present of the host's succession order): link with every survivor (its
        control links from now on), become the session's coordinator (a HostEpochs over the
        members, with the probes the host published and this member's own copy of the checkpoint
        as the weights' source) and re-plan around the host as the host re-plans around a member;
        meanwhile take the host's place at the rendezvous (`succeed`: it proves the code, once the
        host is gone there), after which members join and rejoin with the same code through it
      Follow(s): link with s, listen to it as to the host, and wait for its epoch; s says within
        FIRST_NOTICE_S and every NOTICE_S, until its epoch goes out, that it is at work
        (`succeeding`: linking, asking what the survivors hold, fetching it), and each notice, like
        each range s asks of this member's disk, starts the wait again: only an s silent for
        HandOff.wait_s counts lost, and the next of the order is turned to
      Ended: every member ends naming why
      a successor without every block to serve ends the session naming what is missing

Another member lost meanwhile (the rendezvous says so, or the successor's own re-plan finds it)
is planned around by the successor like any loss during a re-plan.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from kafila.engine import DTYPES
from kafila.models.checkpoint import Checkpoint, CheckpointError
from kafila.models.manifest import Manifest, build_manifest, specs_from_config
from kafila.net.edge import EdgeOptions, link_edges
from kafila.net.errors import LinkError
from kafila.net.link import Link
from kafila.net.signaling import SignalingError
from kafila.obs import metrics
from kafila.obs.log import get_logger
from kafila.planner.devices import DeviceReport
from kafila.planner.fetching import after_plan
from kafila.planner.replan import Membership, PlanTerms
from kafila.planner.succession import (
    FIRST_NOTICE_S,
    NOTICE_S,
    Ended,
    Event,
    Follow,
    HandOff,
    Holding,
    Ignored,
    Shortfall,
    TakeOver,
    Waiting,
    shortfall,
)
from kafila.proto import session as sm
from kafila.proto.ring import RingBroken
from kafila.session.forming.arrivals import HostArrivals
from kafila.session.forming.core import HostFormation
from kafila.session.forming.driver import Driver
from kafila.session.forming.epochs import HostEpochs, MemberEpochs, listen_to
from kafila.session.forming.reconnect import RETRY, SCHEDULE
from kafila.session.progress import say
from kafila.session.ring.origins import OriginBook
from kafila.session.runtime import MemberRuntime
from kafila.session.weights.fetch import fetch_whole, not_offered, shard_names, usable
from kafila.session.weights.manifest import WeightManifest, WeightsError
from kafila.session.weights.peers import HeldFiles
from kafila.session.weights.server import Ranges, WeightServer
from kafila.session.weights.sharing import where_from
from kafila.session.weights.sources import Paced, Reader

log = get_logger("kafila.session.forming.takeover")

# tests only: the successor's fetch of the blocks it lacks lasts at least this many seconds (a slow
# disk or uplink at the survivors it fetches from, simulated); unset, it runs as fast as it can
SLOW_FETCH_ENV = "KAFILA_SIMULATE_SLOW_TAKEOVER_FETCH_S"


def weights_source(held: MemberRuntime) -> Path | None:
    """The folder this member can serve and load every block of the session's checkpoint from:
    its own copy of the checkpoint (None: it holds only the shard it fetched)."""
    shard = held.shard
    return shard.path if shard is not None and shard.local else None


@dataclass
class Succession:
    """One survivor's part when the host is lost: decide with a HandOff, act on its events."""

    held: MemberRuntime
    member: MemberEpochs
    drive: Driver | None = None  # its formation driver: the host's arrivals once it took over
    view: HandOff | None = None
    _timer: asyncio.TimerHandle | None = field(default=None, repr=False)
    _doing: str = "linking with the survivors"  # taking over: what its notices say it does now
    _said: str = ""  # following: what the successor's notices said last
    _epochs: HostEpochs | None = field(default=None, repr=False)  # taken over: its coordinator side

    def start(self) -> None:
        self.member.on_host_lost = self.host_lost
        self.member.on_member_lost = self._gone
        self.member.on_epoch = self._epoch_from
        self.member.on_succeeding = self._succeeding
        self.held.on_lost = self.other_lost
        if self.held.weights is not None:  # a successor asking this member's disk is at work
            self.held.weights.server.on_asked = self._asked

    def _epoch_from(self, peer: str, epoch: int) -> None:
        if self.view is not None:
            self._act(self.view.heard(peer, epoch, asyncio.get_running_loop().time()), f"epoch {epoch}")
            if self.view.state == "following" and self._timer is not None:  # the successor took over
                self._timer.cancel()
                self._timer = None

    def _succeeding(self, peer: str, msg: sm.Succeeding) -> None:
        """`peer` says it is taking over from the host (its notice): the wait for it starts again."""
        view = self.view
        if view is None:  # this member has not seen the host lost: its epoch will say the rest
            log.info("succession_notice_early", successor=peer, host=msg.host, doing=msg.doing)
            return
        event = view.working(peer, asyncio.get_running_loop().time(), msg.epoch, msg.doing)
        self._act(event, f"{peer} takes over from {msg.host}: {msg.doing}")

    def _asked(self, peer: str) -> None:
        """`peer` asked this member for a range of the checkpoint: if it is the successor awaited,
        it is at work (fetching the lost host's blocks), which starts the wait for it again."""
        if self.view is not None:  # (ignored unless `peer` is the successor awaited)
            self.view.working(peer, asyncio.get_running_loop().time())

    def _hand_off(self) -> HandOff:
        """The view of the epoch serving (a new epoch brings a new order)."""
        held, role = self.held, self.held.ring()
        plan = held.plan
        assert plan is not None
        if self.view is None or self.view.epoch < role.epoch:
            self.view = HandOff(held.name, held.host, role.succession, frozenset(plan.order), role.epoch)
        return self.view

    def host_lost(self, broken: RingBroken) -> None:
        """The ring broke naming the host."""
        self._act(self._hand_off().lost(broken.member, asyncio.get_running_loop().time()), broken.detail)

    def _gone(self, member: str) -> None:
        """A member other than the host was lost (this member's ring broke naming it)."""
        self._act(self._hand_off().lost(member, asyncio.get_running_loop().time()), f"{member} lost")

    def other_lost(self, member: str, cause: str, detail: str) -> None:
        """The rendezvous says `member` left while the ring is broken: the host, the awaited
        successor, or another member the successor must plan around."""
        if self.held.plan is None:
            return
        self._act(self._hand_off().lost(member, asyncio.get_running_loop().time()), detail)

    def _act(self, event: Event, detail: str) -> None:
        if self.held.host_ended:  # stopped on purpose: the session is over, no one takes its place
            return
        log.info("succession", member=self.held.name, step=type(event).__name__, detail=detail)
        if isinstance(event, Waiting) and event.why != self._said:
            self._said = event.why
            say(f"{event.coordinator} is taking over as the session's host: {event.why}")
        if isinstance(event, TakeOver):
            self.held.spawn(self._take_over(event, detail), "take_over")
        elif isinstance(event, Follow):
            self.held.spawn(self._follow(event), "follow")
        elif isinstance(event, Ended):
            self.held.spawn(self.member.end_with(event.reason), "ended")

    def _tick(self) -> None:
        """The awaited successor's deadline: pass it over, unless it was heard since (then wait
        on to the deadline that moved)."""
        view = self.view
        if view is None:
            return
        loop = asyncio.get_running_loop()
        event = view.tick(loop.time())
        if not isinstance(event, Ignored):
            self._act(event, "no epoch and no word from the successor")
        elif view.state == "awaiting" and view.deadline is not None:
            self._timer = loop.call_at(view.deadline, self._tick)

    async def _follow(self, event: Follow) -> None:
        """Link with the successor (unless a ring edge joins the two already) and listen to it."""
        held, name = self.held, event.coordinator
        say(
            f"the host {', '.join(event.lost)} was lost; {name} takes over as the session's host "
            "(the host's succession order): waiting for its plan"
        )
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._timer = loop.call_at(event.deadline, self._tick)
        held.host = name
        try:
            link = await self._link([name], client=True)
        except LinkError as exc:
            log.warning("successor_unlinked", successor=name, error=str(exc))
            return  # the deadline passes it over
        listen_to(link[name], name, self.member.heard_from_host)

    async def _link(self, peers: list[str], client: bool) -> dict[str, Link]:
        held = self.held
        node = held.node
        assert node is not None
        ids = self.member.ids
        formed = {ids[p]: held.links[p] for p in peers if p in held.links and not held.links[p].closed}
        edges = {ids[p]: (client, EdgeOptions()) for p in peers}
        names = {ids[p]: p for p in peers}
        linked = await link_edges(node, edges, formed, label=lambda i: f"link {held.name} <-> {names[i]}")
        links = {names[i]: link for i, link in linked.items()}
        held.links.update(links)
        if held.weights is not None:  # each serves the other what its disk holds of the checkpoint
            held.weights.attach(links)
        return links

    async def _take_over(self, event: TakeOver, detail: str) -> None:
        """Become the session's coordinator and re-plan around the lost host(s)."""
        held, member = self.held, self.member
        lost = ", ".join(event.lost)
        say(
            f"the host {lost} was lost; this member takes over as the session's host "
            "(the host's succession order)"
        )
        self._doing = "linking with the survivors"
        held.spawn(self._notify(event), "succeeding")  # before anything that takes time
        others = [n for n in event.survivors if n != held.name]
        try:
            await self._link(others, client=False)
        except LinkError as exc:
            log.warning("survivor_unlinked", error=str(exc))  # the re-plan names who does not answer
        got = await self._weights(event)
        if isinstance(got, str):  # its links close as a member leaving: the next in the order is tried
            held.left_out = True
            await member.end_with(got)
            return
        epochs = self._epochs = self._coordinator(*got)
        self._tell_replaced(event.lost[0], held.ring().epoch + 1)
        held.host = held.name
        member.stop()
        epochs.start()
        metrics.observe_state("replanning")
        for name in event.lost:
            what = "the session's host" if name == event.lost[0] else "lost with the host"
            epochs.lost(name, "closed", f"{what}; {held.name} took over as the host")
        held.spawn(self._register(epochs), "register_as_host")

    async def _notify(self, event: TakeOver) -> None:
        """Tell the survivors this member is taking over, FIRST_NOTICE_S after it starts and every
        NOTICE_S from then on, until its epoch is in place (or this member's part ends): a survivor
        waiting for its epoch waits on while it hears this, however long the blocks it lacks take
        to fetch. A successor whose epoch goes out at once (it holds the checkpoint) sends none:
        its epoch says it all, and nothing else reaches the survivors while their rings pause."""
        await asyncio.sleep(FIRST_NOTICE_S)
        while self._at_work():
            self._tell_all(event)
            await asyncio.sleep(NOTICE_S)

    def _at_work(self) -> bool:
        """Still taking over: its part goes on, and its coordinator side (which sends the epoch at
        once, after pausing its own role) is not made yet."""
        ended = self.held.ended
        return self._epochs is None and (ended is None or not ended.done())

    def _tell_all(self, event: TakeOver) -> None:
        held = self.held
        notice = sm.Succeeding(event.lost[0], event.epoch, self._doing)
        for name in event.survivors:
            link = held.links.get(name)
            if name != held.name and link is not None and not link.closed:
                held.spawn(MemberEpochs.tell(link, notice), "tell_succeeding")

    async def _register(self, epochs: HostEpochs) -> None:
        """Take the lost host's place at the rendezvous (retrying while it still counts the host
        present: a frozen one until its silence times it out), then admit members that join."""
        held, drive = self.held, self.drive
        client, code, node = held.client, held.code, held.node
        if drive is None or client is None or code is None or node is None:
            return
        attempt = 0
        while True:
            attempt += 1
            try:
                await client.succeed(code)
                break
            except SignalingError as exc:
                if exc.code not in RETRY:
                    say(f"the rendezvous would not make this member the session's host: {exc.message}; "
                        "no member can join this session")  # fmt: skip
                    log.warning("succession_refused", code=exc.code, reason=exc.message)
                    return
                log.info("succession_retry", attempt=attempt, code=exc.code, reason=exc.message)
            await asyncio.sleep(SCHEDULE.delay(attempt, 0.5))
        await client.update(capability=self._capability(epochs.folder))  # what joiners probe for
        ids = {n: i for n, i in epochs.ids.items() if n in epochs.membership.present}
        drive.core = HostFormation.taken_over(node.member, held.name, ids, epochs.origins)
        HostArrivals(epochs, drive, node)
        say(
            f"registered at the rendezvous as session {code.public}'s host: members join and rejoin "
            "with the same code"
        )
        log.info("succession_registered", session=code.public, member=node.member, attempts=attempt)

    def _capability(self, folder: Path) -> dict[str, object]:
        """What the host offers joiners at the rendezvous: the model's shape (its block probe),
        the session's dtype and weight format and its checkpoint's id (what a joiner's cache holds
        of it goes with its report), as `kafila host` registers them."""
        terms = self.member.serving.terms
        try:
            raw = Checkpoint.open(folder).config.raw
        except (OSError, CheckpointError) as exc:
            log.warning("config_unreadable", folder=str(folder), error=repr(exc))
            raw = None
        config = raw if raw is not None and len(json.dumps(raw)) < 12_000 else None
        return {
            "role": "host",
            "config": config,
            "dtype": terms.dtype,
            "quant": terms.quant,
            "checkpoint": self.member.serving.checkpoint,
        }

    def _tell_replaced(self, host: str, epoch: int) -> None:
        """The lost host, should it only be frozen, reads on waking that this member replaced it."""
        link = self.held.links.get(host)
        if link is not None and not link.closed:
            self.held.spawn(MemberEpochs.tell(link, sm.Replaced(self.held.name, epoch)), "tell_replaced")

    async def _weights(self, event: TakeOver) -> tuple[Path, Ranges | None] | str:
        """The folder this member loads every block from as the coordinator, and what it serves
        them from (None: that folder, its own copy of the checkpoint; else its cache); or why the
        survivors cannot go on. Without a copy of its own it takes the blocks it lacks from the
        survivors' disks (each keeps its own shard and the next ring member's, so the lost host's
        blocks are on its ring predecessor's disk)."""
        held = self.held
        own = weights_source(held)
        sharing = held.weights
        m = sharing.manifest if sharing is not None else None
        if own is not None:
            return own, None
        if sharing is None or m is None:  # it never learnt the checkpoint's manifest
            return self._missing(None, event) or "this member cannot learn what the checkpoint holds"
        links = {p: lk for p, lk in held.links.items() if p in event.survivors and not lk.closed}
        self._doing = "asking the survivors which blocks their disks hold"
        readers = await usable(sharing.sources(links, event.lost[0]), m)
        lacking = await asyncio.to_thread(not_offered, m, readers, sharing.root)
        if lacking:
            return self._lost_blocks(m, lacking, event)
        self._doing = "fetching the lost host's blocks from the survivors' disks"
        try:
            label = f"{held.name} (the host's blocks)"
            got = await fetch_whole(m, _simulated_slow(readers), sharing.root, label=label)
        except (WeightsError, OSError) as exc:
            return f"the host {event.lost[0]} was lost; {held.name} could not take its blocks: {exc}"
        say(f"took the blocks it lacked from the survivors' disks: {where_from(got)}")
        doc = self.member.serving.weights
        if doc is not None:  # /session: what taking over fetched, by source
            doc["taken_over"] = {"fetched_tensor_bytes": got.tensor_bytes, "by_source": dict(got.sources)}
        ranges = HeldFiles(sharing.root, m)
        await asyncio.to_thread(ranges.refresh)
        return got.path, ranges

    def _lost_blocks(self, m: WeightManifest, lacking: list[str], event: TakeOver) -> str:
        """Why the survivors cannot go on: the blocks none of their disks holds."""
        gone = set(lacking)
        blocks = tuple(b for b in range(m.n_blocks) if gone & set(shard_names(m, range(b, b + 1), False)))
        head = bool(gone & set(shard_names(m, range(0, 0), True)))
        short = Shortfall(blocks, head, sum(m.tensors[n].nbytes for n in gone))
        return (
            f"the host {event.lost[0]} was lost"
            + (f" with {', '.join(event.lost[1:])}" if len(event.lost) > 1 else "")
            + f"; the survivors ({', '.join(event.survivors)}) cannot obtain {short.text()}: no "
            "survivor's disk holds them (each keeps its own shard and the next ring member's)"
        )

    def _missing(self, folder: Path | None, event: TakeOver) -> str | None:
        """Why the survivors cannot go on for want of weights (None: this member serves them all)."""
        held = self.held
        plan = held.plan
        assert plan is not None
        manifest = self._manifest(folder or (held.shard.path if held.shard is not None else None))
        if folder is not None or manifest is None:
            return None if folder is not None else "this member cannot read its own shard's checkpoint"
        a, b = plan.block_range(held.name)
        own = Holding(frozenset(range(a, b)), plan.head == held.name)
        short = shortfall(manifest, {held.name: own}, [held.name])
        if short is None:
            return None
        return (
            f"the host {event.lost[0]} was lost"
            + (f" with {', '.join(event.lost[1:])}" if len(event.lost) > 1 else "")
            + f"; the survivors ({', '.join(event.survivors)}) cannot obtain "
            f"{short.text()}: the successor {held.name} holds only its own shard, and the lost host "
            "served every other block"
        )

    def _manifest(self, folder: Path | None) -> Manifest | None:
        if folder is None:
            return None
        terms = self.member.serving.terms
        dtype = DTYPES[terms.dtype]
        try:  # a shard holds some tensors only: every block's size from the model's shape
            config = Checkpoint.open(folder).config
            return build_manifest(specs_from_config(config, dtype), config, dtype, terms.quant)
        except (OSError, CheckpointError, KeyError, ValueError) as exc:  # a shard folder it cannot read
            log.warning("shard_unreadable", folder=str(folder), error=repr(exc))
            return None

    def _coordinator(self, folder: Path, ranges: Ranges | None) -> HostEpochs:
        """This member as the session's coordinator: the membership of the epoch serving, with the
        probes the host published (this member first: it is the host now)."""
        held, member = self.held, self.member
        plan = held.plan
        assert plan is not None
        names = [held.name, *(n for n in plan.order if n != held.name)]
        reports = tuple(DeviceReport.from_dict(member.probes[n]) for n in names)
        reports = after_plan(reports, plan)  # what the plan serving left on the members' disks
        role = held.ring()
        membership = Membership(role.epoch, plan, reports, frozenset(plan.order), held.name)
        terms = member.serving.terms
        plan_terms = PlanTerms(terms.context, terms.concurrency, terms.division)
        ckpt = Checkpoint.open(folder)
        manifest = ckpt.manifest(DTYPES[terms.dtype], terms.quant)
        published = {member.ids[n]: tag for n, tag in member.origins.items() if n in member.ids}
        heard = held.client.highest_member if held.client is not None else 0
        # above every tag the lost host gave, those since its last epoch too (kafila.session.ring.origins)
        book = OriginBook(published, floor=max(heard, member.ids.get(held.name, 0)))
        server = WeightServer(folder, cache=member.opts.cache, ranges=ranges)
        if held.weights is not None:  # the files it opens to serve close with the member's sharing
            held.weights.folders.append(server)
        return HostEpochs(
            held, membership, manifest, plan_terms, member.ids, folder, server, member.opts, member.serving,
            role.traces, probed=reports, origins=book,
        )  # fmt: skip


def _simulated_slow(readers: list[Reader]) -> list[Reader]:
    """The sources as they are, or, where $KAFILA_SIMULATE_SLOW_TAKEOVER_FETCH_S is set (tests),
    each spreading what it sends over at least that many seconds."""
    raw = os.environ.get(SLOW_FETCH_ENV)
    if not raw:
        return readers
    try:
        seconds = float(raw)
    except ValueError:
        log.warning("simulated_slow_fetch_ignored", value=raw[:40], why="not a number of seconds")
        return readers
    log.warning("simulated_slow_fetch", seconds=seconds, sources=[r.name for r in readers])
    return [Paced(r, seconds) for r in readers]
