"""Reaching the rendezvous, and its refusals as the errors a person reads."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import Iterator

from websockets.exceptions import WebSocketException

from kafila.net.signaling import SignalingClient, SignalingClosed, SignalingError, unreachable_reason
from kafila.proto import signaling as sig
from kafila.proto.codes import SessionCode
from kafila.session.errors import SessionError
from kafila.session.progress import say
from kafila.session.terms import DEFAULT_RENDEZVOUS

_RETRY_IN = re.compile(r"retry in (\d+(?:\.\d+)?) s")


def join_command(code: SessionCode, rendezvous: str) -> str:
    """What a member types to join: the rendezvous named unless it is the default."""
    where = "" if rendezvous == DEFAULT_RENDEZVOUS else f" --rendezvous {rendezvous}"
    return f"kafila join {code}{where}"


async def reach_rendezvous(url: str) -> SignalingClient:
    """The signaling connection, or a SessionError naming the URL and why it failed."""
    try:
        return await SignalingClient.connect(url)
    except (OSError, TimeoutError, WebSocketException) as exc:
        why = unreachable_reason(exc)
        raise SessionError(
            f"cannot reach the rendezvous at {url}: {why} (is `kafila rendezvous` running there? "
            "choose another with --rendezvous URL)"
        ) from exc


@contextlib.contextmanager
def refused_by(url: str, what: str) -> Iterator[None]:
    """A request the rendezvous refuses becomes a SessionError naming what was asked and why."""
    try:
        yield
    except SignalingError as exc:
        hint = ""
        if exc.code == "unknown_session":  # a mistyped code, or another rendezvous than the host's
            hint = "; the host printed the whole join command, with its --rendezvous unless the default"
        raise SessionError(
            f"the rendezvous at {url} would not {what}: {exc.message} ({exc.code}){hint}"
        ) from exc


async def join_in_turn(
    client: SignalingClient, code: SessionCode, name: str, capability: sig.JsonObject, within: float
) -> sig.Joined:
    """`client.join`, waiting out a rendezvous that holds joins from this address back for a while
    (`rate_limited`: another member behind the same address mistyped the code, or many joined at
    once; members of one campus or home NAT share an address), for up to `within` seconds. The
    rendezvous's limits are not eased: the member waits as told, then asks again."""
    deadline = time.monotonic() + within
    while True:
        try:
            return await client.join(code, name, capability)
        except SignalingError as exc:
            wait = _held_back(exc)
            if wait is None or time.monotonic() + wait > deadline:
                raise
            say(f"the rendezvous holds joins from this address back ({exc.message}); again in {wait:.0f} s")
            await asyncio.sleep(wait)


def _held_back(exc: SignalingError) -> float | None:
    """Seconds the rendezvous asked this address to wait before joining again, if it did."""
    if exc.code != "rate_limited" or isinstance(exc, SignalingClosed):
        return None
    found = _RETRY_IN.search(exc.message)
    return max(1.0, float(found.group(1))) if found else 1.0


def default_name() -> str:
    return socket.gethostname().split(".")[0][:24] or "member"
