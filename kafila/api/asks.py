"""A spare's relayed requests (pure: no I/O): what its API asked the host over the control link,
and what each answer has reached.

A spare is a member the host keeps out of the ring; its API relays every request to the host
(kafila.proto.session's `ask`), which answers it as its own API would and streams the answer back
(`reply`, then `chunk`s up to the one marked `end`). `Asks` numbers the requests, turns what the
host sends into events for the request it belongs to, and fails every request still open, with
a message that says what happened, once the control link is gone; from then on it refuses new
ones with that message. The shell (kafila.api.spare) sends and receives.

    ask(...)            -> Ask to send           (Unreachable: the link is gone)
    heard(Reply)        -> [Started]             (a request waiting for its answer)
    heard(Chunk)        -> [Body]                (an answer started; `end` closes it)
    drop(n)             -> Drop to send | None   (the client left)
    lost(why)           -> [Failed, ...]         (every request still open)
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass

from kafila.proto import session as sm

# request headers a spare relays: those that shape the answer (the body's type, what the client
# takes); keys and the Host were checked by the spare's own guard, and mean nothing at the host
ASKED_HEADERS = frozenset({"content-type", "accept"})
# answer headers the spare's server sets itself for the bytes it sends
OWN_HEADERS = frozenset({"content-length", "transfer-encoding", "connection", "keep-alive", "date", "server"})


class Unreachable(RuntimeError):
    """The spare's control link to the host is gone: no request can be relayed."""


class Stage(enum.Enum):
    ASKED = "asked"  # sent, no reply yet
    ANSWERING = "answering"  # the reply came, chunks follow


@dataclass(frozen=True)
class Started:
    """The answer to request `ask` starts: the host's status and headers."""

    ask: int
    status: int
    headers: tuple[tuple[str, str], ...]


@dataclass(frozen=True)
class Body:
    """The next bytes of the answer to request `ask`; `end` on the last."""

    ask: int
    data: bytes
    end: bool


@dataclass(frozen=True)
class Failed:
    """Request `ask` gets no (more) answer, and why."""

    ask: int
    reason: str
    started: bool  # its answer had started: the client has a status already


Event = Started | Body | Failed


def asked_headers(headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The request headers a spare relays (ASKED_HEADERS), names in lower case."""
    return tuple((k.lower(), v) for k, v in headers if k.lower() in ASKED_HEADERS)


def answer_headers(headers: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The answer headers that travel back to the spare: all but those its server sets itself."""
    return tuple((k.lower(), v) for k, v in headers if k.lower() not in OWN_HEADERS)


class Asks:
    """The spare's side of the relay: its open requests and whether the link to `host` holds."""

    def __init__(self, host: str) -> None:
        self.host = host
        self.gone: str | None = None  # why the control link went (None: it holds)
        self.open: dict[int, Stage] = {}
        self._last = 0

    def ask(
        self, method: str, path: str, query: str, headers: Iterable[tuple[str, str]], content: bytes
    ) -> sm.Ask:
        """The message that relays a request its API took; Unreachable once the link is gone."""
        if self.gone is not None:
            raise Unreachable(self.refusal())
        if len(content) > sm.MAX_ASK_BODY:
            most = sm.MAX_ASK_BODY
            raise ValueError(f"a body of {len(content)} bytes, more than the {most} a spare relays")
        self._last = self._last % sm.MAX_ASK + 1
        self.open[self._last] = Stage.ASKED
        return sm.Ask(self._last, method, path, query, asked_headers(headers), content)

    def heard(self, msg: sm.RelayMessage) -> list[Event]:
        """What the host sent, as an event of the request it is for; [] for one not open (dropped
        meanwhile, or already answered) or out of turn."""
        stage = self.open.get(msg.ask)
        if isinstance(msg, sm.Reply) and stage is Stage.ASKED:
            self.open[msg.ask] = Stage.ANSWERING
            return [Started(msg.ask, msg.status, answer_headers(msg.headers))]
        if isinstance(msg, sm.Chunk) and stage is Stage.ANSWERING:
            if msg.end:
                del self.open[msg.ask]
            return [Body(msg.ask, msg.data, msg.end)]
        return []

    def drop(self, ask: int) -> sm.Drop | None:
        """The client of `ask` left: the message that stops it at the host (None: nothing is open)."""
        if self.open.pop(ask, None) is None or self.gone is not None:
            return None
        return sm.Drop(ask)

    def lost(self, why: str) -> list[Failed]:
        """The control link went (`why`): every open request fails, and none is taken from now on."""
        if self.gone is None:
            self.gone = why
        failed = [Failed(n, self.refusal(), stage is Stage.ANSWERING) for n, stage in self.open.items()]
        self.open.clear()
        return failed

    def refusal(self) -> str:
        """What a client is told once the link is gone."""
        return (
            f"this member waits as a spare and relays its requests to the host {self.host}, but its "
            f"control link to the host is gone ({self.gone}): it serves no request; ask another member "
            "of the session, or join it again"
        )
