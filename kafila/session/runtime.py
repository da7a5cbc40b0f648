"""One member's resources from its start to its end, and the one way they are given back.

`host()` and `join()` (kafila.session.forming) fill a `MemberRuntime` as they acquire things (the
API's socket, the signaling connection, the UDP node, links, the ring role); whether forming fails
or the member ends after serving, `close()` releases exactly what was acquired, in one order. The
ring role sits in one attribute so that a later re-plan can swap it for the next epoch's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

from kafila.api.drain import Drain
from kafila.api.forming import FormingStatus, forming_app
from kafila.api.overload import DEFAULT_LIMITS, ApiLimits
from kafila.api.security import ApiSecurity, ApiSecurityError, check_exposure
from kafila.api.server import ApiServer, parse_addr
from kafila.api.spare import SpareRelay, spare_app
from kafila.net.edge import LinkNode
from kafila.net.errors import LinkClosed, LinkEnded
from kafila.net.link import Link
from kafila.net.signaling import SignalingClient
from kafila.net.tcp import bind_tcp
from kafila.obs import metrics
from kafila.obs.listener import MetricsListener, serve_metrics
from kafila.obs.log import get_logger
from kafila.planner.plan import Plan
from kafila.proto.codes import SessionCode
from kafila.proto.ring import Cause, departure_cause
from kafila.session.channel import LINK_KEEPALIVE_S, closed_by
from kafila.session.errors import SessionError
from kafila.session.progress import progress_to, say
from kafila.session.ring.build import RingRole
from kafila.session.terms import Options
from kafila.session.weights.sharing import Sharing

if TYPE_CHECKING:
    from starlette.applications import Starlette

    from kafila.session.weights.fetch import ShardResult

NOT_FORMED = "session not formed"
# after the rendezvous says a member left, its link must stay silent for this many of its PINGs
# (0.75 s on a session's links) for the ring to break: a member that lost only its rendezvous
# connection still answers on it
LEFT_CONFIRM_PINGS = 3
LEFT_CONFIRM_S = LEFT_CONFIRM_PINGS * LINK_KEEPALIVE_S
log = get_logger("kafila.session.runtime")


class Stops(Protocol):
    """The formation driver (kafila.session.forming.driver), as the runtime stops it and hears of
    members leaving once formed (`on_left(name, reason)`)."""

    on_left: Callable[[str, str], None] | None

    def close(self) -> None: ...


class Drops(Protocol):
    """The host's admission of reporting members (kafila.session.forming.admission): its links."""

    async def close(self, why: str) -> None: ...


@dataclass
class Listeners:
    """A spare's API server and metrics listener, kept open while it joins again."""

    api: ApiServer | None
    metrics: MetricsListener | None

    async def close(self) -> None:
        if self.api is not None:
            with contextlib.suppress(Exception):
                await self.api.stop()
        if self.metrics is not None:
            self.metrics.close()


