"""Coordinated UDP hole punching for one edge (asyncio shell around a small amount of state).

Both members send PunchProbes to every candidate address of the other (local and server-reflexive,
exchanged through signaling) every `interval` seconds. A probe carries an authenticator: an HMAC,
under a key made of both sides' random per-edge nonces (signaled, so it keeps third parties out,
not the rendezvous; the session secret is never used here so nothing on the wire helps guess it),
over the transaction id and the sender's role. A valid probe is answered with a PunchAck to its
source address and that address is learnt as a peer-reflexive candidate (a symmetric NAT shows a
new port to every destination, so this is how its real mapping is found). A valid ack to one of
our probes proves the path both ways: `run()` returns the address it came from.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import os
from collections.abc import Callable

from kafila.net.endpoint import Address, UdpEndpoint
from kafila.net.waits import wait_at_most
from kafila.obs.log import get_logger
from kafila.proto import udp

log = get_logger("kafila.net.punch")
AUTH_BYTES = 16


def punch_key(client_nonce: bytes, server_nonce: bytes, edge: str) -> bytes:
    return hashlib.sha256(b"kafila-punch-v1\x00" + edge.encode() + client_nonce + server_nonce).digest()


class Puncher:
    def __init__(
        self,
        endpoint: UdpEndpoint,
        key: bytes,
        role: str,  # "client" or "server": whose probes these are
        candidates: list[Address],
        on_peer_address: Callable[[Address], None],
        interval: float = 0.05,
    ) -> None:
        self.endpoint = endpoint
        self.key = key
        self.role = role.encode()
        self.peer_role = b"server" if role == "client" else b"client"
        self.targets: list[Address] = list(dict.fromkeys(candidates))
        self.on_peer_address = on_peer_address
        self.interval = interval
        self.probes_sent = 0
        self._mine: set[bytes] = set()
        self._seen_peer: set[Address] = set()
        self._success: asyncio.Future[Address] = asyncio.get_running_loop().create_future()
        endpoint.add_punch_sink(self.on_message)

    def _auth(self, what: bytes, role: bytes, txid: bytes) -> bytes:
        return hmac.new(self.key, what + role + txid, hashlib.sha256).digest()[:AUTH_BYTES]

    def on_message(self, msg: udp.PunchProbe | udp.PunchAck, src: Address) -> None:
        if isinstance(msg, udp.PunchProbe):
            if not hmac.compare_digest(msg.auth, self._auth(b"probe", self.peer_role, msg.txid)):
                return  # another edge's probe, or junk
            self._learn(src)
            ack = udp.PunchAck(msg.txid, src, self._auth(b"ack", self.role, msg.txid))
            self.endpoint.send_control(ack, src)
        elif msg.txid in self._mine and hmac.compare_digest(
            msg.auth, self._auth(b"ack", self.peer_role, msg.txid)
        ):
            self._learn(src)
            if not self._success.done():
                self._success.set_result(src)

    def _learn(self, src: Address) -> None:
        if src not in self._seen_peer:
            self._seen_peer.add(src)
            self.on_peer_address(src)
        if src not in self.targets:
            self.targets.append(src)  # peer-reflexive

    def probe_once(self) -> None:
        """One probe to every target, now."""
        for target in list(self.targets):
            txid = os.urandom(udp.TXID_BYTES)
            self._mine.add(txid)
            self.endpoint.send_control(udp.PunchProbe(txid, self._auth(b"probe", self.role, txid)), target)
            self.probes_sent += 1

    @property
    def succeeded(self) -> Address | None:
        return self._success.result() if self._success.done() else None

    async def run(self, timeout: float) -> Address | None:
        """Probe until an ack proves a path (its address) or `timeout` passes (None)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not self._success.done() and loop.time() < deadline:
            self.probe_once()
            with contextlib.suppress(TimeoutError):
                await wait_at_most(asyncio.shield(self._success), self.interval)
        return self.succeeded

    def reset(self) -> None:
        """Forget the last success so `run()` can prove the path again (after a fallback)."""
        self._mine.clear()
        if self._success.done():
            self._success = asyncio.get_running_loop().create_future()

    def stop(self) -> None:
        self.endpoint.forget(self.on_message)
