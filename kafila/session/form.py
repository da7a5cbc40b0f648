"""Forming a session: host and join, from the session code to a serving ring (asyncio shell).

    host: open the session at the rendezvous -> print the code -> classify NAT, probe itself ->
          wait for N-1 members' reports, linking with each as it reports (the control link, whose
          authentication admits it; kafila.session.admission) -> plan (or refuse, naming the
          device) -> send the plan -> link the plan's other edges -> serve weights -> ring
    join: join with the code -> classify NAT, probe itself -> report and link with the host ->
          receive the plan -> link its ring edges -> fetch its tensors -> ring

The steps and the session messages (`report`, `plan`, `refused`, `ready`: signaling payloads the
rendezvous forwards unread) are decided by the pure state machines of kafila.session.formation;
`Driver` here feeds them the signaling events and the clock and carries out what they return.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import socket
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kafila.engine import PREFILL_CHUNK
from kafila.engine.pace import Pace
from kafila.net.edge import EdgeOptions, LinkNode, SignalRouter, connect_edge
from kafila.net.endpoint import UdpEndpoint
from kafila.net.errors import LinkError, NatProbeError
from kafila.net.link import Link, LinkConfig
from kafila.net.signaling import SignalingClient, SignalingClosed
from kafila.obs.log import get_logger
from kafila.obs.trace import SessionRecord, TraceLog
from kafila.planner.cost import fmt_bytes
from kafila.planner.devices import DeviceReport
from kafila.planner.plan import Plan
from kafila.proto import signaling as sig
from kafila.proto.codes import SessionCode, new_code, parse_code
from kafila.session import formation as fm
from kafila.session.formation import HostFormation, MemberFormation
from kafila.session.schedule import DEFAULT_QUEUE

log = get_logger("kafila.session.form")
T = TypeVar("T")
R = TypeVar("R")
FIRST = asyncio.FIRST_COMPLETED


DEFAULT_RENDEZVOUS = f"ws://127.0.0.1:{sig.DEFAULT_PORT}{sig.SIGNAL_PATH}"  # `kafila rendezvous` here


class SessionError(RuntimeError):
    """Forming the session failed; the message says at which step and why."""


@dataclass
class Options:
    rendezvous: str = DEFAULT_RENDEZVOUS
    name: str | None = None
    api: str | None = "127.0.0.1:11434"  # None: no API on this member
    backend: str = "auto"
    dtype: str = "auto"  # host: the session's (auto: the checkpoint's); a member takes the host's
    memory_bytes: int | None = None  # cap on what this member offers (default: the probe's figure)
    probe_repeats: int = 2
    wait_s: float = 300.0  # host: how long to wait for the members
    trace: Path | None = None
    cache: Path | None = None
    use_local: bool = True  # a member that holds the same checkpoint loads it instead of fetching
    dead_after: float = 5.0
    emulate_speed: float = 1.0  # < 1: emulate a slower device (kafila.engine.pace)
    # host only
    model: str = "smollm2-135m"
    members: int = 1
    context: int = 2048
    concurrency: int = 1
    division: str = "kafila"
    objective: str = "load"  # what the kafila division minimizes (kafila.planner.decide.OBJECTIVES)
    chunk: int = PREFILL_CHUNK  # prompt tokens per prefill step (as `kafila run`'s)
    queue: int = DEFAULT_QUEUE  # requests that may wait for a slot at the head; more get 429

    def __post_init__(self) -> None:
        """Refuse what cannot work here before anything connects (ValueError, one line)."""
        from kafila.api.server import parse_addr
        from kafila.probe.system import usable_cpus
        from kafila.session.weights import cache_problem

        self.pace.check_cpus(usable_cpus())
        if self.api is not None:
            parse_addr(self.api)  # a malformed --api is named before anything connects
        if self.trace is not None:
            TraceLog.check(self.trace)
        if problem := cache_problem(self.cache):
            raise ValueError(problem)

    @property
    def pace(self) -> Pace:
        return Pace(self.emulate_speed)


@dataclass
class Peer:
    id: int
    name: str


@dataclass
class Formed:
    """Everything a running member holds; `close()` ends it."""

    name: str
    code: SessionCode
    plan: Plan
    service: Any  # RingHead | RingMember
    api: Any | None  # ApiServer
    client: SignalingClient
    node: LinkNode
    links: dict[str, Link]
    host: str = ""  # the host's name: the host ending its session ends every member's
    app: Any = None  # the session's API app, which `api` serves once the session has formed
    tasks: list[asyncio.Task[Any]] = field(default_factory=list)
    # a joining member's: done, with the line to say, when the host ended the session on purpose
    ended: asyncio.Future[str] | None = None

    @property
    def host_ended(self) -> bool:
        """A joining member's: the host ended the session (not: this member was stopped)."""
        return self.ended is not None and self.ended.done() and not self.ended.cancelled()

    async def close(self) -> None:
        """End this member's part: API, ring role, links. The host's links close as `ended`, so
        every member learns that the session is over (rather than that its ring broke), and so do
        the links of a member that ends because the host did: whichever close reaches a member
        first says the same."""
        if self.api is not None:
            await self.api.stop()
        await self.service.stop()
        self.service.model.close()
        ended = self.name == self.host or self.host_ended
        why = "the host ended the session" if ended else f"{self.name} was stopped and left the session"
        for link in self.links.values():
            with contextlib.suppress(Exception):
                await link.close(why, ended)
        for task in self.tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await self.client.close("session ended")
        self.node.endpoint.close()


