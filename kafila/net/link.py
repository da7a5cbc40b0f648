"""A QUIC link to one ring neighbour, whose real path (direct or relayed) can change underneath.

aioquic is sans-I/O; this is its thin asyncio shell. The connection talks to a *virtual* peer
address, so QUIC never sees a path change: every outgoing datagram goes to whatever path is current
(the punched peer address, or the relay channel with its 6-byte header), and datagrams from either
path are fed in as coming from the virtual address. The link starts on the relay when it has to,
moves to the direct path as soon as one is added (a punch succeeded), and goes back to the relay
when the direct path has not answered for `dead_after` seconds; QUIC's loss recovery resends what
was lost on the dead path, so no message is lost. PINGs every `keepalive` seconds hold the NAT
mappings (<= 25 s: Linux forgets an unreplied UDP flow after 30 s). The relay leg is re-bound
every `relay_refresh` seconds, and at once when the relay path carries the link and has been
silent for `relay_silent_keepalives` keepalives (a NAT mapping that changed: `relay_rebind_due`).

Packet size: QUIC starts at 1200 bytes, which every path carries. Once the link is authenticated,
it probes its current path (kafila.proto.udp PathProbe, don't-fragment; on the relay path inside
RelayData, through the relay) with the sizes in `LinkConfig.probe_sizes`, largest first, and sends
larger packets from the first size the peer acknowledges: 1452 on an Ethernet LAN, 1392 through a
1420-byte tunnel, 16000 between members on one machine (on the relay 6 bytes less, its header).
Fewer packets per message is less of aioquic's per-packet Python work, which bounds a link's
throughput. Whenever the path changes the size goes back to 1200 (QUIC resends what a dropped
large packet carried in packets of the current size) and the new path is probed. With every
keepalive one probe of the size in use confirms it: a path whose MTU shrank (a route change)
would drop the large packets while the small PINGs and ACKs still kept it "alive", so after
`probe_confirm` unanswered confirmations in a row the size goes back to 1200 and the path is
probed again. Every `probe_raise` seconds (600) the sizes above the one in use are probed again,
so a path whose MTU grew gets the larger packets back.

ACKs: a lone packet's ACK waits up to `ack_delay` (25 ms) or until `acknowledge()` (the ring calls it
once a stage's output has left); a second packet is ACKed at once (docs/links.md, "ACKs").

Loss: a message queued while the stream holds at most `copy_flight` bytes unacknowledged (a decode
step's activation) leaves twice, each datagram right after itself, and the receiver drops the copy
before QUIC. One lost packet of such a lone flight would wait for QUIC's probe timeout (srtt + 4
rttvar + 25 ms) and halve the congestion window the next prefill needs; a bulk message's losses
show within a round trip by the packets after them, and it is sent once. QUIC's least round trip
is that of the last 10-20 s (congestion.LeastRtt, forgotten at a path change): aioquic takes its
RTT variance, so its probe timeout, from it, and a path whose delay grew would keep the old one.

Messages: one bidirectional stream carries (kind, payload) messages in order (kafila.net.framing).
Authentication (kafila.net.auth) runs on it first; `send`/`recv` work only after it succeeds.
A message sent with `delivered` is timed on this side's clock: from `send` until the peer's ACK of
its last byte came back, less the delay the peer says it held that ACK (which a ring stage holds
while it computes), so what is left is the message's way there, queueing and resends included, and
the ACK's way back.
"""

from __future__ import annotations

import asyncio
import ssl
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

from aioquic.buffer import Buffer
from aioquic.quic import events
from aioquic.quic.configuration import QuicConfiguration
from aioquic.quic.connection import QuicConnection
from aioquic.quic.packet import QuicPacketType, pull_quic_header

from kafila.net import congestion, framing, quic_private
from kafila.net.auth import EdgeContext, LinkAuth
from kafila.net.certs import Identity, fingerprint
from kafila.net.endpoint import Address, UdpEndpoint
from kafila.net.errors import LinkAuthError, LinkClosed, LinkEnded, LinkError, LinkTimeout, PeerSilent
from kafila.net.waits import wait_at_most
from kafila.obs.log import get_logger
from kafila.proto import udp

log = get_logger("kafila.net.link")
ALPN = "kafila-link/1"
STREAM = 0  # the client's first bidirectional stream carries everything
ERROR_AUTH = 0x1A  # application close code: authentication failed
ERROR_CLOSED = 0x0  # normal close
ERROR_ENDED = 0x1E  # application close code: the sender's person ended the session (LinkEnded)


class PathKind(StrEnum):
    DIRECT = "direct"
    RELAY = "relay"


@dataclass(frozen=True)
class RelayLeg:
    """This member's leg of a relay channel (already bound at the relay)."""

    relay: Address
    channel: int
    token: bytes  # re-sent in a RelayBind every `relay_refresh` s so the channel does not expire


