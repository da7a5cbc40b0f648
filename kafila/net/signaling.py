"""Member-side signaling client: one WebSocket to the rendezvous (asyncio).

    client = await SignalingClient.connect("wss://rv.example:8470/v1/signal", ca_file="ca.pem")
    opened = await client.open_session("smollm2-135m", 3, "laptop", capability)  # host...
    await client.protect(new_code(opened.session))    # ...registers the code's join verifier
    joined = await client.join(parse_code("4-k7m2-tiger-lamp-ocean"), "desktop", capability)  # member
    await client.signal(peer_id, {"kind": "candidates", ...})                     # opaque payload
    await client.remove(member_id, "failed authentication")                       # host only
    relay = await client.request_relay(peer_id)       # RelayAllocated: channel, leg token
    event = await client.next_event()                 # member_joined, signal, member_left, ...
    await client.close()                              # sends leave

A join proves the code's secret part to the rendezvous without sending it: it asks for a nonce
(`join_challenge`) and answers it with an HMAC under `codes.join_key(code, salt)`, which the host
registered with `protect` (docs/rendezvous.md, "Proof of the secret").

Replies to requests are matched by `ref`; everything else (a peer's signal, members coming and
going, a relay channel a peer asked for, errors not tied to a request) arrives through
`next_event()`. Heartbeats are sent in the background every `heartbeat_s` the rendezvous asked
for. Refusals raise `SignalingError(code, message)`; a lost connection raises `SignalingClosed`.
A fatal error (the host removed this member, its code expired, ...) arrives as an `Error` event,
and the `SignalingClosed` that follows names it too.

After a lost connection, `reconnect()` dials the same URL again on the same object and registers
this member again as what it was: the host re-opens its session with the ticket it got after
`protect` (`reopen`), a member takes its place back with the proof of the code (`rejoin`); its
member id stays (docs/rendezvous.md, "Re-registering after a restart"). A refusal raises
`SignalingError` and leaves the client lost, ready for another `reconnect()`.

TLS: `wss://` URLs verify the rendezvous certificate against the system trust store, or against
`ca_file` only, or (`fingerprint`) pin the SHA-256 of its certificate instead of a CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import itertools
import secrets
import socket
import ssl
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from kafila.net.waits import wait_at_most
from kafila.obs.log import get_logger
from kafila.proto import codes
from kafila.proto import signaling as sig
from kafila.proto.codes import SessionCode
from kafila.proto.errors import ProtocolError

log = get_logger("kafila.net.signaling")


_CLOSES = {  # what the rendezvous's WebSocket close code says it did
    1000: "closed the connection",
    1001: "is going away (shutting down)",
    1008: "closed the connection over a policy violation",
    1011: "closed the connection after an internal error",
    1012: "shut down or is restarting",
}


DROPPED = (
    "the connection to the rendezvous dropped with no close from it (its process or the network went away)"
)


def closed_reason(code: int | None, reason: str) -> str:
    """Why the signaling connection ended, for a person: from the close the rendezvous sent, or
    its absence (1006: none came)."""
    if code is None or code == 1006:
        return DROPPED
    said = f": {reason}" if reason else ""
    return f"the rendezvous {_CLOSES.get(code, 'closed the connection')} (WebSocket close {code}{said})"


def unreachable_reason(exc: BaseException, open_timeout: float = 10.0) -> str:
    """Why connecting to the rendezvous failed, for a person."""
    if isinstance(exc, InvalidStatus):
        status = exc.response.status_code
        return (
            f"it answered HTTP {status} where a rendezvous takes the WebSocket (another server, or a proxy?)"
        )
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused: nothing listens on that port"
    if isinstance(exc, socket.gaierror):
        return f"its host name could not be looked up ({exc.strerror or exc})"
    if isinstance(exc, TimeoutError):
        return f"no answer within {open_timeout:g} s (a firewall, or the wrong address?)"
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__


class SignalingError(Exception):
    """The rendezvous refused a request (`code` as in docs/protocol.md)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class SignalingClosed(SignalingError):
    """The connection to the rendezvous is gone."""


def client_ssl_context(ca_file: str | None = None, fingerprint: str | None = None) -> ssl.SSLContext:
    """System trust by default; only `ca_file` when given; no CA check when pinning a fingerprint."""
    if fingerprint is not None:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE  # the certificate is checked against the pin after the handshake
        return ctx
    ctx = ssl.create_default_context(cafile=ca_file) if ca_file else ssl.create_default_context()
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    return ctx