class MemberRuntime:
    """Everything a member holds: what it acquired while forming, then its ring role and API."""

    def __init__(self, kind: str) -> None:
        self.forming = FormingStatus(kind)  # what its API's /session says until the ring serves
        self.name = ""
        self.host = ""  # the host's name: the host ending its session ends every member's
        self.code: SessionCode | None = None
        self.plan: Plan | None = None
        self.api_socket: socket.socket | None = None  # the API's address, bound before anything else
        self.api: ApiServer | None = None  # serving on it: 503 "forming" until the session formed
        self.metrics: MetricsListener | None = None  # --metrics: /metrics from the start to the end
        self._source: Callable[[], Mapping[str, Any]] | None = None  # what its scrapes read (/session)
        self.client: SignalingClient | None = None
        self.node: LinkNode | None = None
        self.driver: Stops | None = None
        self.admission: Drops | None = None  # the host's links with members that reported
        self.links: dict[str, Link] = {}
        self.tasks: list[asyncio.Task[Any]] = []
        self._role: RingRole | None = None  # the ring role, once its stage is loaded
        self.app: Starlette | None = None  # the session's API app, served once the session formed
        self.relay: SpareRelay | None = None  # a spare's: its API's requests, relayed to the host
        self.shard: ShardResult | None = None  # a joining member's weights, as fetched
        self.weights: Sharing | None = None  # the weight ranges it serves and its replicas
        self.formed = False  # every member is ready and this one serves
        # a joining member's: done, with the line to say, when the host ended the session on purpose
        self.ended: asyncio.Future[str] | None = None
        # a joining member's: the others counted it lost and re-planned without it, so it ends on its
        # own (`ended` says why); its links then close as a member leaving, not as the session ending
        self.left_out = False
        # the host's re-plans (kafila.session.forming.epochs): told of a member the rendezvous says
        # left while the ring is already broken, i.e. during a re-plan (`(member, cause, detail)`)
        self.on_lost: Callable[[str, str, str], None] | None = None
        # a joining member's API server and metrics listener belong to its join() until it formed: a
        # spare whose host was lost joins again with the same code on the same addresses
        # (kafila.session.forming.join; Listeners), so close() leaves them open
        self.listeners_borrowed = False
        self.drain: Drain | None = None  # the session's API as served, once formed: drained to hand over
        # the coordinator's (kafila.session.forming.epochs.HostEpochs): hand its role over to the first
        # present of its succession order and leave (SIGUSR1, kafila.cli.host); `ended` then says so
        self.hand_over: Callable[[], Coroutine[Any, Any, None]] | None = None
        self.handed_to: str | None = None  # the member this one handed the host's role over to

    @property
    def role(self) -> RingRole | None:
        """The ring role, once its stage is loaded; its /session names who coordinates (`host`)."""
        return self._role

    @role.setter
    def role(self, role: RingRole | None) -> None:
        self._role = role
        if role is not None:
            role.coordinator = lambda: self.host

    @property
    def host_ended(self) -> bool:
        """A joining member's: the host ended the session (not: this member was stopped or left out)."""
        done = self.ended is not None and self.ended.done() and not self.ended.cancelled()
        return done and not self.left_out and self.handed_to is None

    def spawn(self, work: Coroutine[Any, Any, object], what: str) -> asyncio.Task[Any]:
        """Run `work` (`what` it does, for the log) alongside this member, held with its tasks:
        `close()` cancels it, and a failure is logged rather than lost with the task."""
        task: asyncio.Task[Any] = asyncio.ensure_future(work)
        self.tasks.append(task)
        task.add_done_callback(partial(self._done, what))
        return task

    def _done(self, what: str, task: asyncio.Task[Any]) -> None:
        with contextlib.suppress(ValueError):
            self.tasks.remove(task)
        if not task.cancelled() and task.exception() is not None:
            exc = task.exception()
            log.error("task_failed", member=self.name, task=what, error=repr(exc), exc_info=exc)

    def ring(self) -> RingRole:
        """The ring role (a runtime asked for it before forming has started one is a bug)."""
        if self.role is None:
            raise RuntimeError(f"{self.name or 'this member'} has no ring role yet")
        return self.role

    async def close(self) -> None:
        """End this member's part, whatever it got to. After serving, the host's links close as
        `ended`, so every member learns that the session is over (rather than that its ring broke),
        and so do the links of a member that ends because the host did: whichever close reaches a
        member first says the same. Before that, everything closes as "session not formed"."""
        if self.driver is not None:
            self.driver.close()
        if self.admission is not None and not self.formed:  # once formed, its links are the ring's
            await self.admission.close(NOT_FORMED)
        if self.formed and self.api is not None:  # no new request reaches a role that stops
            with contextlib.suppress(Exception):
                await self.api.stop()
        if self.role is not None:
            if not self.formed:  # e.g. the host's members never became ready
                self.role.on_broken = None  # closing its links is not a ring breaking
            with contextlib.suppress(Exception):
                await self.role.stop()
            self.role.model.close()
        if self.weights is not None:
            await self.weights.close()
        await self._close_links()
        for task in list(self.tasks):
            task.cancel()
        if self.client is not None:
            said = "handed over" if self.handed_to is not None else "session ended"
            with contextlib.suppress(Exception):
                await self.client.close(said if self.formed else NOT_FORMED)
        if self.node is not None:
            self.node.endpoint.close()
        lend = self.listeners_borrowed and not self.formed
        if not self.formed and self.api is not None and not lend:
            with contextlib.suppress(Exception):
                await self.api.stop()
        if self.api_socket is not None:
            self.api_socket.close()
        self._close_metrics(keep_listener=lend)

    def _serving_document(self) -> dict[str, Any]:
        """The role's /session document for the metrics, "ended" once the host ended the session
        (its ring's breaking then is not a fault)."""
        doc = self.ring().describe()
        return doc | {"state": "ended"} if self.ring().ending else doc

    def _close_metrics(self, keep_listener: bool = False) -> None:
        if (self.formed and self.name == self.host) or self.host_ended:
            metrics.observe_state("ended")  # the session is over, not broken (on_ended says it first)
        if self._source is not None and metrics.REGISTRY.source is self._source:
            metrics.set_source(None)  # the process's registry no longer reads a closed member
        self._source = None
        if self.metrics is not None and not keep_listener:
            listener, self.metrics = self.metrics, None
            listener.close()

    def open_metrics(self, addr: str | None) -> None:
        """Serve /metrics on a listener of its own (--metrics; none without), from now until
        `close()`: up while the session forms, serves, or its ring is broken. Its scrapes read the
        forming status until the session formed, then the ring role's /session document."""
        self._read_by_metrics(lambda: self.forming.document(time.time()))
        if addr is None:
            return
        try:
            self.metrics = serve_metrics(addr)
        except (OSError, ValueError) as exc:
            raise SessionError(f"{exc} (choose another with --metrics HOST:PORT)") from None
        say(f"metrics at {self.metrics.url}")

    def _read_by_metrics(self, source: Callable[[], Mapping[str, Any]]) -> None:
        self._source = source
        metrics.set_source(source)

    async def _close_links(self) -> None:
        why, ended = NOT_FORMED, False
        if self.formed:
            ended = self.name == self.host or self.host_ended
            why = "the host ended the session" if ended else f"{self.name} was stopped and left the session"
            if self.left_out:
                why = f"{self.name} was counted lost and left the session"
            if self.handed_to is not None:
                why = f"{self.name} handed the session's host role over to {self.handed_to} and left"
        for link in self.links.values():
            with contextlib.suppress(Exception):
                await (link.close(why, ended) if self.formed else link.close(why))

    def borrow_listeners(self, kept: Listeners) -> None:
        """Joining again: serve on the listeners of the attempt before, which stay the caller's
        until this attempt forms (close() then leaves them open); they show this attempt's forming
        status."""
        self.listeners_borrowed = True
        self.api, self.metrics = kept.api, kept.metrics
        self.open_metrics(None)  # its scrapes read this attempt's forming status
        if self.api is not None:
            self.api.switch(forming_app(self.forming))

    async def open_api(self, security: ApiSecurity, limits: ApiLimits = DEFAULT_LIMITS) -> None:
        """Serve this member's API on the address reserved at its start (--api; none with --api
        off): while the session forms, /session says what the member is doing and every other
        route answers 503 (kafila.api.forming). `limits` bound its connections."""
        if self.api_socket is None:
            return
        sock, self.api_socket = self.api_socket, None  # the server's from now on, closed with it
        try:
            self.api = await ApiServer(
                forming_app(self.forming), sock, security=security, limits=limits
            ).start()
        except BaseException:
            sock.close()
            raise
        url = self.api.url
        say(f"API at {url} (503 until the session is ready; {url}/session says how forming goes)")

    def serve_as_spare(self, host: str, why: str) -> None:
        """The host keeps this member as a spare (`why`): until it is planned in, its API relays
        every request over the control link to `host`, whose API answers (kafila.api.spare)."""
        self.forming.spare, self.forming.host = why, host
        link, server = self.links.get(host), self.api
        if server is None or link is None or self.relay is not None:
            return
        self.relay = SpareRelay(link, host)
        server.switch(spare_app(self.forming, self.relay))
        say(f"API at {server.url} relays every request to the host {host} while this member is a spare")

    def serve_session_api(self) -> None:
        """Once every member is ready, the forming API becomes the session's: the next request gets
        the full app, on the same address (/session says "serving" only now)."""
        self.formed = True
        if self.driver is not None:
            self.driver.on_left = self._member_left
        self._read_by_metrics(self._serving_document)  # the role's state, queue and KV-cache slots
        server = self.api
        self.forming.spare = None  # planned in: /session is the ring's from now on
        if server is not None and self.app is not None:
            self.drain = Drain(self.app)
            server.switch(self.drain)
            url = server.url
            say(f"API at {url} (OpenAI {url}/v1, Ollama {url}/api, {url}/session)")

    def _member_left(self, member: str, reason: str) -> None:
        self.spawn(self._confirm_left(member, reason), "confirm_left")

    async def _confirm_left(self, member: str, reason: str) -> None:
        """The rendezvous says `member` left the session (`reason`: "left", "disconnected", ...):
        the ring breaks naming it (RoleBase.lose) once its link has heard nothing from it for
        LEFT_CONFIRM_PINGS of its PINGs, so requests get the broken answer at once instead of failing once the
        heartbeat's bound has passed. A link that still hears it means only its rendezvous
        connection went: the ring goes on. A member with no link to it leaves it to those with one,
        whose "broken" goes round the ring."""
        role, link = self.role, self.links.get(member)
        if role is None or member == self.name or member not in role.info.order:
            return
        if role.broken is not None and self.on_lost is None:  # broken already: nothing re-plans
            return
        if link is None:
            log.info("member_left_elsewhere", member=member, reason=reason)
            if role.broken is not None and self.on_lost is not None:  # a re-plan, or a hand-off, runs
                cause = departure_cause(reason)
                self.on_lost(member, cause.value, f"member {member} {reason}, the rendezvous says")
            return
        since, ping = asyncio.get_running_loop().time(), link.config.keepalive
        wait = LEFT_CONFIRM_PINGS * ping
        if not link.closed:
            await asyncio.sleep(wait)
            heard = link.last_heard
            if not link.closed and heard is not None and heard > since + ping:
                log.warning("member_left_but_linked", member=member, reason=reason)
                say(
                    f"the rendezvous says member {member} {reason}, but its link still answers: only its "
                    "connection to the rendezvous went; the ring goes on"
                )
                return
        if isinstance(link.error, LinkClosed):  # it closed the link saying why: that is the cause
            cause, detail = closed_by(link.error, str(link.error), member).cause, str(link.error)
        else:
            cause = departure_cause(reason)
            said = "left the session" if cause is Cause.LEFT else f"lost its connection ({reason})"
            detail = (
                f"member {member} {said}, the rendezvous says, and its link heard nothing from it for "
                f"{wait:g} s since"
            )
        if role.broken is None:
            role.lose(member, cause, detail)
        elif self.on_lost is not None:  # a loss during a re-plan: the host plans around it too
            self.on_lost(member, cause.value, detail)

    def watch_host_ending(self) -> None:
        """A joining member ends when the host ends the session on purpose: one of its links closes
        as LinkEnded (the host's, or a member's that ended because the host did), or a neighbour's
        "broken" that says so arrives first. `ended` gets the line to say, and the ring's "broken,
        answering 503" is not said. A host that crashed or went silent still leaves the member
        answering 503."""
        role = self.ring()
        ended = self.ended = asyncio.get_running_loop().create_future()

        def end() -> None:
            metrics.observe_state("ended")
            if not ended.done():
                role.on_broken, role.ending = None, True
                ended.set_result(f"the host {self.host} ended the session; this member stops")

        def closed(link: Link) -> None:
            if isinstance(link.error, LinkEnded):
                end()

        role.on_ended = end
        for link in self.links.values():
            link.on_close.append(partial(closed, link))
            if link.closed:  # closed before the member finished forming
                closed(link)


