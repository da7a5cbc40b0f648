"""The relay's pure core: channels between two legs of one ring edge, bound by per-leg tokens.

No sockets and no clock: the UDP shell passes `now`, the datagram's source address and the index
of the local socket it arrived on (`endpoint`), and gets back where to send it. Datagrams are
forwarded unchanged; the relay never looks past the 6-byte RelayData header.

A leg's token is an HMAC of its channel id and leg index under the relay's secret (`leg_token`),
so a relay that restarts with the same secret (`kafila rendezvous --relay-secret-file`) can take
the channels of running sessions back without any stored state: within `relay_recover_s` of its
start, a bind of a channel it does not know whose token the secret signed re-creates the channel
(`Totals.recovered`), and the other leg's bind completes it. Links re-bind their relay leg on
their own when the relay path falls silent (kafila.net.link), so a relayed ring edge carries on
after a restart of a few seconds. Such a channel knows neither its session nor its members (the
restarted registry has neither): it is rate-limited on its own and removed when idle.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum

from kafila.proto import udp
from kafila.proto.udp import Address, ErrorCode
from kafila.rendezvous.limits import Limits
from kafila.rendezvous.ratelimit import TokenBuckets


class RelayLimitError(Exception):
    """A channel could not be allocated; the text names the limit and the numbers."""


@dataclass(slots=True)
class Leg:
    member: int
    token: bytes
    addr: Address | None = None
    endpoint: int = 0  # index of the local socket the leg bound through


@dataclass(slots=True)
class Channel:
    id: int
    session: str
    legs: tuple[Leg, Leg]
    last_active: float
    bytes: int = 0
    packets: int = 0
    dropped: int = 0


class Drop(Enum):
    UNKNOWN_CHANNEL = "unknown_channel"
    NOT_A_LEG = "not_a_leg"  # source is not a bound leg of the channel
    PEER_UNBOUND = "peer_unbound"
    RATE_LIMITED = "rate_limited"


@dataclass(slots=True)
class Totals:
    bytes: int = 0
    packets: int = 0
    dropped: dict[Drop, int] = field(default_factory=lambda: dict.fromkeys(Drop, 0))
    allocated: int = 0
    expired: int = 0
    recovered: int = 0  # channels from before a restart, taken back from their tokens


SECRET_BYTES = 32  # a new secret
MIN_SECRET_BYTES = 16  # a secret given: HMAC keys shorter than this are refused


def leg_token(secret: bytes, channel: int, leg: int) -> bytes:
    """The token of leg 0 or 1 of `channel` under the relay's secret (HMAC-SHA256, truncated)."""
    message = b"kafila relay leg" + channel.to_bytes(4, "big") + bytes([leg])
    return hmac.new(secret, message, hashlib.sha256).digest()[: udp.TOKEN_BYTES]