async def off_loop(fn: Callable[..., R], *args: Any) -> R:
    """`fn(*args)` on a daemon thread of its own. Unlike `asyncio.to_thread`, whose pool the loop
    joins at exit, a member stopped meanwhile (Ctrl-C, SIGTERM) ends without waiting for it: a
    probe or a stage's load takes 10 s and more, past `docker stop`'s grace period."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future[R] = loop.create_future()

    def settle(outcome: tuple[bool, Any]) -> None:
        ok, value = outcome
        if done.done():  # the awaiting task was cancelled
            return
        if ok:
            done.set_result(value)
        else:
            done.set_exception(value)

    def run() -> None:
        try:
            outcome: tuple[bool, Any] = (True, fn(*args))
        except BaseException as exc:  # handed to the awaiting task, as to_thread does
            outcome = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits for it any more
            loop.call_soon_threadsafe(settle, outcome)

    name = f"{OFF_LOOP}{getattr(fn, '__name__', 'work')}"
    context = contextvars.copy_context()  # as asyncio.to_thread: the caller's progress hook
    threading.Thread(target=context.run, args=(run,), name=name, daemon=True).start()
    return await done


OFF_LOOP = "kafila-off-loop-"  # the threads' names


def off_loop_busy() -> bool:
    """An `off_loop` call still runs (the member was stopped during its probe or stage load)."""
    return any(t.name.startswith(OFF_LOOP) and t.is_alive() for t in threading.enumerate())


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


# told every progress line of the host() or join() whose task (or a task or off_loop thread it
# started) says it: the forming member's status, which its API's /session shows
_progress: contextvars.ContextVar[Callable[[str], None] | None] = contextvars.ContextVar(
    "kafila_progress", default=None
)


def say(text: str) -> None:
    """Progress for the person at the terminal (stderr; stdout stays for results)."""
    print(f"kafila: {text}", file=sys.stderr, flush=True)
    note(text)


def note(text: str) -> None:
    """What this member is doing now, for its forming status only (no line at the terminal)."""
    if (hook := _progress.get()) is not None:
        hook(text)


@contextlib.contextmanager
def progress_to(hook: Callable[[str], None]) -> Iterator[None]:
    """Within the block, tell `hook` every progress line of the calling task (and of the tasks and
    off_loop threads it starts, which keep telling it)."""
    token = _progress.set(hook)
    try:
        yield
    finally:
        _progress.reset(token)


class Driver:
    """The thin shell around a formation core (kafila.session.formation): feeds it the signaling
    events and the clock, and carries out its outputs (progress lines, signals; a failure becomes
    a SessionError)."""

    def __init__(
        self, core: HostFormation | MemberFormation, client: SignalingClient, router: SignalRouter
    ) -> None:
        self.core, self.client, self.router = core, client, router
        self._next: asyncio.Task[sig.ServerMessage] | None = None
        self._lost: asyncio.Task[SignalingClosed] | None = None
        # the shell's own results for the core, as steps of it taking `now` (kafila.session.admission)
        self.inbox: asyncio.Queue[Callable[[float], list[fm.Output]]] = asyncio.Queue()
        self._inbox_next: asyncio.Task[Callable[[float], list[fm.Output]]] | None = None
        self.on_admit: Callable[[fm.Admit], None] | None = None  # the host's: link with that member

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
            elif isinstance(out, fm.Rejected):
                log.warning("session_message_rejected", member=out.member, reason=out.reason)
            elif isinstance(out, fm.Failed):
                log.warning("session_not_formed", reason=out.reason)
                raise SessionError(out.reason)
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

    async def serve_formed(self, formed: Formed) -> None:
        """After forming (a task until the member ends): keep feeding the core, so the host refuses
        whoever joins the formed session, and say when the rendezvous is lost (the ring's direct
        links do not need it; this member's links on the relay do), also on /session (its
        "rendezvous" "state" becomes "lost", with the "reason")."""
        self.close()
        links, status = formed.links, formed.service.info.rendezvous
        lost = asyncio.ensure_future(self.client.lost())
        try:
            while True:
                nxt = asyncio.ensure_future(self.router.others.get())
                done, _ = await asyncio.wait({nxt, lost}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    why = lost.result().message
                    status.update(state="lost", reason=why)
                    relayed = sorted(p for p, link in links.items() if link.path == "relay")
                    say(
                        f"lost the rendezvous: {why}. The ring goes on serving on its direct links; a "
                        "relayed link and new sessions need it (this member does not reconnect)"
                        + (
                            f"; this member's links to {', '.join(relayed)} are relayed: they carry on "
                            "if the rendezvous restarts soon with the same relay secret"
                            if relayed
                            else ""
                        )
                    )
                    return
                event = self._translate(nxt.result())
                if isinstance(event, fm.Left):  # the ring notices on its own links; logged above
                    continue
                if event is not None:
                    await self.carry(self.core.handle(event, self.now()))
        except SessionError as exc:  # a fatal error from the rendezvous, or a refusal it could not take
            status.update(state="lost", reason=str(exc))
            say(f"the rendezvous: {exc}; the ring goes on serving on its direct links")
        finally:
            lost.cancel()

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
        if isinstance(event, sig.SignalFrom) and event.payload.get(fm.KEY) == 1:
            return fm.Message(event.sender, event.payload)
        if isinstance(event, sig.MemberJoined):
            return fm.Joined(event.member.id, event.member.name)
        if isinstance(event, sig.MemberLeft):
            name = self.core.name_of(event.member)
            log.warning("member_left", member=name, id=event.member, reason=event.reason)
            return fm.Left(event.member, event.reason)
        if isinstance(event, sig.Error) and event.fatal:
            raise SessionError(f"the rendezvous ended the session: {event.message}")
        return None


# A session's links notice a silent direct path well inside the ring's liveness (--dead-after,
# 5 s by default) and go on over the relay: silence for 3 s, checked every second, with a PING every
# second to tell silence from an idle link. (The link's defaults, 6 s checked every 2 s, let the
# ring break first: the request failed 4.4 s after the path was cut, the relay took over 3 s later.)
SESSION_LINKS = LinkConfig(keepalive=1.0, dead_after=3.0)


async def connect_node(client: SignalingClient, code: SessionCode, url: str) -> LinkNode:
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("0.0.0.0", 0))
    host = url.split("://", 1)[-1].split("/", 1)[0].rsplit(":", 1)[0].strip("[]")
    router = SignalRouter(client)
    endpoint = await UdpEndpoint.open(sock)
    try:
        node = await LinkNode.joined(endpoint, router, code, host)
    except NatProbeError as exc:  # the rendezvous's UDP address: not a firewall's fault
        endpoint.close()
        raise SessionError(f"cannot use the rendezvous's UDP ports: {exc}") from exc
    node.config = SESSION_LINKS
    try:
        await node.classify_nat()
    except NatProbeError as exc:
        node.endpoint.close()
        raise SessionError(
            f"cannot classify this member's NAT: {exc} (the rendezvous's UDP ports must be reachable "
            "from here: a firewall in between, or a container without its UDP ports published?)"
        ) from exc
    return node


def probe_report(
    name: str, node: LinkNode, opts: Options, config: dict[str, Any] | None = None
) -> DeviceReport:
    """This member measured (E3's probe). With the session model's config.json the probe also
    times one decode step of one synthetic block of that model, which the planner prefers."""
    from kafila.models.config import ConfigError, ModelConfig
    from kafila.probe.measure import probe

    say("measuring this device (memory bandwidth, dispatch overhead, memory, one block of the model)")
    try:
        model = ModelConfig.from_dict(config) if config else None
    except (ConfigError, ValueError, TypeError):
        model = None
    pace = opts.pace
    if pace.emulated:
        say(f"{name}: emulating a slower device, {pace.speed:g} of this machine's speed (--emulate-speed)")
    report = probe(
        opts.backend, opts.dtype, repeats=opts.probe_repeats, model=model, model_name=opts.model, pace=pace
    )
    nat = node.nat.nat if node.nat else None
    rtt = node.nat.rtt_median if node.nat else None
    device = report.device_report(name, nat=nat, rtt_s=rtt)
    device = capped(device, opts.memory_bytes)
    say(
        f"{name}: {report.bandwidth.median / 1e9:.1f} GB/s, {fmt_bytes(device.memory_bytes)} for weights, "
        f"NAT {nat.cls if nat else 'unknown'}"
    )
    return device


def capped(device: DeviceReport, offered: int | None) -> DeviceReport:
    """The report offering at most `offered` bytes (--memory-gb): a cap, never more than measured."""
    if offered is None:
        return device
    if offered > device.memory_bytes:
        say(
            f"{device.name}: --memory-gb {offered / 1e9:g} is more than this device has for weights "
            f"({device.memory_bytes / 1e9:.1f} GB): offering {device.memory_bytes / 1e9:.1f} GB"
        )
        return device
    return DeviceReport.from_dict({**device.to_dict(), "memory_bytes": offered})


async def link_ring(
    node: LinkNode,
    plan: Plan,
    me: str,
    ids: dict[str, int],
    host: str,
    formed: dict[int, Link] | None = None,
) -> dict[str, Link]:
    """One authenticated link per pair of members that talk: ring neighbours, and the host with
    every member (the weight fetch). Returns this member's links by peer name. A link carries both
    directions, so a ring of two and the host's control links reuse the ring edges, and a link in
    `formed` (by peer id: the control links, formed before the plan) is used as it is."""
    pairs: dict[frozenset[str], tuple[str, str]] = {}  # pair -> (client, server)
    for m in plan.order:
        n = plan.successor(m)
        if m != n:
            pairs.setdefault(frozenset((m, n)), (m, n))
    for m in plan.order:
        if m != host:
            pairs.setdefault(frozenset((m, host)), (m, host))
    direct = {frozenset((e.src, e.dst)): e.direct for e in plan.edges}
    jobs: dict[str, asyncio.Future[Link]] = {}
    formed = formed or {}
    for pair, (client, server) in pairs.items():
        if me in pair:
            peer = server if client == me else client
            if ids[peer] in formed:
                jobs[peer] = asyncio.get_running_loop().create_future()
                jobs[peer].set_result(formed[ids[peer]])
                continue
            opts = EdgeOptions(predicted_direct=direct.get(pair, True))
            jobs[peer] = asyncio.ensure_future(
                named(me, peer, connect_edge(node, ids[peer], client == me, opts))
            )
    try:  # every member proved the session's code to the host before the plan (admission.py), so
        # a ring edge that does not authenticate means tampering: its error says so
        links = dict(zip(jobs, await asyncio.gather(*jobs.values()), strict=True))
    finally:
        for job in jobs.values():
            job.cancel()  # after a failure: the links still forming
    for peer, link in links.items():
        say(f"link {me} <-> {peer}: {link.path}")
    return links


async def named(me: str, peer: str, link: Awaitable[Link]) -> Link:
    """`link`, its failure naming the two members (the link layer knows only their ids: "edge 2->3")."""
    try:
        return await link
    except LinkError as exc:
        exc.args = (f"link {me} <-> {peer}: {exc}", *exc.args[1:])
        raise


def session_record(plan: Plan, session: str, model: str, edges: dict[str, str]) -> SessionRecord:
    return SessionRecord(
        session=session,
        model=model,
        division=plan.division,
        order=tuple(plan.order),
        head=plan.head or plan.order[0],
        blocks={s.name: (s.start, s.stop) for s in plan.stages},
        predicted_stage_ms={s.name: (s.cost_s or 0.0) * 1e3 for s in plan.stages},
        predicted_bottleneck_ms=(plan.bottleneck_s or 0.0) * 1e3,
        predicted_circuit_ms=(plan.circuit_s or 0.0) * 1e3,
        edges=edges,
    )


def default_name() -> str:
    return socket.gethostname().split(".")[0][:24] or "member"


def fmt_plans(plans: dict[str, Plan]) -> str:
    """The chosen division next to the uniform and memory-proportional predictions."""
    rows = [
        f"{'division':<9} {'blocks per member':<40} {'bneck ms':>9} {'imbal':>6} {'util':>5} {'tok/s':>7}"
    ]
    for name, p in plans.items():
        if not p.feasible:
            rows.append(f"{name:<9} refused: {p.reason}")
            continue
        blocks = " ".join(f"{s.name}:{s.n_blocks}" for s in p.stages)
        rows.append(
            f"{name:<9} {blocks:<40} {(p.bottleneck_s or 0) * 1e3:>9.2f} {p.imbalance or 0:>6.2f} "
            f"{p.utilisation or 0:>5.0%} {p.tokens_s or 0:>7.1f}"
        )
    notes = dict.fromkeys(n for p in plans.values() for n in p.notes)  # once each, in order
    return "\n".join(rows + [f"note: {n}" for n in notes])


Progress = Callable[[str], None]
__all__ = ["Formed", "Options", "SessionError", "new_code", "parse_code"]
