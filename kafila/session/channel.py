"""A session channel: session messages (kafila.proto.tensor) to one peer, with liveness.

`LinkChannel` carries them on an authenticated QUIC link (kafila.net.link) as one link message
kind. `MemoryChannel.pair()` connects two ends inside one process (a ring of stages in one
process, and the in-memory ring tests). Both count the bytes and messages they actually send and
receive per direction, in total and per request (`Counters`: every hidden-state frame's encoded
size, a frame shared by several requests split by their rows), and say the link's measured round
trip (`rtt_ms`: QUIC's smoothed RTT; None in-process).

A channel belongs to one plan epoch (`epoch`, 1 for the plan a session formed with): it stamps
every message it sends with it and drops, undecoded, whatever arrives stamped with another
(kafila.proto.epoch), so a frame still in flight from before a re-plan is never computed. Each drop
counts in `kafila_ring_stale_frames_total`; the first of each stale epoch is logged once.

`Heartbeat` wraps any channel: it sends a beat every `interval` seconds and a receive that hears
nothing (not even a beat) for `dead_after` seconds (the ring's bound, `--lost-after`, default 3 s)
raises `ChannelDead`, so a member that was killed, frozen or cut off is noticed within the bound,
whatever the transport's own idle timeout.

The bound must not count a link that moves to the relay as a lost member: a session's links
(kafila.session.forming.links) PING every `LINK_KEEPALIVE_S` and leave a direct path silent for
`LINK_DIRECT_SILENT_S` for the relay, resending at once what was in flight (kafila.net.link), so
the move takes at most `RELAY_MOVE_S` (1.25 s); beats every `dead_after / 6` then arrive on the
relay well inside any bound of at least `MIN_LOST_AFTER` (2 s), which the CLI enforces.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from kafila.net.errors import LinkEnded, LinkError, LinkTimeout, PeerSilent
from kafila.net.link import Link
from kafila.obs import hopmarks, metrics
from kafila.obs.log import get_logger
from kafila.proto import tensor as t
from kafila.proto.epoch import EpochGate, Stale
from kafila.proto.ring import Cause, RingBroken

log = get_logger("kafila.session.channel")
LINK_KIND = 32  # link message kind that carries session messages (kinds < 16 are the link's own)
BEAT = "beat"


class ChannelError(Exception):
    """The peer is gone or the channel broke; the message names the peer, and `peer` and `cause`
    say it for the ring's "broken" notice (kafila.proto.ring.RingBroken)."""

    cause: Cause = Cause.ERROR

    def __init__(self, message: str, peer: str = "", cause: Cause | None = None) -> None:
        super().__init__(message)
        self.peer = peer
        if cause is not None:
            self.cause = cause

    def broken(self, detail: str | None = None) -> RingBroken:
        """The ring's break this error makes: about `peer`, said as `detail` (default: this error)."""
        return RingBroken(self.peer, self.cause, str(self) if detail is None else detail)


class ChannelClosed(ChannelError):
    cause = Cause.CLOSED


class ChannelDead(ChannelError):
    cause = Cause.SILENT


def closed_by(exc: LinkError, message: str, peer: str) -> ChannelClosed:
    """The channel's error for its link failing with `exc`: a link the peer closed because the host
    ended the session (LinkEnded) breaks the ring as "ended", not as a lost member."""
    return ChannelClosed(message, peer, Cause.ENDED if isinstance(exc, LinkEnded) else None)


@dataclass
class RequestBytes:
    """What one request's hidden-state frames weighed on one channel."""

    bytes_sent: int = 0
    messages_sent: int = 0
    bytes_received: int = 0
    messages_received: int = 0


