"""Mutual authentication of a link, bound to the session code's secret (pure: no I/O, no clock).

TLS 1.3 inside QUIC encrypts every edge end to end, but both certificates are fresh and self-signed,
so TLS alone would let a rendezvous that rewrites signaling sit in the middle. Inside the
established connection both sides therefore run SPAKE2 (a PAKE) on the session secret, which the
rendezvous never sees, then exchange key-confirmation MACs over a transcript that binds:
the session id, the edge (client and server member ids), the server certificate's fingerprint as
each side sees it (the client: the certificate TLS presented; the server: its own), and both SPAKE2
messages. A man in the middle terminates TLS with its own certificate, so the client's view of the
server fingerprint differs from the server's and the MACs cannot match unless it knows the secret;
a rendezvous that swaps member identities changes the SPAKE2 identities and the MACs fail too.
SPAKE2 gives an active attacker one password guess per attempt and nothing to guess offline.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from spake2 import SPAKE2_A, SPAKE2_B

from kafila.net.errors import LinkAuthError

PROTOCOL_LABEL = b"kafila-link-v1"


@dataclass(frozen=True)
class EdgeContext:
    """Who is on each end of one ring edge, and the secret both must know."""

    session: str  # the session's public id
    client_id: str  # member id of the side that opens the QUIC connection
    server_id: str  # member id of the side that accepts it
    secret: bytes  # the secret part of the session code (never sent anywhere)


def _password(ctx: EdgeContext) -> bytes:
    return PROTOCOL_LABEL + b"\x00" + ctx.session.encode() + b"\x00" + ctx.secret


class LinkAuth:
    """One side's authentication state: hello() -> peer hello -> confirm() -> verify(peer confirm)."""

    def __init__(self, ctx: EdgeContext, is_client: bool, server_fingerprint: bytes) -> None:
        self.ctx = ctx
        self.is_client = is_client
        self.server_fingerprint = server_fingerprint
        ids = {"idA": ctx.client_id.encode(), "idB": ctx.server_id.encode()}
        self._spake = (SPAKE2_A if is_client else SPAKE2_B)(_password(ctx), **ids)
        self._mine = self._spake.start()
        self._key: bytes | None = None
        self._transcript = b""

    def hello(self) -> bytes:
        return self._mine

    def on_peer_hello(self, peer: bytes) -> None:
        try:
            self._key = self._spake.finish(peer)
        except Exception as exc:  # any malformed or hostile message fails closed
            raise LinkAuthError(f"edge {self._edge()}: malformed SPAKE2 message ({exc})") from exc
        msg_a, msg_b = (self._mine, peer) if self.is_client else (peer, self._mine)
        parts = [PROTOCOL_LABEL, self.ctx.session.encode(), self.ctx.client_id.encode()]
        parts += [self.ctx.server_id.encode(), self.server_fingerprint, msg_a, msg_b]
        self._transcript = b"".join(len(p).to_bytes(2, "big") + p for p in parts)

    def confirm(self) -> bytes:
        return self._mac(b"client" if self.is_client else b"server")

    def verify(self, peer_confirm: bytes) -> None:
        expected = self._mac(b"server" if self.is_client else b"client")
        if not hmac.compare_digest(expected, peer_confirm):
            raise LinkAuthError(
                f"edge {self._edge()}: the peer did not prove the session secret for this edge "
                "(wrong code, swapped identities, or a man in the middle); link closed"
            )

    def _mac(self, role: bytes) -> bytes:
        if self._key is None:
            raise LinkAuthError(f"edge {self._edge()}: confirmation before the peer's SPAKE2 message")
        return hmac.new(self._key, b"confirm " + role + self._transcript, hashlib.sha256).digest()

    def _edge(self) -> str:
        return f"{self.ctx.client_id}->{self.ctx.server_id}"