@dataclass(frozen=True)
class LinkConfig:
    max_datagram_size: int = 1200  # QUIC packet size on every path until a probe allows more
    # datagram sizes probed on the current path, largest first; () keeps max_datagram_size (a relayed
    # QUIC packet is 6 bytes smaller: the relay header is part of the datagram). aioquic 1.7 writes a
    # STREAM frame's length in two bytes, so its packets stay below 16 KiB. The others are a link
    # MTU less the IP and UDP headers: 9000 (jumbo), 1500 (Ethernet, Wi-Fi; PPPoE's 1492 too),
    # 1420 (WireGuard and other tunnels, IPv4) and IPv6's 1280 minimum
    probe_sizes: tuple[int, ...] = (16000, 8952, 1452, 1392, 1232)
    # per probe (at least 4 smoothed RTTs), two tries per size; a peer busy loading its stage answers
    # late: at 0.1 s a member of the demo missed its neighbour's answers to 16000 and took 1452
    probe_timeout: float = 0.5
    probe_confirm: int = 3  # keepalives in a row whose probe of the size in use went unanswered
    # seconds between probes of the sizes above the one in use (RFC 8899's raise timer): a path
    # whose MTU grew (a route change, a tunnel gone) gets the larger packets back; 0 turns them off
    probe_raise: float = 600.0
    max_stream_data: int = 32 * 1024 * 1024  # flow-control window: several activation frames
    max_data: int = 64 * 1024 * 1024
    # aioquic's algorithm: "reno", "cubic", or "kafila" (Reno that tolerates a lossy path's random
    # loss below 2% while the round trip shows no queue: kafila.net.congestion)
    congestion_control: str = congestion.NAME
    idle_timeout: float = 30.0  # no packet at all for this long: the link is closed
    keepalive: float = 2.0  # PING interval; holds NAT mappings and feeds the liveness check
    dead_after: float = 6.0  # nothing from the direct path for this long: fall back to relay
    peer_timeout: float = 15.0  # nothing from the peer on any path for this long: LinkTimeout
    handshake_timeout: float = 10.0  # QUIC handshake plus authentication
    send_buffer: int = 16 * 1024 * 1024  # send() waits while more than this is unacknowledged
    relay_refresh: float = 20.0  # re-bind the relay leg this often (relay idle expiry, NAT mapping)
    # on the relay path, nothing from it for this many keepalives: re-bind now (each keepalive while
    # it stays silent): a NAT that forgot the mapping sends from a new port, which the relay drops
    # until that port binds the leg, and peer_timeout would end the link before the next refresh
    relay_silent_keepalives: float = 2.0
    # how long the ACK of a lone packet may wait (RFC 9000 13.2.1; aioquic advertises max_ack_delay
    # 25 ms and waits 1 ms). A ring stage receives one frame per step and ACKs it when its own output
    # has left (`acknowledge`); an ACK 1 ms after the frame would wake its loop in the middle of the
    # compute (docs/links.md, "ACKs"). A second packet is ACKed at once (13.2.2).
    ack_delay: float = 0.025
    # a message queued while the stream's unacknowledged bytes, its own included, are at most this
    # is sent twice (0: never): a decode step's activation is a lone flight, whose loss QUIC finds
    # only by its probe timeout (srtt + 4 rttvar + 25 ms) and answers by halving the congestion
    # window the next prefill needs; a copy that arrives spares both (docs/links.md, "Loss")
    copy_flight: int = 32 * 1024


@dataclass(frozen=True)
class PathChange:
    at: float  # loop time
    old: PathKind | None
    new: PathKind
    reason: str


@dataclass(frozen=True)
class LinkStats:
    path: PathKind | None
    bytes_sent: int  # message payload bytes
    bytes_received: int
    messages_sent: int
    messages_received: int
    datagrams_direct: int  # QUIC datagrams sent on each path
    datagrams_relay: int
    smoothed_rtt: float  # seconds, QUIC's estimate
    path_changes: int
    datagram_size: int  # bytes per QUIC packet now (raised by a path probe on a direct path)
    datagrams_copied: int  # of the datagrams sent, the second copies of small flights' (`copy_flight`)
    copies_received: int  # datagrams that came again (the peer's copy or the network's) and were dropped


@dataclass
class _Counters:
    bytes_sent: int = 0
    bytes_received: int = 0
    messages_sent: int = 0
    messages_received: int = 0
    datagrams: dict[PathKind, int] = field(default_factory=lambda: dict.fromkeys(PathKind, 0))
    datagrams_copied: int = 0
    copies_received: int = 0


@dataclass(frozen=True)
class _Timed:
    """A message `send` was asked to time: the stream offset after its last byte, when it was sent."""

    end: int
    sent_at: float
    delivered: Callable[[float], None]