async def formed_by(kind: str, steps: Callable[[MemberRuntime], Awaitable[None]]) -> MemberRuntime:
    """A new runtime ("host" or "member") that `steps` fill until the session formed; if they fail
    or are cancelled, everything acquired so far is given back before the error goes on."""
    runtime = MemberRuntime(kind)
    try:
        with progress_to(runtime.forming.tell):
            await steps(runtime)
        return runtime
    except BaseException:
        await _to_the_end(runtime.close())
        raise


async def _to_the_end(closing: Awaitable[None]) -> None:
    """Await `closing` until it is done, however often the caller is cancelled meanwhile (a
    cancelled join still gives back its sockets before the cancellation goes on)."""
    task = asyncio.ensure_future(closing)
    while not task.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(task)
    if not task.cancelled():
        task.result()


def reserve_api(opts: Options) -> socket.socket | None:
    """This member's API address (--api), bound before the session forms: a taken port or an
    address this machine does not have is named now, not after probing, planning and loading."""
    if opts.api is None:
        return None
    host, port = parse_addr(opts.api)
    try:
        sock = bind_tcp(host, port)
    except OSError as exc:
        raise SessionError(
            f"cannot serve the API on {host}:{port}: {exc.strerror or exc} "
            "(choose another with --api HOST:PORT, or --api off)"
        ) from exc
    try:
        check_exposure(host, port, opts.api_security)  # open to other machines: a key, or said insecure
    except ApiSecurityError as exc:
        sock.close()
        raise SessionError(str(exc)) from None
    return sock