@dataclass
class Counters:
    bytes_sent: int = 0
    messages_sent: int = 0
    bytes_received: int = 0
    messages_received: int = 0
    requests: dict[int, RequestBytes] = field(default_factory=dict)
    # told of each hidden-state frame as it is sent: its bytes and the request entries it carries
    # (kafila.session.ring.stagetrace counts a ring edge's bytes as they go, not when a request ends)
    on_hidden: Callable[[int, int], None] | None = field(default=None, repr=False, compare=False)

    def sent(self, msg: t.Message, n: int) -> None:
        self.bytes_sent += n
        self.messages_sent += 1
        for rid, share in _shares(msg, n):
            r = self.requests.setdefault(rid, RequestBytes())
            r.bytes_sent += share
            r.messages_sent += 1
        if self.on_hidden is not None and isinstance(msg, t.Hidden):
            self.on_hidden(n, len(msg.entries))

    def received(self, msg: t.Message, n: int) -> None:
        self.bytes_received += n
        self.messages_received += 1
        for rid, share in _shares(msg, n):
            r = self.requests.setdefault(rid, RequestBytes())
            r.bytes_received += share
            r.messages_received += 1

    def take(self, rid: int) -> RequestBytes:
        """What request `rid` weighed here so far; forgets it (call once its last frame passed)."""
        return self.requests.pop(rid, RequestBytes())