def _normalize_fingerprint(text: str) -> bytes:
    hex_digits = text.replace(":", "").replace(" ", "").lower()
    raw = bytes.fromhex(hex_digits)
    if len(raw) != 32:
        raise ValueError(f"certificate fingerprint has {len(raw)} bytes, expected 32 (SHA-256)")
    return raw


def _whole_code(code: SessionCode | str) -> SessionCode:
    if isinstance(code, SessionCode):
        return code
    try:
        return codes.parse_code(code)
    except ProtocolError as exc:
        raise SignalingError(
            "bad_code",
            f"{exc}; a join proves the code's secret words to the rendezvous, so it needs the whole "
            "code, not only its public part",
        ) from None


@dataclass(frozen=True, slots=True)
class Place:
    """What this client registered as, to register it again after the connection was lost."""

    host: bool
    name: str
    capability: sig.JsonObject
    nat: sig.JsonObject | None = None
    candidates: list[str] = field(default_factory=list)
    model: str = ""  # the host's session
    members_expected: int = 1
    protection: tuple[bytes, bytes] | None = None  # the host's (salt, verifier)
    ticket: bytes | None = None  # the host's re-open ticket
    code: SessionCode | None = None  # a member's whole code (its proof for `rejoin`)


@dataclass(frozen=True, slots=True)
class Dial:
    """How the connection was made, to make it again."""

    url: str
    ca_file: str | None = None
    fingerprint: str | None = None
    open_timeout: float = 10.0


