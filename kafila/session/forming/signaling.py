"""Reaching the rendezvous, and its refusals as the errors a person reads."""

from __future__ import annotations

import contextlib
import socket
from collections.abc import Iterator

from websockets.exceptions import WebSocketException

from kafila.net.signaling import SignalingClient, SignalingError, unreachable_reason
from kafila.proto.codes import SessionCode
from kafila.session.errors import SessionError
from kafila.session.terms import DEFAULT_RENDEZVOUS


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


def default_name() -> str:
    return socket.gethostname().split(".")[0][:24] or "member"
