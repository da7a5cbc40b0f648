"""Back to the rendezvous after a formed member lost it: reconnect with back-off, register again.

The ring does not need the rendezvous to serve (its links are peer to peer), so losing it changes
nothing for running requests; what needs it is a new member's join, signaling for new links and
the relay. `back_to_rendezvous` retries on the capped exponential schedule of kafila.net.backoff
until the rendezvous takes this member back (the host re-opens its session under the same code,
a member takes its place back: SignalingClient.reconnect) or refuses in a way no retry mends. It
keeps the /session "rendezvous" block current (state, attempt, reason) and says one line per
change of state, not one per attempt.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Callable, Mapping
from typing import Any

from websockets.exceptions import WebSocketException

from kafila.net.backoff import Backoff
from kafila.net.link import Link
from kafila.net.signaling import SignalingClient, SignalingError, unreachable_reason
from kafila.obs.log import get_logger
from kafila.session.progress import say

log = get_logger("kafila.session.forming")

# refusals that a later attempt may not get: the rendezvous is still starting or busy, this member's
# old connection is not timed out yet, or (a member) its host has not re-opened the session yet
RETRY = frozenset(
    {
        "closed",
        "unknown_session",
        "not_ready",
        "rate_limited",
        "member_present",
        "limit",
        "internal",
        "timed_out",
    }
)


# fatal errors after which a formed member registers again: its connection fell silent (a laptop
# that slept), or a session of one member outlived its code's time; not "removed" by the host
REREGISTER_AFTER = frozenset({"timed_out", "code_expired"})
SCHEDULE = Backoff()  # 0.5 s doubling to 30 s, jittered


def lost_line(why: str, links: Mapping[str, Link]) -> str:
    """What a member says when it loses the rendezvous."""
    relayed = sorted(p for p, link in links.items() if link.path == "relay")
    on_relay = (
        f"; its links to {', '.join(relayed)} are relayed: they carry on if the rendezvous comes back "
        "with the same relay secret (--relay-secret-file) within its recovery window"
        if relayed
        else ""
    )
    return (
        f"lost the rendezvous: {why}. The ring goes on serving on its links; reconnecting (new members "
        f"need it){on_relay}"
    )


async def back_to_rendezvous(
    client: SignalingClient,
    status: dict[str, Any],
    why: str,
    links: Mapping[str, Link],
    schedule: Backoff | None = None,
    draw: Callable[[], float] = random.random,
) -> bool:
    """Reconnect `client` (lost because of `why`) until it is registered again (True) or refused
    for good (False: `status` says "lost" and why). `status` is the /session "rendezvous" block."""
    status.update(state="reconnecting", attempt=0, reason=why, since=round(time.time(), 3))
    say(lost_line(why, links))
    log.warning("rendezvous_lost", reason=why)
    loop = asyncio.get_running_loop()
    start, attempt = loop.time(), 0
    while True:
        attempt += 1
        await asyncio.sleep((schedule or SCHEDULE).delay(attempt, draw()))
        try:
            await client.reconnect()
        except SignalingError as exc:
            if exc.code not in RETRY:
                return _refused(status, attempt, exc)
            reason = f"{exc.message} ({exc.code})"
        except (OSError, TimeoutError, WebSocketException) as exc:
            reason = unreachable_reason(exc)
        else:
            took = loop.time() - start
            reconnects = int(status.get("reconnects", 0)) + 1
            for key in ("attempt", "reason", "since"):
                status.pop(key, None)
            status.update(state="connected", reconnects=reconnects, last_lost=why)
            say(
                f"back at the rendezvous after {took:.1f} s ({attempt} attempt{'s' if attempt > 1 else ''}): "
                f"session {client.session} is registered again, new members can join"
            )
            log.info("rendezvous_reconnected", attempts=attempt, seconds=round(took, 2))
            return True
        status.update(attempt=attempt, reason=reason)
        log.info("rendezvous_reconnect_failed", attempt=attempt, reason=reason)


def _refused(status: dict[str, Any], attempt: int, exc: SignalingError) -> bool:
    status.update(state="lost", attempt=attempt, reason=f"{exc.message} ({exc.code})")
    say(
        f"the rendezvous would not take this member back: {exc.message}. The ring goes on serving on "
        "its links; no new member can join this session (this member no longer reconnects)"
    )
    log.warning("rendezvous_refused_reregistration", code=exc.code, reason=exc.message)
    return False