class SignalingClient:
    def __init__(self, ws: ClientConnection, dial: Dial | None = None) -> None:
        self._ws = ws
        self._dial = dial
        self._refs = itertools.count(1)
        self._pending: dict[str, asyncio.Future[sig.ServerMessage]] = {}
        self._events: asyncio.Queue[sig.ServerMessage | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read())
        self._heartbeat: asyncio.Task[None] | None = None
        self._closed: SignalingClosed | None = None
        self._fatal: sig.Error | None = None  # the fatal error the rendezvous closed after, if any
        self.member: int | None = None
        self.session: str | None = None
        self.probe: tuple[int | None, int | None, str | None] = (None, None, None)
        self.rtt_s: float | None = None  # last heartbeat round trip
        self.place: Place | None = None  # what to register again as after a lost connection
        self.highest_member = 0  # the highest member id heard of: a re-opened session keeps ids below
        self.relay_legs: dict[int, sig.RelayAllocated] = {}  # by peer: named when registering again
        self.outlives_restart: bool | None = None  # the host's session, per its ticket (None: no ticket)
        self._key: tuple[SessionCode, bytes, bytes] | None = None  # (code, salt, join key): scrypt once

    @classmethod
    async def connect(
        cls,
        url: str,
        *,
        ca_file: str | None = None,
        fingerprint: str | None = None,
        open_timeout: float = 10.0,
    ) -> SignalingClient:
        dial = Dial(url, ca_file, fingerprint, open_timeout)
        return cls(await cls._open(dial), dial)

    @classmethod
    async def _open(cls, dial: Dial) -> ClientConnection:
        url, fingerprint = dial.url, dial.fingerprint
        ctx = client_ssl_context(dial.ca_file, fingerprint) if url.startswith("wss://") else None
        pin = _normalize_fingerprint(fingerprint) if fingerprint is not None else None
        ws = await connect(
            url,
            ssl=ctx,
            open_timeout=dial.open_timeout,
            max_size=sig.MAX_SERVER_MESSAGE_BYTES,
            compression=None,
            proxy=None,
        )
        if pin is not None:
            await cls._check_pin(ws, pin, url)
        return ws

    @staticmethod
    async def _check_pin(ws: ClientConnection, pin: bytes, url: str) -> None:
        ssl_object = ws.transport.get_extra_info("ssl_object")
        der = ssl_object.getpeercert(binary_form=True) if ssl_object else None
        seen = hashlib.sha256(der or b"").digest()
        if der is None or not hmac.compare_digest(seen, pin):
            await ws.close(1008, "certificate fingerprint mismatch")
            raise SignalingError(
                "bad_certificate",
                f"{url}: certificate SHA-256 {seen.hex()} does not match the pinned {pin.hex()}",
            )

    # ------------------------------------------------------------ requests

    async def open_session(
        self,
        model: str,
        members_expected: int,
        name: str,
        capability: sig.JsonObject,
        nat: sig.JsonObject | None = None,
        candidates: Sequence[str] = (),
        timeout: float = 10.0,
    ) -> sig.Opened:
        ref = self._ref()
        msg = sig.Open(model, members_expected, name, capability, nat, list(candidates), ref)
        opened = await self._request(msg, ref, sig.Opened, timeout)
        self._entered(opened.session, opened.member, opened.heartbeat_s)
        self.probe = (opened.probe_port, opened.probe_alt_port, opened.probe_alt_host)
        self.place = Place(True, name, capability, nat, list(candidates), model, members_expected)
        return opened

    async def protect(self, code: SessionCode, timeout: float = 10.0) -> None:
        """Host, right after `open_session`: register the join verifier of `code` (its secret part
        never leaves this machine); the session takes joins from then on. Then it asks for the
        session's re-open ticket, kept for `reconnect()` (a rendezvous without tickets: none)."""
        salt = secrets.token_bytes(codes.JOIN_SALT_BYTES)
        key = await asyncio.to_thread(codes.join_key, code, salt)  # scrypt: about 50 ms of CPU
        ref = self._ref()
        await self._request(sig.Protect(salt.hex(), key.hex(), ref), ref, sig.Protected, timeout)
        ticket = await self._ticket(timeout)
        if self.place is not None:
            self.place = replace(self.place, protection=(salt, key), ticket=ticket)

    async def _ticket(self, timeout: float) -> bytes | None:
        """The host's re-open ticket for its session (None: a rendezvous without tickets)."""
        try:
            ref = self._ref()
            got = await self._request(sig.TicketRequest(ref), ref, sig.Ticket, timeout)
            self.outlives_restart = got.kept
            return bytes.fromhex(got.ticket)
        except (SignalingError, ValueError) as exc:
            if isinstance(exc, SignalingClosed):
                raise
            log.warning("no_reopen_ticket", error=str(exc))  # this session will not outlive a restart
            return None

    async def join(
        self,
        code: SessionCode | str,
        name: str,
        capability: sig.JsonObject,
        nat: sig.JsonObject | None = None,
        candidates: Sequence[str] = (),
        timeout: float = 10.0,
    ) -> sig.Joined:
        """Join the session of `code` (a SessionCode, or the whole code as typed), proving its secret
        part. A wrong secret is refused `wrong_secret`; repeated wrong ones are held back."""
        code = _whole_code(code)
        ref = self._ref()
        challenge = await self._request(sig.JoinChallenge(code.public, ref), ref, sig.Challenge, timeout)
        proof = await self._proof(code, challenge)
        ref = self._ref()
        msg = sig.Join(code.public, proof, name, capability, nat, list(candidates), ref)
        joined = await self._request(msg, ref, sig.Joined, timeout)
        self._joined(joined)
        self.place = Place(False, name, capability, nat, list(candidates), code=code)
        return joined

    async def _proof(self, code: SessionCode, challenge: sig.Challenge) -> str:
        """The proof of `code` over `challenge`'s nonce (hex); the key is derived once per salt."""
        salt = bytes.fromhex(challenge.salt)
        found = self._key
        if found is None or found[:2] != (code, salt):
            found = self._key = (code, salt, await asyncio.to_thread(codes.join_key, code, salt))  # ~50 ms
        return codes.join_proof(found[2], challenge.session, bytes.fromhex(challenge.nonce)).hex()

    def _joined(self, joined: sig.Joined) -> None:
        self._entered(joined.session, joined.member, joined.heartbeat_s)
        self.probe = (joined.probe_port, joined.probe_alt_port, joined.probe_alt_host)
        self.highest_member = max([self.highest_member, *(m.id for m in joined.members)])

    async def succeed(self, code: SessionCode, timeout: float = 10.0) -> sig.Joined:
        """A member whose session lost its host: take the host's place at the rendezvous, proving
        the code as a join does (refused `member_present` while the host is still connected).
        From then on this client registers again as the host would (`reconnect` re-opens the
        session: it asks for the session's ticket as `protect` does)."""
        ref = self._ref()
        ask = sig.SucceedChallenge(code.public, ref)
        challenge = await self._request(ask, ref, sig.Challenge, timeout)
        proof = await self._proof(code, challenge)
        ref = self._ref()
        joined: sig.Joined = await self._request(
            sig.Succeed(code.public, proof, ref), ref, sig.Joined, timeout
        )
        self._joined(joined)
        assert self._key is not None  # derived for the proof
        ticket = await self._ticket(timeout)
        if self.place is not None:
            self.place = replace(
                self.place,
                host=True,
                model=joined.model,
                members_expected=joined.members_expected,
                protection=(self._key[1], self._key[2]),
                ticket=ticket,
            )
        return joined

    # ------------------------------------------------------------ after a lost connection

    async def reconnect(self, timeout: float = 10.0) -> None:
        """Once the connection is lost: connect to the same URL again and register as before (the
        host re-opens its session, a member takes its place back). Connection failures raise as
        `connect` does; a refusal raises SignalingError, and the client stays lost."""
        if self._closed is None:
            raise RuntimeError("the signaling connection is not lost: nothing to reconnect")
        if self._dial is None or self.place is None or self.session is None or self.member is None:
            raise SignalingError("not_registered", "this client never opened or joined a session")
        place = self.place
        if place.host and (place.protection is None or place.ticket is None):
            raise SignalingError(
                "no_ticket",
                f"the rendezvous gave no re-open ticket for session {self.session} (a version "
                "without them), so it cannot take the session back",
            )
        ws = await self._open(self._dial)
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        self._ws, self._heartbeat, self._closed, self._fatal = ws, None, None, None
        self._events = asyncio.Queue()  # the old connection's end is not this one's
        self._reader = asyncio.create_task(self._read())
        try:
            await (self._reopen(place, timeout) if place.host else self._rejoin(place, timeout))
        except BaseException:
            await self._ws.close()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            raise

    async def _reopen(self, place: Place, timeout: float) -> None:
        assert place.protection is not None and place.ticket is not None and self.session and self.member
        salt, key = place.protection
        ref = self._ref()
        msg = sig.Reopen(
            self.session,
            place.ticket.hex(),
            salt.hex(),
            key.hex(),
            self.member,
            max(self.highest_member, self.member) + 1,
            place.model,
            place.members_expected,
            place.name,
            place.capability,
            place.nat,
            list(place.candidates),
            self._relay_claims(),
            ref,
        )
        opened = await self._request(msg, ref, sig.Opened, timeout)
        self._entered(opened.session, opened.member, opened.heartbeat_s)

    def _relay_claims(self) -> list[str]:
        """The relay legs this member holds, for the restarted relay to learn whose they are."""
        legs = list(self.relay_legs.values())[: sig.MAX_RELAY_CLAIMS]
        return [sig.relay_leg_claim(g.channel, g.leg, g.peer, g.token) for g in legs]

    async def _rejoin(self, place: Place, timeout: float) -> None:
        assert place.code is not None and self.session is not None and self.member is not None
        ref = self._ref()
        ask = sig.RejoinChallenge(self.session, self.member, ref)
        challenge = await self._request(ask, ref, sig.Challenge, timeout)
        proof = await self._proof(place.code, challenge)
        ref = self._ref()
        msg = sig.Rejoin(
            self.session,
            proof,
            self.member,
            place.name,
            place.capability,
            place.nat,
            list(place.candidates),
            self._relay_claims(),
            ref,
        )
        self._joined(await self._request(msg, ref, sig.Joined, timeout))

    async def update(
        self,
        capability: sig.JsonObject | None = None,
        nat: sig.JsonObject | None = None,
        candidates: Sequence[str] | None = None,
    ) -> None:
        await self._send(sig.Update(capability, nat, None if candidates is None else list(candidates)))
        if self.place is not None:
            self.place = replace(
                self.place,
                capability=self.place.capability if capability is None else capability,
                nat=self.place.nat if nat is None else nat,
                candidates=self.place.candidates if candidates is None else list(candidates),
            )

    async def signal(self, to: int, payload: sig.JsonObject) -> None:
        await self._send(sig.Signal(to, payload))

    async def remove(self, member: int, reason: str) -> None:
        """Host only: take `member` out of the session (no reply; a refusal comes as an Error event).
        A `reason` longer than the wire takes (200 characters) is cut there."""
        await self._send(sig.Remove(member, reason if len(reason) <= 200 else reason[:199] + "…"))

    async def request_relay(self, peer: int, timeout: float = 10.0) -> sig.RelayAllocated:
        ref = self._ref()
        return await self._request(sig.RelayRequest(peer, ref), ref, sig.RelayAllocated, timeout)

    async def heartbeat(self, timeout: float = 10.0) -> float:
        """Send a heartbeat; returns its round trip in seconds."""
        ref = self._ref()
        start = time.monotonic()
        await self._request(sig.Heartbeat(ref), ref, sig.HeartbeatAck, timeout)
        self.rtt_s = time.monotonic() - start
        return self.rtt_s

    async def next_event(self, timeout: float | None = None) -> sig.ServerMessage:
        """The next unsolicited message; raises SignalingClosed once the connection is gone."""
        events = self._events  # a reconnect gives the next connection a queue of its own
        item = await wait_at_most(events.get(), timeout)
        if item is None:
            events.put_nowait(None)  # keep raising for later callers
            raise self._closed or SignalingClosed("closed", "connection closed")
        return item

    async def lost(self) -> SignalingClosed:
        """Wait until the connection is gone (the rendezvous closed it, or it broke); returns why."""
        await asyncio.shield(self._reader)
        assert self._closed is not None
        return self._closed

    async def close(self, reason: str | None = None) -> None:
        """Leave the session (if in one) and close the connection."""
        if self._closed is None and self.session is not None:
            with contextlib.suppress(ConnectionClosed, SignalingError):
                await self._send(sig.Leave(reason))
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        await self._ws.close()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def __aenter__(self) -> SignalingClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ internals

    def _ref(self) -> str:
        return f"r{next(self._refs)}"

    def _entered(self, session: str, member: int, heartbeat_s: float) -> None:
        self.session, self.member = session, member
        if self._heartbeat is None and heartbeat_s > 0:
            self._heartbeat = asyncio.create_task(self._beat(heartbeat_s))

    async def _send(self, msg: sig.ClientMessage) -> None:
        if self._closed is not None:
            raise self._closed
        try:
            await self._ws.send(sig.encode(msg))
        except ConnectionClosed as exc:
            raise SignalingClosed("closed", f"connection to the rendezvous closed: {exc}") from exc

    async def _request(self, msg: sig.ClientMessage, ref: str, want: type[Any], timeout: float) -> Any:
        future: asyncio.Future[sig.ServerMessage] = asyncio.get_running_loop().create_future()
        self._pending[ref] = future
        try:
            await self._send(msg)
            reply = await wait_at_most(future, timeout)
        finally:
            self._pending.pop(ref, None)
            if future.done() and not future.cancelled():
                # the connection was lost while the request was being sent: `_read` failed the future,
                # and the send raised that loss itself; retrieve it, or asyncio reports it at exit
                future.exception()
        if isinstance(reply, sig.Error):
            raise SignalingError(reply.code, reply.message)
        if not isinstance(reply, want):
            raise SignalingError("bad_message", f"expected {want.TYPE} for {msg.TYPE}, got {reply.TYPE}")
        return reply

    async def _beat(self, period: float) -> None:
        while True:
            await asyncio.sleep(period)
            try:
                await self.heartbeat(timeout=period * 2)
            except TimeoutError:
                log.warning("heartbeat_failed", error=f"no heartbeat_ack within {period * 2:.1f} s")
            except SignalingError as exc:
                log.warning("heartbeat_failed", error=str(exc))
                if isinstance(exc, SignalingClosed):
                    return

    async def _read(self) -> None:
        try:
            async for frame in self._ws:
                self._dispatch(frame)
            reason = closed_reason(self._ws.close_code, self._ws.close_reason or "")
        except ConnectionClosed as exc:
            reason = closed_reason(*((exc.rcvd.code, exc.rcvd.reason) if exc.rcvd else (None, "")))
        if self._fatal is not None:  # the rendezvous said why before it closed: that is the reason
            reason = f"{self._fatal.message} (the rendezvous closed the connection)"
        self._closed = SignalingClosed("closed", reason)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(self._closed)
        self._events.put_nowait(None)

    def _heard_of(self, msg: sig.ServerMessage) -> None:
        """Keep the highest member id of the session heard of (a re-opened session keeps the ids)."""
        match msg:
            case sig.MemberJoined(info) | sig.MemberUpdated(info):
                seen = info.id
            case sig.MemberLeft(member, _):
                seen = member
                self.relay_legs.pop(member, None)
            case sig.SignalFrom(member, _):
                seen = member
            case sig.RelayAllocated():
                seen = msg.peer
                self.relay_legs[msg.peer] = msg
            case _:
                return
        self.highest_member = max(self.highest_member, seen)

    def _dispatch(self, frame: str | bytes) -> None:
        try:
            msg = sig.decode_server(frame)
        except ProtocolError as exc:
            log.warning("bad_frame_from_rendezvous", error=str(exc))
            return
        if isinstance(msg, sig.Error) and msg.fatal:
            self._fatal = msg
        self._heard_of(msg)
        ref = getattr(msg, "ref", None)
        future = self._pending.get(ref) if ref is not None else None
        if future is not None and not future.done():
            future.set_result(msg)
        else:
            self._events.put_nowait(msg)
