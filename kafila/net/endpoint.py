"""One UDP socket per member, shared by everything, told apart by the first byte.

0x00-0x3F are kafila.proto.udp control messages (rendezvous probes, relay, punching); QUIC v1
sets bit 0x40. QUIC from a direct peer is routed by its source address, relayed QUIC by the relay
channel in its header; binding and relay answers wake whoever waits for their transaction id or
channel; punch messages go to every registered puncher (each checks its own authenticator). A path
probe is answered only when it comes from a peer whose QUIC this socket already takes, directly or
on a relay channel it routes (no answers to strangers); its answer wakes the waiting
`path_carries`.

The socket sets the don't-fragment bit where the OS lets it (Linux, macOS): a datagram larger
than the path carries is dropped instead of cut into IP fragments, which is what makes a path
probe's answer mean something (and what QUIC asks for, RFC 9000 section 14).
"""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kafila.net.errors import NatProbeError
from kafila.net.waits import wait_at_most
from kafila.obs.log import get_logger
from kafila.proto import udp
from kafila.proto.errors import ProtocolError

log = get_logger("kafila.net.endpoint")
K = TypeVar("K", bytes, int)  # a transaction id, or a relay channel
T = TypeVar("T")

# <netinet/in.h> values the socket module does not export
_LINUX_IP_MTU_DISCOVER, _LINUX_IP_PMTUDISC_PROBE = 10, 3  # DF set, the kernel's cached PMTU ignored
_DARWIN_IP_DONTFRAG = 28

Address = tuple[str, int]
QuicSink = Callable[[bytes, str, Address], None]  # (datagram, "direct"|"relay", source)
PunchSink = Callable[[udp.PunchProbe | udp.PunchAck, Address], None]


@dataclass
class EndpointCounters:
    datagrams_in: int = 0
    datagrams_out: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    dropped: int = 0  # unknown source, unknown channel, malformed


@dataclass(frozen=True)
class Binding:
    """A binding answer (or the server's refusal) and how long it took (s, last send to answer)."""

    response: udp.BindingResponse | udp.BindingError
    rtt: float