class Link:
    """One end of an authenticated QUIC link. Made by `kafila.net.edge.connect_edge` (tests also
    build one directly and hand it a path with `add_direct` / `set_relay` before `start`)."""

    def __init__(
        self,
        endpoint: UdpEndpoint,
        ctx: EdgeContext,
        identity: Identity,
        is_client: bool,
        config: LinkConfig | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.ctx = ctx
        self.identity = identity
        self.is_client = is_client
        self.config = config or LinkConfig()
        self.peer_id = ctx.server_id if is_client else ctx.client_id
        self.path_changes: list[PathChange] = []
        self.on_path_change: list[Callable[[PathChange], None]] = []
        self.on_close: list[Callable[[], None]] = []
        # message kinds handed to a callback as they arrive, never to `recv` (the session's control
        # messages, which share a member's link with its ring channel: kafila.session.forming.epochs)
        self.handlers: dict[int, Callable[[bytes], None]] = {}
        self.tasks: list[asyncio.Task[None]] = []  # helpers (punching, relay setup) ended on close
        self.relay_error: str | None = None  # why no relay leg could be set up, if so
        # set once the first round of punching is over (succeeded or timed out): from then on a
        # link on the relay is a measured failure to punch, no longer a punch still under way
        self.punch_over = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        self._virtual = ("kafila-peer", self.peer_id)
        self._quic: QuicConnection | None = None
        self._path: PathKind | None = None
        self._direct: Address | None = None
        self._relay: RelayLeg | None = None
        self._relay_at = 0.0  # loop time the relay leg was set (the relay path's "last heard" until then)
        self._last_rx: dict[PathKind, float] = {}
        self._reader = framing.MessageReader()
        self._inbox: asyncio.Queue[tuple[int, bytes] | None] = asyncio.Queue()
        self._auth = LinkAuth(ctx, is_client, b"")
        self._ready: asyncio.Future[None] = self._loop.create_future()
        self._drained = asyncio.Event()
        self._drained.set()
        self._closed: LinkError | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at: float | None = None
        self._keepalive_task: asyncio.Task[None] | None = None
        self._probing: asyncio.Task[None] | None = None
        self._unconfirmed = 0  # keepalive probes of the size in use unanswered in a row
        self._probed_at = 0.0  # loop time the latest search of the path's packet size began
        self.datagram_size = self.config.max_datagram_size
        self._counters = _Counters()
        self._timed: deque[_Timed] = deque()  # messages sent with `delivered`, oldest first
        self._recent = RecentDatagrams()  # what arrived lately, so a copy is dropped before QUIC
        self._least_rtt = congestion.LeastRtt()  # aioquic's least round trip (quic_private.window_min_rtt)
        self._log = log.bind(edge=f"{ctx.client_id}->{ctx.server_id}", me="client" if is_client else "server")

    # ------------------------------------------------------------------ paths

    @property
    def path(self) -> PathKind | None:
        return self._path

    @property
    def relay_leg(self) -> RelayLeg | None:
        """The relay channel this link falls back to (None until it is granted and bound)."""
        return self._relay

    @property
    def direct_address(self) -> Address | None:
        return self._direct

    def add_direct(self, addr: Address, reason: str = "punch succeeded") -> None:
        """Route QUIC from `addr` to this link and send on it from now on."""
        self.endpoint.route_quic_from(addr, self._datagram)
        self._direct = addr
        self._last_rx[PathKind.DIRECT] = self._loop.time()
        self._set_path(PathKind.DIRECT, reason)

    def accept_from(self, addr: Address) -> None:
        """Route QUIC arriving from `addr` (a peer address a valid punch probe came from) here."""
        if self._closed is None:
            self.endpoint.route_quic_from(addr, self._datagram)

    def set_relay(self, leg: RelayLeg) -> None:
        """Make the relay available; it carries the link whenever no direct path works."""
        self.endpoint.route_relay_channel(leg.channel, self._datagram)
        self._relay = leg
        self._relay_at = self._loop.time()
        if self._path is None:
            self._set_path(PathKind.RELAY, "no direct path yet")

    def _set_path(self, new: PathKind, reason: str, old_dead: bool = False) -> None:
        """Carry the link on `new` from now on; `old_dead`: the old path fell silent, so what is
        in flight on it is sent again on the new one at once (`_resend_in_flight`)."""
        if new is self._path:
            return
        change = PathChange(self._loop.time(), self._path, new, reason)
        self._path = new
        self.path_changes.append(change)
        self._log.info("link_path", old=change.old, new=new.value, reason=reason)
        for callback in list(self.on_path_change):
            callback(change)
        if old_dead:
            self._resend_in_flight()
        self._least_rtt.reset()  # the new path's round trip, from its first sample on
        self._use_datagram_size(self.config.max_datagram_size)
        self._probe_current_path()
        self._transmit()

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Client: send the first flight. Server: wait for it. Keepalives start for both."""
        if self.is_client:
            self._quic = self._new_connection()
            self._quic.connect(self._virtual, now=self._loop.time())
            self._transmit()
        self._keepalive_task = self._loop.create_task(self._keepalive())

    async def wait_ready(self) -> None:
        """Until the QUIC handshake and the mutual authentication are done (or fail)."""
        try:
            await wait_at_most(asyncio.shield(self._ready), self.config.handshake_timeout)
        except TimeoutError:
            err = LinkTimeout(
                f"link {self.ctx.client_id}->{self.ctx.server_id}: not authenticated within "
                f"{self.config.handshake_timeout} s (path {self._path})"
            )
            self._fail(err, ERROR_CLOSED, "handshake timeout")
            raise err from None

    async def close(self, reason: str = "closed by this side", ended: bool = False) -> None:
        """Close the link, telling the peer `reason`; `ended`: because the session ends on purpose
        (the peer's link then fails with LinkEnded rather than LinkClosed)."""
        if self._closed is None:
            err = (LinkEnded if ended else LinkClosed)(f"link to {self.peer_id}: {reason}")
            self._fail(err, ERROR_ENDED if ended else ERROR_CLOSED, reason)

    def _quic_config(self) -> QuicConfiguration:
        cfg = QuicConfiguration(
            is_client=self.is_client,
            alpn_protocols=[ALPN],
            max_datagram_size=self.config.max_datagram_size,
            max_data=self.config.max_data,
            max_stream_data=self.config.max_stream_data,
            idle_timeout=self.config.idle_timeout,
            congestion_control_algorithm=self.config.congestion_control,
        )
        if self.is_client:
            cfg.verify_mode = ssl.CERT_NONE  # the certificate is checked by the SPAKE2 binding instead
        else:
            cfg.certificate = self.identity.certificate
            cfg.private_key = self.identity.private_key
        return cfg

    # ------------------------------------------------------------------ datagrams in and out

    def _datagram(self, data: bytes, via: str, src: Address) -> None:
        if self._closed is not None:
            return
        now = self._loop.time()
        self._last_rx[PathKind(via)] = now
        if via == PathKind.DIRECT and (self._direct is None or self._path is PathKind.RELAY):
            # src passed a punch check already. On the relay: the peer's punch succeeded again (it
            # proved both directions) and it sends on the direct path; follow it, or each side
            # would find the other's path silent and the two swap paths every re-punch, forever
            why = (
                "the peer reached us directly"
                if self._direct is None
                else "the peer is back on the direct path"
            )
            self.add_direct(src, why)
        if self._recent.seen(data):  # a copy: QUIC would drop it too, after decrypting it, and
            self._counters.copies_received += 1  # it must not count as the second packet below
            return
        if self._quic is None and not self._accept_initial(data):
            return
        assert self._quic is not None
        pending = quic_private.ack_waiting(self._quic)  # an ACK already waits
        self._quic.receive_datagram(data, self._virtual, now=now)
        if pending:  # a second packet since our last ACK: acknowledge both now (13.2.2)
            quic_private.send_waiting_ack_now(self._quic, now)
        self.endpoint.mark_dirty(self._flush)

    def _flush(self) -> None:
        if self._quic is not None and self._closed is None:
            self._process()

    def _new_connection(self, original_dcid: bytes | None = None) -> QuicConnection:
        conn = QuicConnection(
            configuration=self._quic_config(), original_destination_connection_id=original_dcid
        )
        quic_private.set_ack_delay(conn, self.config.ack_delay)
        quic_private.window_min_rtt(conn, self._least_rtt)
        quic_private.on_ack(conn, self._acked)
        return conn

    def _accept_initial(self, data: bytes) -> bool:
        """Server: the client's first Initial packet creates the connection."""
        if self.is_client:
            return False
        try:
            header = pull_quic_header(Buffer(data=data), host_cid_length=8)
        except ValueError:
            return False
        if header.packet_type is not QuicPacketType.INITIAL:
            return False
        self._quic = self._new_connection(header.destination_cid)
        return True

    def _transmit(self, message: bool = False) -> None:
        """Send what QUIC has to send; `message`: a message was just queued, whose flight is sent
        twice while it is small (`copy_flight`)."""
        if self._quic is None or self._path is None:
            return
        now = self._loop.time()
        out = self._quic.datagrams_to_send(now=now)
        times = copies(self.unacknowledged(), self.config.copy_flight) if message else 1
        for data, _ in out:
            for _ in range(times):
                self._send_datagram(data)
        self._counters.datagrams_copied += (times - 1) * len(out)
        self._arm_timer()

    def _send_datagram(self, data: bytes) -> None:
        assert self._path is not None
        self._counters.datagrams[self._path] += 1
        if self._path is PathKind.DIRECT and self._direct is not None:
            self.endpoint.sendto(data, self._direct)
        elif self._relay is not None:
            self.endpoint.sendto(udp.relay_header(self._relay.channel) + data, self._relay.relay)

    # ------------------------------------------------------------------ packet size

    def _probe_current_path(self, first: bool = True) -> None:
        """Start probing the current path's packet size (authenticated links, one probe at a time);
        `first`: the path is new to this size (a raise probe is not, and logs only a change)."""
        if self._path is None or not self._ready.done() or self._closed is not None:
            return
        if not self.config.probe_sizes:
            return
        if self._probing is not None and not self._probing.done():
            self._probing.cancel()
        self._probing = self._loop.create_task(self._probe_path(self._path, self._route(), first))

    def _route(self) -> tuple[Address, int | None] | None:
        """Where the current path's datagrams go: (address, None) direct, (relay, channel) relayed."""
        if self._path is PathKind.DIRECT and self._direct is not None:
            return self._direct, None
        if self._path is PathKind.RELAY and self._relay is not None:
            return self._relay.relay, self._relay.channel
        return None

    async def _probe_path(
        self, path: PathKind, route: tuple[Address, int | None] | None, first: bool = True
    ) -> None:
        if route is None:
            return
        started = self._probed_at = self._loop.time()
        before = self.datagram_size
        for packet in sorted((size - _header(route) for size in self.config.probe_sizes), reverse=True):
            if packet <= self.datagram_size:
                break
            if await self._carries(route, packet, attempts=2):
                if self._path is path and self._route() == route:
                    self._use_datagram_size(packet)
                break
        (self._log.info if first or self.datagram_size != before else self._log.debug)(
            "link_packet_size",
            path=path.value,
            size=self.datagram_size,
            probed_s=round(self._loop.time() - started, 3),
        )

    def _confirm_size(self) -> None:
        """Each keepalive: one probe of the size in use (while it is above the base size), or, every
        `probe_raise` seconds, a search of the sizes above it."""
        if self._probing is not None and not self._probing.done():
            return
        raise_every = self.config.probe_raise
        if raise_every > 0 and self._loop.time() - self._probed_at >= raise_every:
            self._probe_current_path(first=False)
        elif self.datagram_size > self.config.max_datagram_size:
            self._probing = self._loop.create_task(self._confirm(self._route(), self.datagram_size))

    async def _confirm(self, route: tuple[Address, int | None] | None, size: int) -> None:
        if route is None:
            return
        ok = await self._carries(route, size, attempts=1)  # a keepalive waits for it to end
        if self._route() != route or self.datagram_size != size:
            return  # the path or the size changed meanwhile: that started its own probing
        self._unconfirmed = 0 if ok else self._unconfirmed + 1
        if self._unconfirmed >= self.config.probe_confirm:
            self._log.warning("link_packet_size_lost", size=size, unanswered=self._unconfirmed)
            self._use_datagram_size(self.config.max_datagram_size)
            self._probing = None
            self._probe_current_path()

    async def _carries(self, route: tuple[Address, int | None], packet: int, attempts: int) -> bool:
        """Whether `route` carries QUIC packets of `packet` bytes (a relayed one with its header)."""
        timeout = max(self.config.probe_timeout, 4 * self._rtt())
        size = packet + _header(route)
        return await self.endpoint.path_carries(route[0], size, timeout, attempts, channel=route[1])

    def _rtt(self) -> float:
        return quic_private.smoothed_rtt(self._quic) if self._quic is not None else 0.0

    def _resend_in_flight(self) -> None:
        """After the path in use fell silent: every packet in flight on it is lost; send its data
        again on the new path now, with a new path's congestion window (RFC 9000, 9.4). QUIC's loss
        recovery would wait for its probe timer, which has backed off through the seconds of
        silence: 85 KB sent into a cut direct path arrived over the relay 6.9 s after the cut,
        where a ring gives a member 5 s (tests/net/test_edge_loopback.py)."""
        if self._quic is not None:
            quic_private.declare_in_flight_lost(self._quic, self._loop.time(), self.datagram_size)

    def _use_datagram_size(self, size: int) -> None:
        """Build QUIC packets of up to `size` bytes from now on. aioquic fixes the size when the
        connection is made (kafila.net.quic_private changes it)."""
        self.datagram_size, self._unconfirmed = size, 0
        if self._quic is not None:
            quic_private.set_datagram_size(self._quic, size)

    def _arm_timer(self) -> None:
        at = self._quic.get_timer() if self._quic is not None and self._closed is None else None
        if self._timer is not None:
            if at == self._timer_at:
                return  # unchanged: most sends leave the loss/ack timer where it was
            self._timer.cancel()
            self._timer = None
        self._timer_at = at
        if at is not None:
            self._timer = self._loop.call_at(at, self._on_timer)

    def _on_timer(self) -> None:
        self._timer = None
        if self._quic is None or self._closed is not None:
            return
        self._quic.handle_timer(now=self._loop.time())
        self._process()

    # ------------------------------------------------------------------ QUIC events

    def _process(self) -> None:
        assert self._quic is not None
        try:
            while (event := self._quic.next_event()) is not None:
                self._on_event(event)
            close = quic_private.pending_close(self._quic)  # aioquic reports it after draining
            if close is not None and self._closed is None:  # (3 PTOs, 0.1-0.7 s here); at once now
                self._on_event(close)
        except LinkAuthError as exc:
            self._fail(exc, ERROR_AUTH, "authentication failed")
        except framing.FramingError as exc:
            self._fail(LinkClosed(f"link to {self.peer_id}: {exc}"), ERROR_CLOSED, "bad framing")
        except Exception as exc:  # a bug must close this link loudly, not stall the socket reader
            self._log.exception("link_internal_error")
            self._fail(
                LinkClosed(f"link to {self.peer_id}: internal error {exc!r}"), ERROR_CLOSED, "internal"
            )
        self._transmit()
        self._update_drained()

    def _on_event(self, event: events.QuicEvent) -> None:
        if isinstance(event, events.HandshakeCompleted):
            self._start_auth()
        elif isinstance(event, events.StreamDataReceived):
            self._on_stream(event)
        elif isinstance(event, events.ConnectionTerminated):
            codes = {ERROR_AUTH: LinkAuthError, ERROR_ENDED: LinkEnded}
            cls = codes.get(event.error_code, LinkClosed)
            why = event.reason_phrase or "no reason"
            self._fail(cls(f"link to {self.peer_id} closed by the peer: {why}"))

    def _start_auth(self) -> None:
        assert self._quic is not None
        if self.is_client:
            peer_cert = quic_private.peer_certificate(self._quic)  # what TLS actually showed us
            if peer_cert is None:
                raise LinkAuthError(f"link to {self.peer_id}: the server presented no certificate")
            self._auth = LinkAuth(self.ctx, True, fingerprint(peer_cert))
            self._send_raw(framing.KIND_AUTH_HELLO, self._auth.hello())
        else:
            self._auth = LinkAuth(self.ctx, False, self.identity.fingerprint)

    def _on_stream(self, event: events.StreamDataReceived) -> None:
        if event.stream_id != STREAM:
            raise framing.FramingError(f"data on unexpected stream {event.stream_id}")
        for kind, payload in self._reader.feed(event.data):
            if kind < framing.FIRST_APP_KIND:
                self._on_auth_message(kind, payload)
            elif not self._ready.done():
                raise LinkAuthError(f"link to {self.peer_id}: message kind {kind} before authentication")
            else:
                self._counters.messages_received += 1
                self._counters.bytes_received += len(payload)
                if (handler := self.handlers.get(kind)) is not None:
                    handler(payload)
                else:
                    self._inbox.put_nowait((kind, payload))
        if event.end_stream:
            self._fail(LinkClosed(f"link to {self.peer_id}: the peer ended the message stream"))

    def _on_auth_message(self, kind: int, payload: bytes) -> None:
        if kind == framing.KIND_AUTH_HELLO and not self.is_client:
            self._auth.on_peer_hello(payload)
            self._send_raw(framing.KIND_AUTH_HELLO, self._auth.hello())
            self._send_raw(framing.KIND_AUTH_CONFIRM, self._auth.confirm())
        elif kind == framing.KIND_AUTH_HELLO:
            self._auth.on_peer_hello(payload)
        elif kind == framing.KIND_AUTH_CONFIRM and not self._ready.done():
            self._auth.verify(payload)
            if self.is_client:
                self._send_raw(framing.KIND_AUTH_CONFIRM, self._auth.confirm())
            self._ready.set_result(None)
            self._log.info("link_authenticated", path=self._path)
            self._probe_current_path()
        else:
            raise LinkAuthError(f"link to {self.peer_id}: unexpected link message kind {kind}")

    def _send_raw(self, kind: int, payload: bytes) -> None:
        assert self._quic is not None
        self._quic.send_stream_data(STREAM, framing.encode_header(kind, len(payload)) + payload)

    # ------------------------------------------------------------------ messages

    async def send(self, kind: int, payload: bytes, delivered: Callable[[float], None] | None = None) -> None:
        """Queue one message; waits while more than `send_buffer` bytes are unacknowledged.
        `delivered(seconds)` is called once the peer acknowledged all of it: the seconds from now
        until its ACK came, less the delay the peer held that ACK."""
        if kind < framing.FIRST_APP_KIND:
            raise ValueError(f"message kinds below {framing.FIRST_APP_KIND} are reserved for the link")
        self._raise_if_closed()
        if not self._ready.done():
            await self.wait_ready()
        while not self._drained.is_set():
            await self._drained.wait()
            self._raise_if_closed()
        self._send_raw(kind, payload)
        if delivered is not None:
            assert self._quic is not None
            end = quic_private.stream_written(self._quic, STREAM)
            self._timed.append(_Timed(end, self._loop.time(), delivered))
        self._counters.messages_sent += 1
        self._counters.bytes_sent += len(payload)
        self._transmit(message=True)
        self._update_drained()

    async def recv(self, timeout: float | None = None) -> tuple[int, bytes]:
        """The next message in order; LinkClosed when the link ends, LinkTimeout after `timeout`."""
        if self._inbox.empty():
            self._raise_if_closed()
            try:
                async with asyncio.timeout(timeout):  # in this task: no task per message (wait_for)
                    item = await self._inbox.get()
            except TimeoutError:
                raise LinkTimeout(f"link to {self.peer_id}: no message within {timeout} s") from None
        else:
            item = self._inbox.get_nowait()
        if item is None:
            self._inbox.put_nowait(None)  # wake any other reader too
            self._raise_if_closed()
            raise LinkClosed(f"link to {self.peer_id} closed")
        return item

    def acknowledge(self) -> None:
        """Send the ACK that waits for `ack_delay`, now. A ring stage calls it once its step's output
        is on its way: the member that sent the step's input is idle then, where the timer would
        have reached it, or this side, in the middle of a compute."""
        quic = self._quic if self._closed is None else None
        if quic is not None and quic_private.send_waiting_ack_now(quic, self._loop.time()):
            self._transmit()

    def _acked(self, now: float, ack_delay: float) -> None:
        """An ACK from the peer was applied: every timed message it completed is delivered."""
        if not self._timed or self._quic is None:
            return
        acked = quic_private.stream_acked(self._quic, STREAM)
        while self._timed and self._timed[0].end <= acked:
            timed = self._timed.popleft()
            try:
                timed.delivered(max(0.0, now - timed.sent_at - ack_delay))
            except Exception:  # an observer's bug must not break the ACK's processing
                self._log.exception("link_delivered_callback_failed")

    def unacknowledged(self) -> int:
        return 0 if self._quic is None else quic_private.unacked_stream_bytes(self._quic, STREAM)

    def _update_drained(self) -> None:
        if self._closed is not None or self.unacknowledged() <= self.config.send_buffer:
            self._drained.set()
        else:
            self._drained.clear()

    def stats(self) -> LinkStats:
        c = self._counters
        rtt = self._rtt()
        return LinkStats(
            path=self._path,
            bytes_sent=c.bytes_sent,
            bytes_received=c.bytes_received,
            messages_sent=c.messages_sent,
            messages_received=c.messages_received,
            datagrams_direct=c.datagrams[PathKind.DIRECT],
            datagrams_relay=c.datagrams[PathKind.RELAY],
            smoothed_rtt=rtt,
            path_changes=len(self.path_changes),
            datagram_size=self.datagram_size,
            datagrams_copied=c.datagrams_copied,
            copies_received=c.copies_received,
        )

    @property
    def last_heard(self) -> float | None:
        """Loop time of the last datagram from the peer on either path (None: nothing yet)."""
        return max(self._last_rx.values(), default=None)

    @property
    def closed(self) -> bool:
        return self._closed is not None

    @property
    def error(self) -> LinkError | None:
        """Why the link closed (None while it is open)."""
        return self._closed

    # ------------------------------------------------------------------ liveness and failure

    async def _keepalive(self) -> None:
        interval = self.config.keepalive
        uid = 0
        refreshed = self._loop.time()
        logged: float | None = None  # the relay path's "last heard" of the silence logged already
        step = min(interval, self.config.dead_after / 3)
        while self._closed is None:
            slept_from = self._loop.time()
            await asyncio.sleep(step)
            now = self._loop.time()
            stalled = own_stall(slept_from, step, now)
            if stalled > 0:  # this process did not run (frozen, or its loop blocked): not the peer's silence
                self._last_rx = {k: min(now, t + stalled) for k, t in self._last_rx.items()}
                self._relay_at, refreshed = self._relay_at + stalled, refreshed + stalled
                self._log.info("link_stalled", stalled_s=round(stalled, 1))
            if self._relay is not None:
                heard = self._last_rx.get(PathKind.RELAY, self._relay_at)
                why = relay_rebind_due(now, refreshed, heard, self._path is PathKind.RELAY, self.config)
                if why is not None:
                    refreshed = now
                    self.endpoint.send_control(
                        udp.RelayBind(self._relay.channel, self._relay.token), self._relay.relay
                    )
                    if why is RebindReason.SILENT and logged != heard:  # one event per silence
                        logged = heard
                        self._log.info("link_relay_rebind", reason=why.value, silent_s=round(now - heard, 1))
            if self._quic is None or self._closed is not None:
                continue
            self._check_peer()
            self._check_direct()
            uid += 1
            self._quic.send_ping(uid)
            self._transmit()
            self._confirm_size()

    def _check_peer(self) -> None:
        if not self._ready.done() or not self._last_rx:
            return
        silent = self._loop.time() - max(self._last_rx.values())
        if silent > self.config.peer_timeout:
            err = PeerSilent(f"link to {self.peer_id}: nothing received on any path for {silent:.1f} s")
            self._fail(err, ERROR_CLOSED, "peer silent")

    def _check_direct(self) -> None:
        if self._path is not PathKind.DIRECT or self._relay is None:
            return
        silent = self._loop.time() - self._last_rx.get(PathKind.DIRECT, 0.0)
        if silent > self.config.dead_after:
            self._set_path(PathKind.RELAY, f"direct path silent for {silent:.1f} s", old_dead=True)

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise self._closed

    def _fail(self, err: LinkError, code: int | None = None, reason: str = "") -> None:
        if self._closed is not None:
            return
        self._closed = err
        if code is not None and self._quic is not None:
            self._quic.close(error_code=code, reason_phrase=reason)
            self._transmit()
        self._log.info("link_closed", reason=str(err))
        if not self._ready.done():
            self._ready.set_exception(err)
            self._ready.exception()  # retrieved: wait_ready re-raises it
        self._inbox.put_nowait(None)
        self._drained.set()
        self._timed.clear()
        if self._timer is not None:
            self._timer.cancel()
        for task in (self._keepalive_task, self._probing):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        self.endpoint.forget(self._datagram)
        for task in self.tasks:
            if task is not asyncio.current_task():
                task.cancel()
        for callback in self.on_close:
            callback()


def copies(unacked: int, limit: int) -> int:
    """How many times each datagram of a message's flight is sent, with `unacked` bytes of the
    stream written and not yet acknowledged once it was queued (its own included, sent or not):
    twice while that is at most `limit` (a decode step's lone activation, where one lost packet
    waits for QUIC's probe timeout and halves its congestion window), once for bulk (a prefill, a
    shard), where later packets reveal a loss within a round trip and copies would double the
    bytes. `limit` 0: never twice."""
    return 2 if 0 < unacked <= limit else 1


class RecentDatagrams:
    """The datagrams that arrived lately (by hash), so a copy of one is known. QUIC never sends
    the same bytes twice (each packet has its own number), so a repeat is a copy; a hash that
    collided would drop a packet QUIC then resends."""

    def __init__(self, keep: int = 64) -> None:
        self._order: deque[int] = deque()
        self._set: set[int] = set()
        self._keep = keep

    def seen(self, data: bytes) -> bool:
        """Whether `data` arrived already; remembers it otherwise."""
        key = hash(data)
        if key in self._set:
            return True
        self._order.append(key)
        self._set.add(key)
        if len(self._order) > self._keep:
            self._set.discard(self._order.popleft())
        return False


STALL_S = 1.0  # a keepalive this much later than its sleep: this process stalled


def own_stall(slept_from: float, step: float, now: float) -> float:
    """Seconds this process did not run while a keepalive slept `step` s from `slept_from` (pure;
    0 for an ordinary wake-up): a frozen process (SIGSTOP, a laptop asleep) or a blocked loop reads
    nothing meanwhile, so the peer's silence over that time is not counted against it; datagrams
    that wait in its socket are read next."""
    late = now - slept_from - step
    return late if late >= STALL_S else 0.0


class RebindReason(StrEnum):
    REFRESH = "refresh"  # every relay_refresh s: the channel's idle expiry, the NAT mapping
    SILENT = "relay path silent"  # the relay path carries the link and has gone quiet


def relay_rebind_due(
    now: float, refreshed: float, heard: float, on_relay: bool, config: LinkConfig
) -> RebindReason | None:
    """Whether the relay leg is re-bound at this keepalive (pure): `refreshed` is when it was last
    bound, `heard` when the relay path last carried anything from the peer. While the link is on
    the relay, a path silent for `relay_silent_keepalives` keepalives is re-bound at once and then
    once per keepalive until it answers (a NAT that lost the mapping sends from a new port, which
    the relay takes only once it binds the leg); otherwise every `relay_refresh` seconds."""
    if now - refreshed >= config.relay_refresh:
        return RebindReason.REFRESH
    silent_for = config.relay_silent_keepalives * config.keepalive
    if on_relay and now - heard > silent_for and now - refreshed >= config.keepalive:
        return RebindReason.SILENT
    return None


def _header(route: tuple[Address, int | None]) -> int:
    """Bytes a datagram on `route` carries besides the QUIC packet: the relay header, if relayed."""
    return 0 if route[1] is None else udp.RELAY_HEADER_BYTES
