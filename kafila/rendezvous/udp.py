"""UDP shell of the rendezvous: probe endpoints (RFC 5780 style) and the relay, on one to four sockets.

Sockets are indexed `2 * address + port`: (primary address, primary port) = 0, (primary, alternate
port) = 1, and with a second address (alternate address, primary port) = 2, (alternate, alternate) = 3.
A binding request may ask for the reply to leave from the other port and/or the other address.
Relay data is forwarded out of the socket the destination leg bound through. Malformed datagrams
are counted and dropped (answering unauthenticated garbage would make the rendezvous a reflector).
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import Counter
from collections.abc import Callable

from kafila.obs.log import get_logger
from kafila.proto import udp
from kafila.proto.errors import ProtocolError
from kafila.proto.udp import Address, DatagramKind, ErrorCode, format_address
from kafila.rendezvous.relay import RelayTable

log = get_logger("kafila.rendezvous.udp")
SOCKET_BUFFER_BYTES = 4 << 20  # relay bursts: a ring step can send a few hundred KB at once


class _Endpoint(asyncio.DatagramProtocol):
    def __init__(self, service: UdpService, index: int) -> None:
        self.service = service
        self.index = index

    def datagram_received(self, data: bytes, addr: tuple[str | int, ...]) -> None:
        self.service.handle(self.index, data, (str(addr[0]), int(addr[1])))

    def error_received(self, exc: Exception) -> None:
        self.service.stats["socket_errors"] += 1


class ListenError(OSError):
    """A port or address the rendezvous could not bind, with the setting (ServerConfig field, and
    the CLI flag of the same name) that chose it."""

    def __init__(self, errno: int | None, message: str, setting: str) -> None:
        super().__init__(errno, message)
        self.setting = setting


# which setting chose each UDP endpoint: the two ports, then the same two on the alternate address
_UDP_SETTINGS = {0: "udp_port", 1: "udp_alt_port", 2: "udp_alt_host", 3: "udp_alt_host"}


class UdpService:
    def __init__(self, relay: RelayTable, clock: Callable[[], float] = time.monotonic) -> None:
        self.relay = relay
        self.clock = clock
        self.transports: dict[int, asyncio.DatagramTransport] = {}
        self.local: dict[int, Address] = {}
        self.stats: Counter[str] = Counter()

    async def start(self, host: str, port: int, alt_port: int, alt_host: str | None = None) -> None:
        """Bind (host, port), (host, alt_port) and, with alt_host, the same two ports there (0: any)."""
        await self._bind(0, host, port)
        await self._bind(1, host, alt_port)
        if alt_host:
            await self._bind(2, alt_host, self.local[0][1])
            await self._bind(3, alt_host, self.local[1][1])
        log.info("udp_listening", endpoints={i: format_address((h, p)) for i, (h, p) in self.local.items()})

    async def _bind(self, index: int, host: str, port: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            transport, _ = await loop.create_datagram_endpoint(
                lambda: _Endpoint(self, index), local_addr=(host, port)
            )
        except OSError as exc:
            self.close()
            where = format_address((host, port))
            why = f"cannot listen on UDP {where}: {exc.strerror or exc}"
            raise ListenError(exc.errno, why, _UDP_SETTINGS[index]) from exc
        self.transports[index] = transport
        sock = transport.get_extra_info("socket")
        for option in (socket.SO_RCVBUF, socket.SO_SNDBUF):
            sock.setsockopt(socket.SOL_SOCKET, option, SOCKET_BUFFER_BYTES)  # capped by net.core.*mem_max
        sockname = transport.get_extra_info("sockname")
        self.local[index] = (str(sockname[0]), int(sockname[1]))

    def close(self) -> None:
        for transport in self.transports.values():
            transport.close()
        self.transports.clear()

    @property
    def port(self) -> int:
        return self.local[0][1]

    @property
    def alt_port(self) -> int:
        return self.local[1][1]

    # ------------------------------------------------------------ dispatch

    def handle(self, index: int, data: bytes, src: Address) -> None:
        if not data:
            self.stats["empty"] += 1
            return
        if data[0] == udp.MsgType.RELAY_DATA:
            self._relay_data(data, src)
            return
        kind = udp.classify_datagram(data[0])
        if kind not in (DatagramKind.BINDING, DatagramKind.RELAY):
            self.stats[kind.value] += 1  # QUIC, punch probes, unknown: not for the rendezvous
            return
        try:
            msg = udp.decode(data)
        except ProtocolError:
            self.stats["malformed"] += 1
            return
        if isinstance(msg, udp.BindingRequest):
            self.stats["binding"] += 1
            self._binding(index, msg, src)
        elif isinstance(msg, udp.RelayBind):
            self.stats["relay_bind"] += 1
            self._send(index, self.relay.bind(msg, src, index, self.clock()), src)
        else:
            self.stats["unexpected"] += 1

    def _relay_data(self, data: bytes, src: Address) -> None:
        cid = udp.relay_channel(data)
        if cid is None:
            self.stats["malformed"] += 1
            return
        result = self.relay.forward(cid, src, len(data), self.clock())
        if isinstance(result, tuple):
            self.transports[result[1]].sendto(data, result[0])

    def _binding(self, index: int, msg: udp.BindingRequest, src: Address) -> None:
        has_alt_address = 2 in self.transports
        if msg.change_address and not has_alt_address:
            reason = "this rendezvous has one address; it cannot reply from another"
            self._send(index, udp.BindingError(msg.txid, ErrorCode.UNSUPPORTED, reason), src)
            return
        reply_from = index ^ (2 if msg.change_address else 0) ^ (1 if msg.change_port else 0)
        other = self.local[index ^ 3] if has_alt_address else self.local[index ^ 1]
        response = udp.BindingResponse(msg.txid, msg.flags, src, self.local[reply_from], other)
        self._send(reply_from, response, src)

    def _send(self, index: int, msg: udp.UdpMessage, dest: Address) -> None:
        self.transports[index].sendto(udp.encode(msg), dest)