class UdpEndpoint:
    """The socket, read in batches: every datagram waiting is read on one wake-up, then the
    links touched by the batch flush once (fewer ACK-only packets, fewer loop turns)."""

    BATCH = 64

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self.sock = sock
        self.counters = EndpointCounters()
        self._loop = asyncio.get_running_loop()
        self._closed = False
        self._quic_by_addr: dict[Address, QuicSink] = {}
        self._quic_by_channel: dict[int, QuicSink] = {}
        self._binding_waiters: dict[bytes, asyncio.Future[udp.BindingResponse | udp.BindingError]] = {}
        self._relay_waiters: dict[int, asyncio.Future[udp.RelayBindAck]] = {}
        self._punch_sinks: list[PunchSink] = []
        self._path_waiters: dict[bytes, asyncio.Future[int]] = {}
        self._dirty: dict[int, Callable[[], None]] = {}
        self.batch_read_ns = 0  # perf_counter_ns() when the latest batch of datagrams began to be read
        self.dont_fragment = _set_dont_fragment(sock)
        self._loop.add_reader(sock.fileno(), self._read_ready)

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    async def open(cls, sock: socket.socket | None = None, local: Address = ("0.0.0.0", 0)) -> UdpEndpoint:
        """Bind (or adopt `sock`) and start receiving."""
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            sock.bind(local)
        for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, opt, 4 * 1024 * 1024)
        return cls(sock)

    @property
    def local_address(self) -> Address:
        host, port = self.sock.getsockname()[:2]
        return (host, port)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._loop.remove_reader(self.sock.fileno())
            self.sock.close()

    def mark_dirty(self, flush: Callable[[], None]) -> None:
        """Ask for `flush()` once after the current batch of datagrams."""
        self._dirty[id(getattr(flush, "__self__", flush))] = flush

    # ------------------------------------------------------------------ routing tables

    def route_quic_from(self, addr: Address, sink: QuicSink) -> None:
        self._quic_by_addr[addr] = sink

    def route_relay_channel(self, channel: int, sink: QuicSink) -> None:
        self._quic_by_channel[channel] = sink

    def add_punch_sink(self, sink: PunchSink) -> None:
        self._punch_sinks.append(sink)

    def forget(self, sink: object) -> None:
        """Remove every route that leads to `sink` (or a bound method of it)."""
        owner = getattr(sink, "__self__", sink)

        def keep(s: object) -> bool:
            return getattr(s, "__self__", s) is not owner

        self._quic_by_addr = {a: s for a, s in self._quic_by_addr.items() if keep(s)}
        self._quic_by_channel = {c: s for c, s in self._quic_by_channel.items() if keep(s)}
        self._punch_sinks = [s for s in self._punch_sinks if keep(s)]

    # ------------------------------------------------------------------ I/O

    def sendto(self, data: bytes, addr: Address) -> None:
        if self._closed:
            return
        try:
            self.sock.sendto(data, addr)
        except (BlockingIOError, InterruptedError):
            self.counters.dropped += 1  # buffer full: UDP may drop, QUIC recovers
            return
        except OSError as exc:  # unreachable and the like: the link's liveness check decides
            log.debug("udp_send_error", to=addr, error=str(exc))
            return
        self.counters.datagrams_out += 1
        self.counters.bytes_out += len(data)

    def send_control(self, msg: udp.UdpMessage, addr: Address) -> None:
        self.sendto(udp.encode(msg), addr)

    def _read_ready(self) -> None:
        self.batch_read_ns = time.perf_counter_ns()
        for _ in range(self.BATCH):
            try:
                data, addr = self.sock.recvfrom(65535)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                log.debug("udp_recv_error", error=str(exc))
                break
            self.datagram_received(data, (addr[0], addr[1]))
        dirty, self._dirty = self._dirty, {}
        for flush in dirty.values():
            flush()

    def datagram_received(self, data: bytes, src: Address) -> None:
        self.counters.datagrams_in += 1
        self.counters.bytes_in += len(data)
        if not data:
            self.counters.dropped += 1
            return
        kind = udp.classify_datagram(data[0])
        if kind is udp.DatagramKind.QUIC:
            self._deliver(self._quic_by_addr.get(src), data, "direct", src)
        elif kind is udp.DatagramKind.RELAY and data[0] == udp.MsgType.RELAY_DATA:
            channel = udp.relay_channel(data)
            sink = self._quic_by_channel.get(channel) if channel is not None else None
            inner = data[udp.RELAY_HEADER_BYTES :]
            if sink is not None and inner and udp.classify_datagram(inner[0]) is udp.DatagramKind.PATH:
                self._control(inner, src, channel)  # a path probe (or its answer) through the relay
            else:
                self._deliver(sink, inner, "relay", src)
        else:
            self._control(data, src)

    def _deliver(self, sink: QuicSink | None, data: bytes, via: str, src: Address) -> None:
        if sink is None:
            self.counters.dropped += 1
            return
        sink(data, via, src)

    def _control(self, data: bytes, src: Address, channel: int | None = None) -> None:
        """A control message; `channel`: it came inside RelayData on that (routed) relay channel."""
        try:
            msg = udp.decode(data)
        except ProtocolError:
            self.counters.dropped += 1
            return
        match msg:
            case udp.BindingResponse(txid=txid) | udp.BindingError(txid=txid) if (
                txid in self._binding_waiters
            ):
                fut = self._binding_waiters.pop(txid)
                if not fut.done():
                    fut.set_result(msg)
            case udp.RelayBindAck(channel=ch) if ch in self._relay_waiters:
                bound = self._relay_waiters.pop(ch)
                if not bound.done():
                    bound.set_result(msg)
            case udp.RelayBindError(channel=ch) if ch in self._relay_waiters:
                bound = self._relay_waiters.pop(ch)
                if not bound.done():
                    bound.set_exception(ConnectionError(f"relay channel {ch}: {msg.code.name} {msg.reason}"))
            case udp.PunchProbe() | udp.PunchAck():
                for sink in list(self._punch_sinks):
                    sink(msg, src)
            case udp.PathProbe(txid=txid, size=size) if channel is not None or src in self._quic_by_addr:
                ack = udp.encode(udp.PathAck(txid, size))
                self.sendto(ack if channel is None else udp.relay_header(channel) + ack, src)
            case udp.PathAck(txid=txid, size=size) if txid in self._path_waiters:
                carried = self._path_waiters.pop(txid)
                if not carried.done():
                    carried.set_result(size)
            case _:
                self.counters.dropped += 1

    # ------------------------------------------------------------------ requests

    async def binding(
        self, server: Address, flags: int = 0, timeout: float = 0.3, attempts: int = 3
    ) -> Binding | None:
        """One binding request with retries; None when no answer came (that is a result too)."""
        txid = os.urandom(udp.TXID_BYTES)
        request = udp.encode(udp.BindingRequest(txid, flags))
        got = await self._ask(self._binding_waiters, txid, request, server, timeout, attempts)
        return Binding(*got) if got is not None else None

    async def path_carries(
        self, peer: Address, size: int, timeout: float, attempts: int = 2, channel: int | None = None
    ) -> bool:
        """Whether a `size`-byte datagram reaches `peer` whole (a peer that routes our QUIC answers
        path probes). With `channel`, `peer` is the relay and the probe travels inside RelayData
        (`size` counts the relay header too). False at once when this socket cannot set
        don't-fragment, or when the local interface refuses the size (EMSGSIZE)."""
        if not self.dont_fragment:
            return False
        txid = os.urandom(udp.TXID_BYTES)
        inner = size if channel is None else size - udp.RELAY_HEADER_BYTES
        probe = udp.encode(udp.PathProbe(txid, inner))
        probe = probe if channel is None else udp.relay_header(channel) + probe
        got = await self._ask(self._path_waiters, txid, probe, peer, timeout, attempts)
        return got is not None and got[0] == inner

    async def _ask(
        self,
        waiters: dict[K, asyncio.Future[T]],
        txid: K,
        request: bytes,
        to: Address,
        timeout: float,
        attempts: int,
    ) -> tuple[T, float] | None:
        """Send `request` up to `attempts` times, `timeout` s apart, until the answer with `txid`
        (a transaction id, or a relay channel) arrives: (the answer, seconds from the last send), or
        None. None at once when the local interface refuses the datagram's size (EMSGSIZE): no retry
        can change that. An answer that is an error (a future's exception) is raised."""
        fut: asyncio.Future[T] = self._loop.create_future()
        waiters[txid] = fut
        try:
            for _ in range(attempts):
                sent = time.perf_counter()
                try:
                    self.sock.sendto(request, to)
                except OSError as exc:
                    if exc.errno == errno.EMSGSIZE:
                        return None
                    log.debug("udp_send_error", to=to, error=str(exc))  # a full buffer: wait, try again
                else:
                    self.counters.datagrams_out += 1
                    self.counters.bytes_out += len(request)
                try:
                    return await wait_at_most(asyncio.shield(fut), timeout), time.perf_counter() - sent
                except TimeoutError:
                    continue
            return None
        finally:
            waiters.pop(txid, None)
            fut.cancel()

    async def bind_relay(
        self, relay: Address, channel: int, token: bytes, timeout: float = 0.3, attempts: int = 10
    ) -> udp.RelayBindAck:
        """Bind this socket as one leg of a relay channel (retried: the first packet may be lost)."""
        request = udp.encode(udp.RelayBind(channel, token))
        got = await self._ask(self._relay_waiters, channel, request, relay, timeout, attempts)
        if got is not None:
            return got[0]
        raise NatProbeError(
            f"relay {relay[0]}:{relay[1]} did not acknowledge channel {channel} "
            f"after {attempts} tries of {timeout} s"
        )


def _set_dont_fragment(sock: socket.socket) -> bool:
    """Set the don't-fragment bit on an IPv4 UDP socket; whether it could be set here."""
    if sock.family != socket.AF_INET:
        return False
    option = {"linux": (_LINUX_IP_MTU_DISCOVER, _LINUX_IP_PMTUDISC_PROBE), "darwin": (_DARWIN_IP_DONTFRAG, 1)}
    if sys.platform not in option:
        return False
    name, value = option[sys.platform]
    try:
        sock.setsockopt(socket.IPPROTO_IP, name, value)
    except OSError:
        return False
    return True
