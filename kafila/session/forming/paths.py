"""Paths that change while serving: each member watches its own links and tells the host (over its
control link, kafila.proto.session's `path`) when one has settled on another path, so the host
re-prices the ring with what runs (kafila.planner.replan.with_path, on_measured) and re-plans when
that is more than the head margin faster.

A link moves to the relay after 1 s of silence on its direct path and tries the direct path again
every 10 s (kafila.net.edge's re-punch). A blip is not a measurement: a path counts once it has
held for `SETTLE_S`, longer than one re-punch, so a cable that comes back within a re-punch
re-plans nothing. A link whose first round of punching is over when it is first watched reports
its path at once: that is the measurement forming made (a member-to-member edge that relays
against the plan, which only the host's own edges were checked for before the plan).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from functools import partial

from kafila.net.link import Link, PathChange, PathKind
from kafila.obs.log import get_logger

log = get_logger("kafila.session.forming.paths")

SETTLE_S = 12.0  # a path that holds this long is measured (longer than kafila.net.edge's 10 s re-punch)


class PathWatch:
    """Calls `report(peer, direct)` once a watched link has settled on a path other than the one
    last reported for that peer (the first settled path is always reported)."""

    def __init__(self, report: Callable[[str, bool], None], settle_s: float = SETTLE_S) -> None:
        self.report = report
        self.settle_s = settle_s
        self._watched: set[int] = set()  # id() of the links watched (a new epoch brings new links)
        self._told: dict[str, bool] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}

    def watch(self, links: Mapping[str, Link]) -> None:
        """Watch every link in `links` not watched yet (idempotent: call it again after a move)."""
        for peer, link in links.items():
            if id(link) in self._watched or link.closed:
                continue
            self._watched.add(id(link))
            link.on_path_change.append(partial(self._changed, peer, link))
            self._arm(peer, link, 0.0 if link.punch_over.is_set() else self.settle_s)

    def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()

    def _changed(self, peer: str, link: Link, change: PathChange) -> None:
        self._arm(peer, link, self.settle_s)

    def _arm(self, peer: str, link: Link, delay: float) -> None:
        old = self._timers.pop(peer, None)
        if old is not None:
            old.cancel()
        self._timers[peer] = asyncio.get_running_loop().call_later(delay, self._settled, peer, link)

    def _settled(self, peer: str, link: Link) -> None:
        self._timers.pop(peer, None)
        if link.closed or link.path is None:
            return
        direct = link.path is PathKind.DIRECT
        if self._told.get(peer) == direct:
            return
        self._told[peer] = direct
        log.info("path_settled", peer=peer, path=link.path.value, settle_s=self.settle_s)
        self.report(peer, direct)