def _shares(msg: t.Message, n: int) -> list[tuple[int, int]]:
    """A hidden-state frame's `n` bytes split over its requests by rows (the last takes the rest)."""
    if not isinstance(msg, t.Hidden) or not msg.entries:
        return []
    rows = sum(e.n_tokens for e in msg.entries) or 1
    shares = [(e.request_id, n * e.n_tokens // rows) for e in msg.entries]
    rid, share = shares[-1]
    shares[-1] = (rid, share + n - sum(s for _, s in shares))
    return shares


def dropped_stale(peer: str, stale: Stale, epoch: int) -> None:
    """Count a record of another epoch that a channel to `peer` of `epoch` dropped; log the first."""
    metrics.observe_stale_frame(peer)
    if stale.first:
        log.warning(
            "ring_stale_frames",
            peer=peer,
            epoch=epoch,
            frame_epoch=stale.epoch,
            first=stale.describe(epoch),
        )


class Channel(Protocol):
    peer: str
    counters: Counters

    @property
    def epoch(self) -> int:
        """The plan epoch whose messages this channel carries (others are dropped)."""
        ...

    @property
    def path(self) -> str:
        """ "direct" | "relay" | "local"."""
        ...

    @property
    def rtt_ms(self) -> float | None:
        """The transport's measured round trip (None when there is no network in between)."""
        ...

    async def send(self, msg: t.Message) -> None: ...

    async def recv(self, timeout: float | None = None) -> t.Message: ...

    def acknowledge(self) -> None:
        """Acknowledge what was received now rather than after the transport's ACK delay."""
        ...

    async def close(self, reason: str = "closed") -> None: ...


async def send_marked(ch: Channel, msg: t.Message, prev: Channel | None = None) -> None:
    """`ch.send(msg)`, with a hidden-state frame's `send` and `sent` hop marks (kafila.obs.hopmarks).
    Once a frame has left, `prev` (the channel the stage's input came on) acknowledges what it
    received: the ring's ACKs travel while their receivers are idle (kafila.net.link, `ack_delay`)."""
    if not isinstance(msg, t.Hidden):
        await ch.send(msg)
        return
    hopmarks.mark("send", msg.entries)
    await ch.send(msg)
    hopmarks.mark("sent", msg.entries)
    if prev is not None:
        prev.acknowledge()


class MemoryChannel:
    """One end of an in-process pair; messages are encoded and decoded as on a real link."""

    def __init__(
        self,
        peer: str,
        inbox: asyncio.Queue[bytes | None],
        outbox: asyncio.Queue[bytes | None],
        epoch: int = 1,
    ) -> None:
        self.peer, self._in, self._out = peer, inbox, outbox
        self.gate = EpochGate(epoch)
        self.counters = Counters()
        self._closed = False

    @classmethod
    def pair(cls, a: str, b: str, epoch: int = 1) -> tuple[MemoryChannel, MemoryChannel]:
        """(a's end talking to b, b's end talking to a), both of plan epoch `epoch`."""
        ab: asyncio.Queue[bytes | None] = asyncio.Queue()
        ba: asyncio.Queue[bytes | None] = asyncio.Queue()
        return cls(b, ba, ab, epoch), cls(a, ab, ba, epoch)

    def renewed(self, epoch: int) -> MemoryChannel:
        """This end's transport as a channel of another epoch (as a re-plan reuses a link): what
        is still queued from the old epoch is dropped there, not computed."""
        return MemoryChannel(self.peer, self._in, self._out, epoch)

    @property
    def epoch(self) -> int:
        return self.gate.epoch

    @property
    def path(self) -> str:
        return "local"

    @property
    def rtt_ms(self) -> float | None:
        return None

    async def send(self, msg: t.Message) -> None:
        if self._closed:
            raise ChannelClosed(f"channel to {self.peer} is closed", self.peer)
        record = self.gate.stamp(msg)
        self.counters.sent(msg, len(record))
        self._out.put_nowait(record)

    async def recv(self, timeout: float | None = None) -> t.Message:
        try:
            async with asyncio.timeout(timeout):  # one deadline, however many stale records come
                while True:
                    record = await self._in.get()
                    if record is None:
                        self._in.put_nowait(None)
                        raise ChannelClosed(f"{self.peer} closed the channel", self.peer)
                    msg = self.gate.admit(record)
                    if not isinstance(msg, Stale):
                        break
                    dropped_stale(self.peer, msg, self.epoch)
        except TimeoutError:
            raise ChannelDead(f"{self.peer}: no message within {timeout} s", self.peer) from None
        self.counters.received(msg, len(record))
        return msg

    def acknowledge(self) -> None:
        pass  # nothing to acknowledge in-process

    async def close(self, reason: str = "closed") -> None:
        if not self._closed:
            self._closed = True
            self._out.put_nowait(None)


class LinkChannel:
    """Session messages of plan epoch `epoch` on a kafila.net Link (one message kind, in order).
    A re-plan that keeps a link makes a new LinkChannel of the next epoch on it. A ring channel
    names its `hop` ("sender->peer"): each hidden-state frame it sends is timed until the peer
    acknowledged it (kafila.net.link, `delivered`) into kafila_hop_transfer_seconds."""

    def __init__(self, link: Link, peer: str, epoch: int = 1, hop: str | None = None) -> None:
        self.link, self.peer, self.hop = link, peer, hop
        self.gate = EpochGate(epoch)
        self.counters = Counters()

    @property
    def epoch(self) -> int:
        return self.gate.epoch

    @property
    def path(self) -> str:
        p = self.link.path
        return str(p.value) if p is not None else "none"

    @property
    def rtt_ms(self) -> float | None:
        rtt = self.link.stats().smoothed_rtt
        return rtt * 1e3 if rtt > 0 else None

    async def send(self, msg: t.Message) -> None:
        record = self.gate.stamp(msg)
        timed = None
        if isinstance(msg, t.Hidden):
            hopmarks.mark("encoded", msg.entries)
            timed = self._transferred if self.hop is not None else None
        try:
            await self.link.send(LINK_KIND, record, timed)
        except LinkError as exc:
            raise closed_by(exc, self._named(exc), self.peer) from exc
        self.counters.sent(msg, len(record))

    async def recv(self, timeout: float | None = None) -> t.Message:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                kind, payload = await self.link.recv(left)
            except PeerSilent as exc:  # the link closed itself: its own reason, not this wait's
                raise ChannelClosed(self._named(exc), self.peer) from exc
            except LinkTimeout:
                raise ChannelDead(f"{self.peer}: no message within {timeout} s", self.peer) from None
            except LinkError as exc:
                raise closed_by(exc, self._named(exc), self.peer) from exc
            if kind == LINK_KIND:
                msg = self.gate.admit(payload)
                if isinstance(msg, Stale):
                    dropped_stale(self.peer, msg, self.epoch)
                    continue
                if isinstance(msg, t.Hidden):
                    hopmarks.mark("read", msg.entries, self.link.endpoint.batch_read_ns)
                    hopmarks.mark("decoded", msg.entries)
                self.counters.received(msg, len(payload))
                return msg

    def _transferred(self, seconds: float) -> None:
        assert self.hop is not None
        metrics.observe_hop_transfer(self.hop, self.path, seconds)

    def _named(self, exc: Exception) -> str:
        """The link's error with the peer's name for its id: "link to vm closed by the peer: ...",
        not "link to vm: link to 1 closed by the peer: ..."."""
        text, own = str(exc), f"link to {self.link.peer_id}"
        if text.startswith(own):
            return f"link to {self.peer}{text[len(own) :]}"
        return f"link to {self.peer}: {text}"

    def acknowledge(self) -> None:
        self.link.acknowledge()

    async def close(self, reason: str = "closed") -> None:
        await self.link.close(reason)


STALLED_S = 1.0  # a deadline that fires this late means this process itself did not run
DEFAULT_LOST_AFTER = 3.0  # s of silence after which a neighbour counts as lost (--lost-after)
LINK_KEEPALIVE_S = 0.25  # a session link's PING interval (and how often it checks its direct path)
LINK_DIRECT_SILENT_S = 1.0  # a session link's direct path silent this long: it moves to the relay
RELAY_MOVE_S = LINK_DIRECT_SILENT_S + LINK_KEEPALIVE_S  # the slowest move: the silence seen one check late
# the smallest bound: the relay move, then a beat (at most bound / 6 later) and a relayed round trip
MIN_LOST_AFTER = 2.0


def lost_after_problem(seconds: float) -> str | None:
    """Why `seconds` cannot be the ring's bound (None: it can)."""
    if seconds >= MIN_LOST_AFTER:
        return None
    return (
        f"{seconds:g} s is below {MIN_LOST_AFTER:g} s: a link whose direct path fails takes up to "
        f"{RELAY_MOVE_S:g} s to move to the relay, and the ring must hear a beat on the relay before it "
        "counts a member lost"
    )


class Heartbeat:
    """Beats on `inner` every `interval` s; `recv` raises ChannelDead after `dead_after` s of silence.
    Beats are consumed here and never returned to the caller. A deadline that fired late (this
    process was stopped, or its machine swapped: the peer's beats wait unread in the socket) gets
    one more look of two beats before the silence is blamed, and then names the stall."""

    def __init__(
        self,
        inner: Channel,
        dead_after: float = DEFAULT_LOST_AFTER,
        interval: float | None = None,
        first_within: float = 300.0,
    ) -> None:
        self.inner, self.dead_after = inner, dead_after
        self.interval = interval if interval is not None else min(1.0, dead_after / 6)
        self.first_within = first_within  # a peer may still be loading: its first beat can take longer
        self._heard = False
        self.peer, self.counters = inner.peer, inner.counters
        self._task: asyncio.Task[None] | None = None

    @property
    def epoch(self) -> int:
        return self.inner.epoch

    @property
    def path(self) -> str:
        return self.inner.path

    @property
    def rtt_ms(self) -> float | None:
        return self.inner.rtt_ms

    def start(self) -> Heartbeat:
        self._task = asyncio.ensure_future(self._beat())
        return self

    def stop(self) -> None:
        """Beat no more (the channel stays open): its epoch is over, nobody reads it now."""
        if self._task is not None:
            self._task.cancel()

    async def _beat(self) -> None:
        with contextlib.suppress(ChannelError, t.FrameError):
            while True:
                await self.inner.send(t.Control(BEAT))
                await asyncio.sleep(self.interval)

    async def send(self, msg: t.Message) -> None:
        await self.inner.send(msg)

    async def recv(self, timeout: float | None = None) -> t.Message:
        stalled = 0.0
        while True:
            limit = self.dead_after if self._heard else self.first_within
            wait = limit if timeout is None else min(timeout, limit)
            if stalled:  # what arrived while this process did not run is still to be read
                wait = min(wait, 2 * self.interval)
            started = time.monotonic()
            try:
                msg = await self.inner.recv(wait)
            except ChannelDead:
                late = time.monotonic() - started - wait
                if late > STALLED_S and not stalled:
                    stalled = late
                    continue
                # a stall is this member's own: the peer's silence is not blamed on it
                cause = Cause.ERROR if stalled else Cause.SILENT
                raise ChannelDead(self._silence(limit, stalled), self.peer, cause) from None
            self._heard = True
            if not (isinstance(msg, t.Control) and msg.op == BEAT):
                return msg

    def _silence(self, limit: float, stalled: float) -> str:
        if stalled:  # the deadline passed while this member itself was stopped: the peer may be fine
            return (
                f"this member stalled for {stalled:.1f} s (its process did not run) and heard nothing "
                f"from member {self.peer} since"
            )
        return f"member {self.peer} stopped answering (nothing heard for {limit:g} s, the bound)"

    def acknowledge(self) -> None:
        self.inner.acknowledge()

    async def close(self, reason: str = "closed") -> None:
        if self._task is not None:
            self._task.cancel()
        await self.inner.close(reason)
