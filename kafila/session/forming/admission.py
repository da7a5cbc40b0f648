"""The host admits members one by one as they join (asyncio shell around HostFormation's `Admit`).

The host links with each member as it joins, while both still measure themselves: that link
is the control link the member's weights will come over, and its authentication (SPAKE2 on the
session code's secret words, kafila.net.auth) proves the member holds the whole code, within a
second or so of joining rather than after both probes. The outcome goes back to the core
(`admitted` / `not_admitted`, through the driver's inbox, with the `now` of when it is read): a
member that cannot prove the code is refused and removed from the session at the rendezvous, and
its place stays open for a right member, where it used to be planned and then end the session for
everyone when the ring's links failed.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable

from kafila.net.edge import EdgeOptions, LinkNode, connect_edge
from kafila.net.errors import LinkAuthError, LinkError
from kafila.net.link import Link
from kafila.obs.log import get_logger
from kafila.session.forming import core as fm
from kafila.session.forming.core import HostFormation
from kafila.session.forming.driver import Driver
from kafila.session.forming.links import named

log = get_logger("kafila.session.forming.admission")

WRONG_CODE = "its session code's secret words differ from the host's (a mistyped word?)"
WRONG_OWN_CODE = "this member's session code's secret words differ from the host's (a mistyped word?)"
# A member joins at the rendezvous before it can link: it then binds its API and its link node and
# classifies its NAT (a second or so; more on a machine busy with other members' probes), so the host
# waits longer for its link offer than an edge between members that are both ready does (10 s).
ADMISSION = EdgeOptions(signal_timeout=20.0)


class Admission:
    """The host's links with the members that joined, by member id (see the module's doc)."""

    def __init__(self, node: LinkNode, me: str, drive: Driver) -> None:
        self.node, self.me, self.drive = node, me, drive
        self.links: dict[int, Link] = {}
        self.jobs: dict[int, asyncio.Task[None]] = {}
        self._closing: set[asyncio.Task[None]] = set()
        drive.on_admit = self.start

    def start(self, admit: fm.Admit) -> None:
        """Link with `admit.member` (the member is the link's client, as in kafila.session.form.link_ring)."""
        self.jobs[admit.member] = asyncio.ensure_future(self._link(admit))

    async def _link(self, admit: fm.Admit) -> None:
        core = self.drive.core
        assert isinstance(core, HostFormation)
        try:
            link = await named(self.me, admit.name, connect_edge(self.node, admit.member, False, ADMISSION))
        except LinkError as exc:
            why = WRONG_CODE if isinstance(exc, LinkAuthError) else str(exc)
            log.warning("member_not_admitted", member=admit.member, name=admit.name, error=str(exc))
            self.drive.inbox.put_nowait(lambda now: core.not_admitted(admit.member, why, now))
            return
        self.links[admit.member] = link

        def settle(now: float) -> list[fm.Output]:
            out = core.admitted(admit.member, now)
            if admit.member not in core.admitted_ids:  # it left meanwhile, or the attempt timed out
                self._drop(admit.member, "member left before it was admitted")
            return out

        self.drive.inbox.put_nowait(settle)

    def take(self, members: Iterable[int]) -> dict[int, Link]:
        """The links of the plan's `members`; every other link is closed and every link still
        forming stopped (members that left meanwhile)."""
        keep = set(members)
        for member, job in self.jobs.items():
            if not job.done():
                job.cancel()
            if member not in keep:
                self._drop(member, "member not in the plan")
        return {m: link for m, link in self.links.items() if m in keep}

    async def close(self, why: str) -> None:
        """Stop every link still forming and close every link (the session did not form)."""
        for job in self.jobs.values():
            job.cancel()
        for link in self.links.values():
            with contextlib.suppress(Exception):
                await link.close(why)
        self.links.clear()

    def _drop(self, member: int, why: str) -> None:
        link = self.links.pop(member, None)
        if link is not None:
            task = asyncio.ensure_future(link.close(why))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)