class RelayTable:
    def __init__(
        self,
        limits: Limits,
        secret: bytes | None = None,
        started: float = 0.0,
        random_id: Callable[[], int] = lambda: secrets.randbelow(udp.MAX_CHANNEL) + 1,
    ) -> None:
        """`secret`: signs the leg tokens (None: a new random one, so nothing survives a restart);
        `started`: the clock reading at start, from which `relay_recover_s` counts."""
        if secret is not None and len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"relay secret has {len(secret)} bytes, at least {MIN_SECRET_BYTES} are needed")
        self.limits = limits
        self._secret = secret if secret is not None else secrets.token_bytes(SECRET_BYTES)
        self._recover_until = started + limits.relay_recover_s if secret is not None else started
        self._random_id = random_id
        self.channels: dict[int, Channel] = {}
        self._by_edge: dict[tuple[str, int, int], int] = {}
        # a burst of one second's bytes; a datagram above it passes from a full bucket (ratelimit.py)
        self._rate = TokenBuckets(limits.relay_session_bytes_per_s, limits.relay_session_bytes_per_s)
        self.totals = Totals()

    # ------------------------------------------------------------ allocation

    def allocate(self, session: str, a: int, b: int, now: float) -> Channel:
        """The channel for edge {a, b} of `session`, created if new (raises RelayLimitError)."""
        edge = (session, min(a, b), max(a, b))
        existing = self._by_edge.get(edge)
        if existing is not None:
            return self.channels[existing]
        self._check_caps(session)
        cid = self._fresh_id()
        legs = (Leg(edge[1], leg_token(self._secret, cid, 0)), Leg(edge[2], leg_token(self._secret, cid, 1)))
        channel = Channel(cid, session, legs, now)
        self.channels[cid] = channel
        self._by_edge[edge] = cid
        self.totals.allocated += 1
        return channel

    def _check_caps(self, session: str) -> None:
        if min(self.limits.relay_channels, self.limits.relay_channels_per_session) == 0:
            raise RelayLimitError("this rendezvous does not relay: its relay channel limit is 0")
        if len(self.channels) >= self.limits.relay_channels:
            raise RelayLimitError(
                f"relay has {len(self.channels)} channels, the limit is {self.limits.relay_channels}"
            )
        mine = sum(1 for s, _, _ in self._by_edge if s == session)
        cap = self.limits.relay_channels_per_session
        if mine >= cap:
            raise RelayLimitError(f"session {session} has {mine} relay channels, the limit is {cap}")

    def _fresh_id(self) -> int:
        while True:
            cid = self._random_id()
            if 1 <= cid <= udp.MAX_CHANNEL and cid not in self.channels:
                return cid

    # ------------------------------------------------------------ binding

    def bind(self, msg: udp.RelayBind, src: Address, endpoint: int, now: float) -> udp.UdpMessage:
        """Bind (or refresh, or move) the leg whose token this is; returns the ack or error to send."""
        channel = self.channels.get(msg.channel) or self._recover(msg, now)
        if channel is None:
            return udp.RelayBindError(
                msg.channel, ErrorCode.UNKNOWN_CHANNEL, f"no relay channel {msg.channel}"
            )
        leg = next((g for g in channel.legs if hmac.compare_digest(g.token, msg.token)), None)
        if leg is None:
            return udp.RelayBindError(msg.channel, ErrorCode.BAD_TOKEN, "token does not match either leg")
        leg.addr, leg.endpoint = src, endpoint
        channel.last_active = now
        other = channel.legs[1] if leg is channel.legs[0] else channel.legs[0]
        return udp.RelayBindAck(msg.channel, other.addr is not None, src)

    def _recover(self, msg: udp.RelayBind, now: float) -> Channel | None:
        """The channel of a bind from before a restart, re-created from its signed token; None when
        the token is not the secret's, the recovery window has passed, or the relay is full."""
        if now >= self._recover_until or not 1 <= msg.channel <= udp.MAX_CHANNEL:
            return None
        tokens = (leg_token(self._secret, msg.channel, 0), leg_token(self._secret, msg.channel, 1))
        if not any(hmac.compare_digest(t, msg.token) for t in tokens):
            return None
        if len(self.channels) >= self.limits.relay_channels:
            return None
        # its session and members are not known any more: its own rate-limit key, members -1 and -2
        session = f"recovered-{msg.channel}"
        channel = Channel(msg.channel, session, (Leg(-1, tokens[0]), Leg(-2, tokens[1])), now)
        self.channels[msg.channel] = channel
        self.totals.recovered += 1
        return channel

    def adopt(
        self, session: str, member: int, peer: int, cid: int, leg: int, token: bytes, now: float
    ) -> bool:
        """A member registering again after a restart names a relay leg it holds: a channel taken
        back from its tokens (or not yet: it is re-created, as a bind would) learns its session and
        members again, so leaving releases it and the session's limits count it. False (nothing
        changed) when the token is not this secret's for that leg, or the channel is another
        session's, or the relay is full."""
        if not hmac.compare_digest(leg_token(self._secret, cid, leg), token):
            return False
        channel = self.channels.get(cid)
        if channel is None:
            if len(self.channels) >= self.limits.relay_channels:
                return False
            tokens = (leg_token(self._secret, cid, 0), leg_token(self._secret, cid, 1))
            channel = self.channels[cid] = Channel(
                cid, session, (Leg(-1, tokens[0]), Leg(-2, tokens[1])), now
            )
            self.totals.recovered += 1
        elif channel.session not in (session, f"recovered-{cid}"):
            return False
        if self._by_edge.get(_edge(channel)) == cid:
            del self._by_edge[_edge(channel)]
        channel.session = session
        channel.legs[leg].member, channel.legs[1 - leg].member = member, peer
        self._by_edge.setdefault(_edge(channel), cid)
        return True

    # ------------------------------------------------------------ forwarding

    def forward(self, cid: int, src: Address, size: int, now: float) -> tuple[Address, int] | Drop:
        """Where a RelayData datagram of `size` bytes from `src` goes: (address, endpoint) or a Drop."""
        channel = self.channels.get(cid)
        if channel is None:
            return self._drop(None, Drop.UNKNOWN_CHANNEL)
        a, b = channel.legs
        if a.addr == src:
            dest = b
        elif b.addr == src:
            dest = a
        else:
            return self._drop(channel, Drop.NOT_A_LEG)
        if dest.addr is None:
            return self._drop(channel, Drop.PEER_UNBOUND)
        if self.limits.relay_session_bytes_per_s > 0 and not self._rate.take(channel.session, now, size):
            return self._drop(channel, Drop.RATE_LIMITED)
        channel.bytes += size
        channel.packets += 1
        channel.last_active = now
        self.totals.bytes += size
        self.totals.packets += 1
        return dest.addr, dest.endpoint

    def _drop(self, channel: Channel | None, why: Drop) -> Drop:
        if channel is not None:
            channel.dropped += 1
        self.totals.dropped[why] += 1
        return why

    # ------------------------------------------------------------ removal

    def expire(self, now: float) -> list[Channel]:
        """Remove channels idle for `relay_idle_s`; returns them."""
        idle = [c for c in self.channels.values() if now - c.last_active >= self.limits.relay_idle_s]
        for channel in idle:
            self._remove(channel)
        self.totals.expired += len(idle)
        return idle

    def release_member(self, session: str, member: int) -> list[Channel]:
        gone = [
            c
            for c in self.channels.values()
            if c.session == session and member in (c.legs[0].member, c.legs[1].member)
        ]
        for channel in gone:
            self._remove(channel)
        return gone

    def release_session(self, session: str) -> list[Channel]:
        gone = [c for c in self.channels.values() if c.session == session]
        for channel in gone:
            self._remove(channel)
        return gone

    def _remove(self, channel: Channel) -> None:
        del self.channels[channel.id]
        if self._by_edge.get(_edge(channel)) == channel.id:
            del self._by_edge[_edge(channel)]


def _edge(channel: Channel) -> tuple[str, int, int]:
    """The (session, lower member, higher member) a channel serves."""
    a, b = channel.legs[0].member, channel.legs[1].member
    return channel.session, min(a, b), max(a, b)
