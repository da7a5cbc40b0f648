"""A session channel: session messages (kafila.proto.tensor) to one peer, with liveness.

`LinkChannel` carries them on an authenticated QUIC link (kafila.net.link) as one link message
kind. `MemoryChannel.pair()` connects two ends inside one process (a ring of stages in one
process, and the in-memory ring tests). Both count bytes and messages per direction.

`Heartbeat` wraps any channel: it sends a beat every `interval` seconds and a receive that hears
nothing (not even a beat) for `dead_after` seconds raises `ChannelDead`, so a member that was
killed is noticed in seconds, whatever the transport's own idle timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import Protocol

from kafila.proto import tensor as t

LINK_KIND = 32  # link message kind that carries session messages (kinds < 16 are the link's own)
BEAT = "beat"


class ChannelError(Exception):
    """The peer is gone or the channel broke; the message names the peer."""


class ChannelClosed(ChannelError):
    pass


class ChannelDead(ChannelError):
    pass


@dataclass
class Counters:
    bytes_sent: int = 0
    messages_sent: int = 0
    bytes_received: int = 0
    messages_received: int = 0


class Channel(Protocol):
    peer: str
    counters: Counters

    @property
    def path(self) -> str:
        """ "direct" | "relay" | "local"."""
        ...

    async def send(self, msg: t.Message) -> None: ...

    async def recv(self, timeout: float | None = None) -> t.Message: ...

    async def close(self, reason: str = "closed") -> None: ...


class MemoryChannel:
    """One end of an in-process pair; messages are encoded and decoded as on a real link."""

    def __init__(self, peer: str, inbox: asyncio.Queue[bytes | None], outbox: asyncio.Queue[bytes | None]):
        self.peer, self._in, self._out = peer, inbox, outbox
        self.counters = Counters()
        self._closed = False

    @classmethod
    def pair(cls, a: str, b: str) -> tuple[MemoryChannel, MemoryChannel]:
        """(a's end talking to b, b's end talking to a)."""
        ab: asyncio.Queue[bytes | None] = asyncio.Queue()
        ba: asyncio.Queue[bytes | None] = asyncio.Queue()
        return cls(b, ba, ab), cls(a, ab, ba)

    @property
    def path(self) -> str:
        return "local"

    async def send(self, msg: t.Message) -> None:
        if self._closed:
            raise ChannelClosed(f"channel to {self.peer} is closed")
        record = t.encode(msg)
        self.counters.bytes_sent += len(record)
        self.counters.messages_sent += 1
        self._out.put_nowait(record)

    async def recv(self, timeout: float | None = None) -> t.Message:
        try:
            record = await asyncio.wait_for(self._in.get(), timeout)
        except TimeoutError:
            raise ChannelDead(f"{self.peer}: no message within {timeout} s") from None
        if record is None:
            self._in.put_nowait(None)
            raise ChannelClosed(f"{self.peer} closed the channel")
        self.counters.bytes_received += len(record)
        self.counters.messages_received += 1
        return t.decode(record)

    async def close(self, reason: str = "closed") -> None:
        if not self._closed:
            self._closed = True
            self._out.put_nowait(None)


class LinkChannel:
    """Session messages on a kafila.net Link (one message kind, in order)."""

    def __init__(self, link: object, peer: str) -> None:
        from kafila.net.link import Link

        assert isinstance(link, Link)
        self.link, self.peer = link, peer
        self.counters = Counters()

    @property
    def path(self) -> str:
        p = self.link.path
        return str(p.value) if p is not None else "none"

    async def send(self, msg: t.Message) -> None:
        from kafila.net.errors import LinkError

        record = t.encode(msg)
        try:
            await self.link.send(LINK_KIND, record)
        except LinkError as exc:
            raise ChannelClosed(f"link to {self.peer}: {exc}") from exc
        self.counters.bytes_sent += len(record)
        self.counters.messages_sent += 1

    async def recv(self, timeout: float | None = None) -> t.Message:
        from kafila.net.errors import LinkError, LinkTimeout

        while True:
            try:
                kind, payload = await self.link.recv(timeout)
            except LinkTimeout:
                raise ChannelDead(f"{self.peer}: no message within {timeout} s") from None
            except LinkError as exc:
                raise ChannelClosed(f"link to {self.peer}: {exc}") from exc
            if kind == LINK_KIND:
                self.counters.bytes_received += len(payload)
                self.counters.messages_received += 1
                return t.decode(payload)

    async def close(self, reason: str = "closed") -> None:
        await self.link.close(reason)


class Heartbeat:
    """Beats on `inner` every `interval` s; `recv` raises ChannelDead after `dead_after` s of silence.
    Beats are consumed here and never returned to the caller."""

    def __init__(
        self,
        inner: Channel,
        dead_after: float = 5.0,
        interval: float | None = None,
        first_within: float = 300.0,
    ) -> None:
        self.inner, self.dead_after = inner, dead_after
        self.interval = interval if interval is not None else min(1.0, dead_after / 4)
        self.first_within = first_within  # a peer may still be loading: its first beat can take longer
        self._heard = False
        self.peer, self.counters = inner.peer, inner.counters
        self._task: asyncio.Task[None] | None = None

    @property
    def path(self) -> str:
        return self.inner.path

    def start(self) -> Heartbeat:
        self._task = asyncio.ensure_future(self._beat())
        return self

    async def _beat(self) -> None:
        with contextlib.suppress(ChannelError, t.FrameError):
            while True:
                await self.inner.send(t.Control(BEAT))
                await asyncio.sleep(self.interval)

    async def send(self, msg: t.Message) -> None:
        await self.inner.send(msg)

    async def recv(self, timeout: float | None = None) -> t.Message:
        while True:
            limit = self.dead_after if self._heard else self.first_within
            wait = limit if timeout is None else min(timeout, limit)
            try:
                msg = await self.inner.recv(wait)
            except ChannelDead:
                raise ChannelDead(
                    f"member {self.peer} stopped answering (nothing for {limit:.0f} s)"
                ) from None
            self._heard = True
            if not (isinstance(msg, t.Control) and msg.op == BEAT):
                return msg

    async def close(self, reason: str = "closed") -> None:
        if self._task is not None:
            self._task.cancel()
        await self.inner.close(reason)
