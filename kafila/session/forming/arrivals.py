"""Members that arrive at a serving session: one lost coming back (`kafila join CODE`, same name) or
a new one. The host admits it as at forming, then lets the planner decide (kafila.planner.replan.
on_arrived, pure): plan it in with a new epoch, or keep it waiting as a spare.

    host (serving)                                   newcomer (`kafila join CODE`)
    rendezvous: member_joined                        joined; links with the host, measures itself
    link with it (its authentication proves the code, kafila.session.forming.admission)
                                                <-   `report` (its DeviceReport)
    replan.on_arrived(membership, report)
      Keep: `spare` (why: the gain and the margin) ->  says it waits as a spare, waits for a plan
      Replan: the survivors get `epoch` on their control links (as for a loss, with the new ids);
        the newcomer gets `plan` with the epoch   ->   links its ring edges, fetches its shard by
        (and later a spare planned in on a loss)       byte range, starts its role in that epoch
                                                <-   `ready`
      every member ready: the head resumes (requests in flight re-prefilled), `resume` to the
      survivors, `formed` to the newcomer         ->   serving

The forming messages (`report`, `spare`, `plan`, `ready`, `formed`) go over signaling, as at forming;
the newcomer's control link carries the epoch messages from then on, as every member's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field, replace

from kafila.net.edge import LinkNode, connect_edge
from kafila.net.errors import LinkAuthError, LinkError
from kafila.net.link import Link
from kafila.net.signaling import SignalingClosed, SignalingError
from kafila.net.waits import wait_at_most
from kafila.obs.log import get_logger
from kafila.planner.cost import fmt_bytes
from kafila.planner.devices import DeviceReport
from kafila.planner.replan import End, Keep, Replan, on_arrived, with_member
from kafila.planner.succession import succession_order
from kafila.proto import session as sm
from kafila.session.errors import SessionError
from kafila.session.forming import core as fm
from kafila.session.forming.admission import ADMISSION, WRONG_CODE
from kafila.session.forming.core import HostFormation
from kafila.session.forming.driver import Driver
from kafila.session.forming.epochs import HostEpochs
from kafila.session.forming.links import named
from kafila.session.progress import say
from kafila.session.ring.origins import OriginsSpent
from kafila.session.ring.relay import SpareAsks, relay_app

log = get_logger("kafila.session.forming.arrivals")


def arrival_name(report: DeviceReport, member: int, present: frozenset[str]) -> DeviceReport:
    """The report under the name it keeps in the session: its own (a name the session knew but
    lost is a member coming back), unless a member present has it: then its member id is
    appended, as at forming."""
    if report.name not in present:
        return report
    return DeviceReport.from_dict({**report.to_dict(), "name": f"{report.name}-{member}"})


@dataclass
class Newcomer:
    """A member that joined the serving session, from its join until it serves or leaves."""

    member: int
    name: str  # at the rendezvous, then the name it keeps
    report: asyncio.Future[DeviceReport] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )
    job: asyncio.Task[None] | None = None  # its admission, then the re-plan that takes it in
    moving: bool = False  # the re-plan runs: its leaving fails that move, never cancels it


class HostArrivals:
    """The host's admission of members into its serving session (see the module's doc)."""

    def __init__(self, epochs: HostEpochs, drive: Driver, node: LinkNode) -> None:
        self.epochs, self.drive, self.node = epochs, drive, node
        self.coming: dict[int, Newcomer] = {}  # member id -> newcomer, until it serves or leaves
        self.spares: dict[str, int] = {}  # spares waiting: name -> member id
        epochs.arrivals = self
        drive.on_event = self.handle
        epochs.held.ring().spares = []

    # ------------------------------------------------------------ the driver's events

    def handle(self, event: fm.Event) -> bool:
        """The events about members that joined once the session formed (True: taken here)."""
        if isinstance(event, fm.Joined):
            return self._joined(event)
        if isinstance(event, fm.Left):
            return self._left(event)
        if isinstance(event, fm.OtherVersion):  # the core refuses it in its own version
            return False
        newcomer = self.coming.get(event.sender)
        if newcomer is None:
            return False
        op = event.body.get("op")
        if op == "report" and not newcomer.report.done():
            try:
                device = DeviceReport.from_dict(sm.Report.parse(event.body).device)
            except (KeyError, TypeError, ValueError) as exc:
                newcomer.report.set_exception(SessionError(f"its report is unreadable: {exc}"))
            else:
                newcomer.report.set_result(device)
        elif op in ("ready", "failed"):
            self._settled(newcomer, event.body)
        return True

    def _joined(self, event: fm.Joined) -> bool:
        core = self.drive.core
        if not isinstance(core, HostFormation) or event.member in core.joined or event.member in self.coming:
            return False
        newcomer = Newcomer(event.member, event.name)
        self.coming[event.member] = newcomer
        say(f"{event.name} joined the serving session; linking with it to check its session code")
        newcomer.job = self.epochs.held.spawn(self._admit(newcomer), f"admit {event.name}")
        return True

    def _left(self, event: fm.Left) -> bool:
        newcomer = self.coming.pop(event.member, None)
        if newcomer is not None:
            if newcomer.job is not None and not newcomer.moving:
                newcomer.job.cancel()
            name, epochs = newcomer.name, self.epochs
            if epochs.moving_into(name):  # it was moving into the ring: that move fails
                epochs.failed(name, None, f"{name} {event.went} while joining the ring")
            elif name in self.spares:
                epochs.membership = replace(epochs.membership, present=epochs.membership.present - {name})
                say(f"spare {name} {event.went}")
            else:
                say(f"{name} {event.went} before it was planned in")
            self._forget_spare(name)
            return True
        return False

    def _settled(self, newcomer: Newcomer, body: dict[str, object]) -> None:
        epochs = self.epochs
        if not epochs.moving_into(newcomer.name):
            return
        if body.get("op") == "ready":
            epochs.ready(newcomer.name)
            return
        try:
            why = sm.Failed.parse(body).reason
        except sm.SessionMessageError as exc:
            why = f"(its reason unreadable: {exc})"
        epochs.failed(newcomer.name, None, f"{newcomer.name} could not join the ring: {why}")

    # ------------------------------------------------------------ admission, then the planner

    async def _admit(self, newcomer: Newcomer) -> None:
        epochs = self.epochs
        held = epochs.held
        try:
            link = await named(
                held.name, newcomer.name, connect_edge(self.node, newcomer.member, False, ADMISSION)
            )
        except LinkError as exc:
            why = WRONG_CODE if isinstance(exc, LinkAuthError) else str(exc)
            await self._refuse(newcomer, f"{newcomer.name} was not admitted: {why}", why)
            return
        say(f"{newcomer.name} holds the session code; waiting for its report")
        within = epochs.opts.wait_s  # the host's --wait, as at forming (a probe takes 10-20 s)
        try:
            report = await wait_at_most(asyncio.shield(newcomer.report), within)
        except (TimeoutError, SessionError) as exc:
            why = f"no report within {within:g} s" if isinstance(exc, TimeoutError) else str(exc)
            await link.close(why)
            await self._refuse(newcomer, f"{newcomer.name} was not admitted: {why}", why)
            return
        m = epochs.membership
        report = arrival_name(report, newcomer.member, m.present)
        back = report.name in {r.name for r in m.reports}
        newcomer.name = report.name
        try:
            epochs.admit(report.name, newcomer.member, link)
        except OriginsSpent as exc:
            await link.close(str(exc))
            told = f"the host admits no other member: {exc}"
            await self._refuse(newcomer, f"{newcomer.name} was not admitted: {exc}", str(exc), told)
            return
        self._relay(report.name, link)
        came = "is back" if back else "arrived"
        say(f"{report.name} {came}: {fmt_bytes(report.memory_bytes)} for weights")
        await epochs.idle()  # one change at a time: a re-plan running finishes first
        await self._decide(newcomer, report, time.monotonic())

    async def _decide(self, newcomer: Newcomer, report: DeviceReport, at: float) -> None:
        epochs = self.epochs
        m = epochs.membership
        decision = on_arrived(epochs.priced(), report, epochs.manifest, epochs.terms)
        grown = with_member(m, report)
        if isinstance(decision, Replan) and decision.plan.head != m.plan.head:
            decision = Keep(
                f"{report.name} waits as a spare: the plan with it moves the head from {m.plan.head} to "
                f"{decision.plan.head}, which this version cannot do with requests in flight",
                m.plan,
            )
        if isinstance(decision, Keep | End):
            reason = decision.reason
            epochs.membership = grown
            self.spares[report.name] = newcomer.member
            self._show_spares()
            say(reason)
            log.info("spare", member=report.name, reason=reason)
            await self._signal(newcomer.member, sm.Spare(reason).body())
            return
        epochs.membership = grown
        newcomer.moving = True
        await epochs.arrive(decision, at)

    def _relay(self, name: str, link: Link) -> None:
        """Answer what `name` relays over its control link while it is a spare (kafila.session.ring.
        relay): through the host's own API app and ring role, as the host's own clients' requests."""
        held = self.epochs.held
        app = None if held.app is None else relay_app(held.app.state.api, held.ring, name)
        SpareAsks(name, link, app)

    async def invite(self, name: str, decision: Replan) -> None:
        """`name` (a newcomer, or a spare planned in) gets the re-plan as its `plan`."""
        epochs = self.epochs
        member = epochs.ids[name]
        serving = epochs.serving
        ids = dict(epochs.ids)
        plan = sm.PlanMessage(
            decision.plan.to_dict(),
            ids,
            serving.terms,
            serving.alternatives,
            decision.epoch,
            epochs.origins.named(ids),
            succession_order(decision.plan, epochs.membership.host),
            {r.name: r.to_dict() for r in epochs.membership.reports},
        )
        self._forget_spare(name)
        if member not in self.coming:
            self.coming[member] = Newcomer(member, name)
        await self._signal(member, plan.body(), strict=True)

    async def welcome(self, names: list[str]) -> None:
        """Every member is ready: the newcomers planned in serve (`formed`)."""
        ids, core = self.epochs.ids, self.drive.core
        for name in names:
            self.coming.pop(ids[name], None)
            if isinstance(core, HostFormation):  # its leaving at the rendezvous now names it
                core.joined[ids[name]] = name
            await self._signal(ids[name], sm.AllReady().body())

    def _forget_spare(self, name: str) -> None:
        if self.spares.pop(name, None) is not None:
            self._show_spares()

    def _show_spares(self) -> None:
        self.epochs.held.ring().spares = sorted(self.spares)

    async def _refuse(self, newcomer: Newcomer, reason: str, why: str, told: str | None = None) -> None:
        self.coming.pop(newcomer.member, None)
        log.warning("member_not_admitted", member=newcomer.member, name=newcomer.name, error=why)
        told = told or (
            f"this member could not link with the host ({why}); join again with the exact code the "
            "host printed"
        )
        await self._signal(newcomer.member, sm.Refused(told).body())
        with contextlib.suppress(SignalingError, SignalingClosed):
            await self.drive.client.remove(newcomer.member, reason)
        say(f"{reason}; removed from the session")

    async def _signal(self, member: int, body: dict[str, object], strict: bool = False) -> None:
        try:
            await self.drive.client.signal(member, body)
        except (SignalingError, SignalingClosed) as exc:
            if strict:
                raise SessionError(f"could not reach member {member} through the rendezvous: {exc}") from exc
            log.warning("arrival_signal_failed", member=member, error=str(exc))
