"""The driver of a formation core: signaling events and the clock in, the core's outputs carried out.

The steps and the session messages (`report`, `plan`, `refused`, `ready`: signaling payloads the
rendezvous forwards unread) are decided by the pure state machines of kafila.session.forming.core;
`Driver` feeds them and carries out what they return. kafila.session.forming.host and .join are
the two ways into a session built on it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kafila.net.edge import SignalRouter
from kafila.net.link import Link
from kafila.net.signaling import SignalingClient, SignalingClosed
from kafila.obs.log import get_logger
from kafila.proto import signaling as sig
from kafila.proto.session import SESSION_VERSION
from kafila.proto.speaks import session_version_of
from kafila.session.errors import HostLeft, SessionError
from kafila.session.forming import core as fm
from kafila.session.forming.core import HostFormation, MemberFormation
from kafila.session.forming.reconnect import REREGISTER_AFTER, back_to_rendezvous
from kafila.session.progress import say

log = get_logger("kafila.session.forming")
T = TypeVar("T")
R = TypeVar("R")


FIRST = asyncio.FIRST_COMPLETED


async def while_signaling(
    work: Awaitable[R], pump: asyncio.Future[None], watch: asyncio.Future[Any] | None = None
) -> R:
    """`work` (the probe: 10-20 s, run inside the formation driver, which hears the host's refusal
    meanwhile), unless the rendezvous connection ends first, or `watch` (a joining member's control
    link with the host, checking its code meanwhile) fails first: then at once with that error,
    not once the probe is done."""
    job = asyncio.ensure_future(work)
    try:
        while not job.done():
            waiting: set[asyncio.Future[Any]] = {job, pump}
            if watch is not None and not watch.done():
                waiting.add(watch)
            await asyncio.wait(waiting, return_when=FIRST)
            if watch is not None and watch.done() and not watch.cancelled() and watch.exception():
                watch.result()  # its error
            if pump.done():
                break
    finally:
        if not job.done():
            job.cancel()
    if job.done():
        return job.result()
    why = None if pump.cancelled() else pump.exception()
    if isinstance(why, SignalingClosed):
        raise Driver._rendezvous_lost(why)
    raise SessionError(f"the session could not form: lost the rendezvous: {why!r}")


def _pump(router: SignalRouter) -> asyncio.Future[None]:
    """The router's pump of a connection made again; it ends when that connection is lost (the
    loss is what serve_formed waits on, so its error is only retrieved here)."""
    task = asyncio.ensure_future(router.pump())
    task.add_done_callback(lambda t: t.cancelled() or t.exception())
    return task


class Driver:
    """The thin shell around a formation core (kafila.session.forming.core): feeds it the signaling
    events and the clock, and carries out its outputs (progress lines, signals; a failure becomes
    a SessionError)."""

    def __init__(
        self, core: HostFormation | MemberFormation, client: SignalingClient, router: SignalRouter
    ) -> None:
        self.core, self.client, self.router = core, client, router
        self._next: asyncio.Task[sig.ServerMessage] | None = None
        self._lost: asyncio.Task[SignalingClosed] | None = None
        # the shell's own results for the core, as steps of it taking `now` (kafila.session.forming.admission)
        self.inbox: asyncio.Queue[Callable[[float], list[fm.Output]]] = asyncio.Queue()
        self._inbox_next: asyncio.Task[Callable[[float], list[fm.Output]]] | None = None
        self.on_admit: Callable[[fm.Admit], None] | None = None  # the host's: link with that member
        # once formed: the rendezvous says a member (by name) left, with its reason ("disconnected")
        self.on_left: Callable[[str, str], None] | None = None
        self.serving = False  # formed: a rendezvous lost is reconnected to (serve_formed)
        # once formed: events about members joining the serving session (the host's arrivals,
        # kafila.session.forming.arrivals); True when taken there, else the core has them
        self.on_event: Callable[[fm.Event], bool] | None = None
        # a joining member's: the host keeps it as a spare (its API relays to the host meanwhile)
        self.on_spare: Callable[[fm.Spared], None] | None = None

    @staticmethod
    def now() -> float:
        return asyncio.get_running_loop().time()

    async def carry(self, outputs: list[fm.Output]) -> list[fm.Output]:
        """Carry out progress, sends, rejections and failure; return the steps left to the caller."""
        rest: list[fm.Output] = []
        for out in outputs:
            if isinstance(out, fm.Say):
                say(out.text)
            elif isinstance(out, fm.Send | fm.Remove):
                await self._tell_rendezvous(out)
            elif isinstance(out, fm.Admit) and self.on_admit is not None:
                self.on_admit(out)
            elif isinstance(out, fm.Spared) and self.on_spare is not None:
                self.on_spare(out)
            elif isinstance(out, fm.Rejected):
                log.warning("session_message_rejected", member=out.member, reason=out.reason)
            elif isinstance(out, fm.Failed):
                log.warning("session_not_formed", reason=out.reason)
                raise (HostLeft if out.host_left else SessionError)(out.reason)
            else:
                rest.append(out)
        return rest

    async def _tell_rendezvous(self, out: fm.Send | fm.Remove) -> None:
        try:
            if isinstance(out, fm.Send):
                await self.client.signal(out.to, out.body)
            else:
                await self.client.remove(out.member, out.reason)
        except SignalingClosed as exc:
            raise self._rendezvous_lost(exc) from exc

    async def until(
        self, want: type[T], first: list[fm.Output] | None = None, watch: asyncio.Future[Any] | None = None
    ) -> T:
        """Carry out `first` (what a step of the core just returned), then feed events and ticks
        until the core outputs a `want`. A `watch` that fails meanwhile raises its error."""
        outputs = await self.carry(first or [])
        while True:
            for out in outputs:
                if isinstance(out, want):
                    return out
            if watch is not None and watch.done():
                watch.result()  # its failure, if it failed
                watch = None
            outputs = await self._feed_one(watch)

    async def during(self, work: Awaitable[R]) -> R:
        """Run one step of the shell's own (linking, fetching, loading) while still feeding the
        core, so a member leaving or a deadline ends the attempt without waiting for the step."""
        task = asyncio.ensure_future(work)
        try:
            while not task.done():
                await self._feed_one(task)
            return task.result()
        finally:
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    def close(self) -> None:
        for task in (self._next, self._lost, self._inbox_next):
            if task is not None:
                task.cancel()  # an unconsumed event stays in the queue

    async def serve_formed(self, links: dict[str, Link], status: dict[str, Any]) -> None:
        """After forming (a task until the member ends): keep feeding the core (and `on_event`:
        the host admits whoever joins the formed session); when the rendezvous is lost (the ring
        does not need it to serve), reconnect with back-off and register the session again
        (kafila.session.forming.reconnect), saying so on the console and on /session (its
        "rendezvous" "state": "reconnecting" with the "attempt" and "reason", "connected" again, or
        "lost" when it refused this member for good)."""
        self.close()
        self.serving = True
        lost = asyncio.ensure_future(self.client.lost())
        pump: asyncio.Future[None] | None = None  # the event pump of a connection made again
        try:
            while True:
                nxt = asyncio.ensure_future(self.router.others.get())
                done, _ = await asyncio.wait({nxt, lost}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    if pump is not None:
                        pump.cancel()
                    if not await back_to_rendezvous(self.client, status, lost.result().message, links):
                        return
                    lost, pump = asyncio.ensure_future(self.client.lost()), _pump(self.router)
                    continue
                event = self._translate(nxt.result())
                if event is not None and self.on_event is not None and self.on_event(event):
                    continue
                if isinstance(event, fm.Left):  # the runtime checks the member's link and breaks the ring
                    if self.on_left is not None:
                        self.on_left(self.core.name_of(event.member), event.reason)
                    continue
                if event is not None:
                    await self.carry(self.core.handle(event, self.now()))
        except SessionError as exc:  # a fatal error from the rendezvous, or a refusal it could not take
            status.update(state="lost", reason=str(exc))
            say(f"the rendezvous: {exc}; the ring goes on serving on its links")
        finally:
            lost.cancel()
            if pump is not None:
                pump.cancel()

    async def _feed_one(self, work: asyncio.Future[Any] | None) -> list[fm.Output]:
        if self._next is None:
            self._next = asyncio.ensure_future(self.router.others.get())
        if self._lost is None:
            self._lost = asyncio.ensure_future(self.client.lost())
        if self._inbox_next is None:
            self._inbox_next = asyncio.ensure_future(self.inbox.get())
        deadline = self.core.deadline
        timeout = None if deadline is None else max(0.0, deadline - self.now())
        waiting = {self._next, self._lost, self._inbox_next, *([work] if work is not None else [])}
        done, _ = await asyncio.wait(waiting, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if self._lost in done and self._next not in done:
            # no member can join or signal any more: the session cannot form (a formed ring does
            # not need the rendezvous for its direct edges, so only forming fails on this)
            raise self._rendezvous_lost(self._lost.result())
        if self._inbox_next in done:  # an event read meanwhile waits in self._next
            step, self._inbox_next = self._inbox_next.result(), None
            return await self.carry(step(self.now()))
        if self._next not in done:
            return await self.carry(self.core.tick(self.now()))
        event, self._next = self._next.result(), None
        core_event = self._translate(event)
        return [] if core_event is None else await self.carry(self.core.handle(core_event, self.now()))

    @staticmethod
    def _rendezvous_lost(why: SignalingClosed) -> SessionError:
        log.warning("session_not_formed", reason="rendezvous lost", error=str(why))
        return SessionError(f"the session could not form: {why.message}")

    def _translate(self, event: sig.ServerMessage) -> fm.Event | None:
        if isinstance(event, sig.SignalFrom) and event.payload.get(fm.KEY) == SESSION_VERSION:
            return fm.Message(event.sender, event.payload)
        if isinstance(event, sig.SignalFrom) and (seen := session_version_of(event.payload)) is not None:
            log.warning("session_version_differs", member=event.sender, version=seen, ours=SESSION_VERSION)
            return fm.OtherVersion(event.sender, seen)
        if isinstance(event, sig.MemberJoined):
            return fm.Joined(event.member.id, event.member.name)
        if isinstance(event, sig.MemberLeft):
            name = self.core.name_of(event.member)
            log.warning("member_left", member=name, id=event.member, reason=event.reason)
            return fm.Left(event.member, event.reason)
        if isinstance(event, sig.Error) and event.fatal:
            if self.serving and event.code in REREGISTER_AFTER:  # the loss that follows reconnects
                log.warning("rendezvous_dropped_member", code=event.code, reason=event.message)
                return None
            raise SessionError(f"the rendezvous ended the session: {event.message}")
        return None
