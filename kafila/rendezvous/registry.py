"""The rendezvous's pure session core: sessions, members, presence, codes, join limits.

No sockets and no clock. The WebSocket shell calls `connect`, `receive`, `bad_frame`,
`disconnect` and (about once a second) `tick`, each with `now`, and carries out the events
returned: `Send` a message to a connection, `Close` a connection, `Note` something that happened
(for the log). Counters for /metrics live here too (`joins`, `left`, `sessions`, `members`).

Presence: any frame refreshes a member; `heartbeat_timeout_s` of silence times it out. A session
dissolves when its last member is gone. While it forms, its code accepts joins up to
`members_expected` members and for `code_ttl_s` after the last open/join; a session still alone with
its host when the code expires is dissolved (the host gets a fatal `code_expired`). Once it has
formed (it held `members_expected` members at once, or was re-opened after a restart) it takes
joins for as long as it lives, up to the per-session limit: a member that was lost coming back, or
a new one; its host decides whether to plan them in. The host may `remove` another member
(one that failed to authenticate): it leaves as "removed", gets a fatal `removed`, and its place
frees up for another join.

Joins prove the code's secret part (docs/rendezvous.md, "Proof of the secret"): the host registers
the session's verifier (`protect`); a joiner asks for a nonce (`join_challenge`), and its `join`
carries an HMAC of that nonce under the verifier. Until a join proves it, it takes no place, learns
nothing about the session's members and counts against no budget of theirs; a wrong proof is
counted against the address's back-off and the session's and the rendezvous's failed-proof budgets,
which an address that never failed is not held to.

After a restart (docs/rendezvous.md, "Re-registering after a restart"): the host asks once for its
session's ticket (`ticket_request`), a MAC of the code's public part, salt and verifier under the
rendezvous's kept secret; a rendezvous that restarted with that secret takes a `reopen` carrying
them back as the same session, and the session's members then `rejoin` their own places (ids kept)
with the same proof of the code as a join, held to the same limits.
"""

from __future__ import annotations

import dataclasses
import hmac
import ipaddress
import math
import secrets
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from kafila.proto import codes, signaling
from kafila.proto import signaling as sig
from kafila.proto.errors import ProtocolError
from kafila.rendezvous.limits import Limits
from kafila.rendezvous.ratelimit import Backoff, TokenBuckets
from kafila.rendezvous.relay import RelayLimitError, RelayTable
from kafila.rendezvous.ticket import make_ticket, ticket_key, ticket_ok

ConnId = int
SUCCEED = "succeed"  # a challenge's purpose: a member takes the place of its session's lost host


def refusal(outcome: str, message: str, ref: str | None) -> tuple[str, sig.Error]:
    """A refused join, rejoin or challenge: its outcome (what metrics count) and the error sent."""
    return outcome, sig.Error(outcome, message, ref=ref)


@dataclass(frozen=True, slots=True)
class Send:
    conn: ConnId
    message: sig.ServerMessage
    version: int = sig.VERSION  # an older one only for the error answering a member of that version


@dataclass(frozen=True, slots=True)
class Close:
    conn: ConnId
    code: int  # WebSocket close code
    reason: str


@dataclass(frozen=True, slots=True)
class Note:
    event: str
    fields: dict[str, Any]


Event = Send | Close | Note


@dataclass(slots=True)
class ProbeInfo:
    """UDP endpoints advertised in opened/joined (None when the shell runs without UDP)."""

    port: int | None = None
    alt_port: int | None = None
    alt_host: str | None = None


@dataclass(slots=True)
class Member:
    id: int
    conn: ConnId
    info: sig.MemberInfo


@dataclass(slots=True)
class Session:
    code: str
    model: str
    members_expected: int
    code_deadline: float
    members: dict[int, Member] = field(default_factory=dict)
    next_id: int = 1
    joins: int = 0  # successful joins (the host's open excluded)
    salt: bytes | None = None  # the join verifier's salt and the verifier, once the host sent them
    verifier: bytes | None = None
    reopened: bool = False  # registered again after a restart: its members come back with `rejoin`
    formed: bool = False  # held `members_expected` members at once, or re-opened: joins while it lives


@dataclass(slots=True)
class Conn:
    id: ConnId
    source: str
    last_seen: float
    session: str | None = None
    member: int | None = None
    bad_frames: int = 0
    idle_since: float | None = None  # when it was last without a session (None: in one)
    # (session, nonce, expiry, purpose) of its next join: None a join, a member id the place a
    # `rejoin` takes back, SUCCEED the host's place a member of the session takes
    challenge: tuple[str, bytes, float, int | str | None] | None = None


class Registry:
    def __init__(
        self,
        limits: Limits,
        relay: RelayTable | None = None,
        probe: ProbeInfo | None = None,
        rand_below: Callable[[int], int] = secrets.randbelow,
        kept_secret: bytes | None = None,
    ) -> None:
        """`kept_secret`: the secret this rendezvous keeps across restarts (its relay secret file),
        which signs re-open tickets; None: a new one each start, so no ticket outlives a restart."""
        self.limits = limits
        self._ticket_key = ticket_key(kept_secret or secrets.token_bytes(32))
        self.secret_kept = kept_secret is not None
        self.relay = relay if relay is not None else RelayTable(limits)
        self.probe = probe or ProbeInfo()
        self._rand_below = rand_below
        self.sessions: dict[str, Session] = {}
        self.conns: dict[ConnId, Conn] = {}
        self.joins: Counter[str] = Counter()  # outcome -> count
        self.left: Counter[str] = Counter()  # members gone from sessions: reason -> count
        self._join_by_addr = TokenBuckets(limits.join_rate_per_address, limits.join_burst_per_address)
        self._failed_by_session = TokenBuckets(
            limits.failed_proof_rate_per_session, limits.failed_proof_burst_per_session
        )
        self._failed_all = TokenBuckets(limits.failed_proof_rate, limits.failed_proof_burst)
        self._backoff = Backoff(
            limits.failed_proof_backoff_s, limits.failed_proof_backoff_max_s, limits.failed_proof_memory_s
        )
        self._open_by_addr = TokenBuckets(limits.open_rate_per_address, limits.open_burst_per_address)

    @property
    def member_count(self) -> int:
        return sum(len(s.members) for s in self.sessions.values())

    # ------------------------------------------------------------ connections

    def connect(self, conn: ConnId, source: str, now: float) -> list[Event]:
        lim = self.limits
        if len(self.conns) >= lim.max_connections:
            msg = f"rendezvous has {len(self.conns)} connections, the limit is {lim.max_connections}"
            return [
                Send(conn, sig.Error("limit", msg, fatal=True)),
                Close(conn, 1013, "too many connections"),
            ]
        same, cap = sum(c.source == source for c in self.conns.values()), lim.max_connections_per_address
        if same >= cap:
            msg = f"{same} connections from {source}, the limit per address is {cap}"
            return [
                Send(conn, sig.Error("limit", msg, fatal=True)),
                Close(conn, 1013, "too many connections from this address"),
                Note("connection_refused", {"source": source, "connections": same}),
            ]
        self.conns[conn] = Conn(conn, source, now, idle_since=now)
        return []

    def disconnect(self, conn: ConnId, now: float) -> list[Event]:
        """The socket closed (cleanly or not); a member still in a session is gone."""
        state = self.conns.pop(conn, None)
        if state is None or state.session is None:
            return []
        return self._remove_member(state, "disconnected", now)

    def bad_frame(self, conn: ConnId, error: ProtocolError, now: float) -> list[Event]:
        state = self.conns.get(conn)
        if state is None:
            return []
        state.last_seen = now
        state.bad_frames += 1
        # a member of another version cannot go on: told once, in its own envelope where it can be
        old = error.version if error.version in sig.OLD_VERSIONS else None
        fatal = state.bad_frames >= self.limits.max_bad_frames or error.code == "unsupported_version"
        out: list[Event] = [
            Send(conn, sig.Error(error.code, str(error), fatal=fatal, ref=error.ref), old or sig.VERSION),
            Note(
                "bad_frame", {"conn": conn, "source": state.source, "code": error.code, "error": str(error)}
            ),
        ]
        if error.code == "unsupported_version":
            out.append(Close(conn, 1002, "signaling protocol version not supported"))
        elif fatal:
            out.append(Close(conn, 1008, f"{state.bad_frames} malformed messages in a row"))
        return out

    def receive(self, conn: ConnId, msg: sig.ClientMessage, now: float) -> list[Event]:
        state = self.conns.get(conn)
        if state is None:
            return []
        state.last_seen = now
        state.bad_frames = 0
        match msg:
            case sig.Open():
                return self._open(state, msg, now)
            case sig.JoinChallenge():
                return self._challenge(state, msg, now)
            case sig.Join():
                return self._join(state, msg, now)
            case sig.Reopen():
                return self._reopen(state, msg, now)
            case sig.RejoinChallenge():
                return self._rejoin_challenge(state, msg, now)
            case sig.Rejoin():
                return self._rejoin(state, msg, now)
            case sig.Heartbeat(ref):
                return [Send(conn, sig.HeartbeatAck(ref))]
        if state.session is None:
            return [Send(conn, sig.Error("not_in_session", f"'{msg.TYPE}' needs an open or join first"))]
        match msg:
            case sig.Update():
                return self._update(state, msg)
            case sig.Signal(to, payload):
                return self._signal(state, to, payload)
            case sig.RelayRequest(peer, ref):
                return self._relay(state, peer, ref, now)
            case sig.Leave():
                return [*self._remove_member(state, "left", now), Close(conn, 1000, "left")]
            case sig.Remove(target, reason):
                return self._remove_by_host(state, target, reason, now)
            case sig.Protect():
                return self._protect(state, msg)
            case sig.TicketRequest(ref):
                return self._ticket(state, ref)
            case sig.SucceedChallenge():
                return self._succeed_challenge(state, msg, now)
            case sig.Succeed():
                return self._succeed(state, msg, now)
        raise AssertionError(f"unhandled message {msg!r}")  # pragma: no cover

    # ------------------------------------------------------------ open / join

    def _open(self, state: Conn, msg: sig.Open, now: float) -> list[Event]:
        refusal = self._refuse_open(state, msg, now)
        if refusal is not None:
            return [Send(state.id, refusal)]
        code = self._fresh_code()
        session = Session(code, msg.model, msg.members_expected, now + self.limits.code_ttl_s)
        self.sessions[code] = session
        member = self._add_member(session, state, msg, host=True)
        opened = self._opened(code, member, self.limits.code_ttl_s, msg.ref)
        fields = {
            "session": code,
            "model": msg.model,
            "expected": msg.members_expected,
            "source": state.source,
        }
        return [Send(state.id, opened), Note("session_opened", fields)]

    def _opened(self, code: str, member: Member, expires_in: float, ref: str | None) -> sig.Opened:
        return sig.Opened(
            session=code,
            member=member.id,
            expires_in=expires_in,
            heartbeat_s=self.limits.heartbeat_s,
            probe_port=self.probe.port,
            probe_alt_port=self.probe.alt_port,
            probe_alt_host=self.probe.alt_host,
            ref=ref,
        )

    def _refuse_open(self, state: Conn, msg: sig.Open | sig.Reopen, now: float) -> sig.Error | None:
        lim = self.limits
        if state.session is not None:
            return sig.Error(
                "already_in_session", f"this connection is already in session {state.session}", ref=msg.ref
            )
        if len(self.sessions) >= lim.max_sessions:
            return sig.Error(
                "limit",
                f"rendezvous has {len(self.sessions)} sessions, the limit is {lim.max_sessions}",
                ref=msg.ref,
            )
        if msg.members_expected > lim.max_members:
            text = f"session expects {msg.members_expected} members, the limit is {lim.max_members}"
            return sig.Error("limit", text, ref=msg.ref)
        if not self._open_by_addr.take(state.source, now):
            wait = self._open_by_addr.retry_after(state.source, now)
            return sig.Error(
                "rate_limited",
                f"too many sessions opened from {state.source}; retry in {wait:.0f} s",
                ref=msg.ref,
            )
        return None

    def _fresh_code(self) -> str:
        while True:
            code = codes.new_public(self._rand_below)
            if code not in self.sessions:
                return code

    def _join(self, state: Conn, msg: sig.Join, now: float) -> list[Event]:
        outcome, result = self._try_join(state, msg, now)
        self.joins[outcome] += 1
        note = Note("join", {"outcome": outcome, "source": state.source, "session": msg.session})
        if isinstance(result, sig.Error):
            return [Send(state.id, result), note]
        session, member = result
        return [
            Send(state.id, self._joined(session, member, msg.ref)),
            note,
            *self._tell(session, member, True),
        ]

    def _joined(self, session: Session, member: Member, ref: str | None) -> sig.Joined:
        return sig.Joined(
            session=session.code,
            member=member.id,
            model=session.model,
            members_expected=session.members_expected,
            members=[m.info for m in session.members.values()],
            heartbeat_s=self.limits.heartbeat_s,
            probe_port=self.probe.port,
            probe_alt_port=self.probe.alt_port,
            probe_alt_host=self.probe.alt_host,
            ref=ref,
        )

    def _tell(self, session: Session, member: Member, new: bool) -> list[Event]:
        """The others hear of `member`: a new one (`member_joined`), or one back (`member_updated`)."""
        told = sig.MemberJoined(member.info) if new else sig.MemberUpdated(member.info)
        return [Send(m.conn, told) for m in session.members.values() if m is not member]

    def _protect(self, state: Conn, msg: sig.Protect) -> list[Event]:
        session, member = self._member(state)

        def err(code: str, text: str) -> list[Event]:
            return [Send(state.id, sig.Error(code, text, ref=msg.ref))]

        if not member.info.host:
            return err("not_host", f"only the host of session {session.code} registers its verifier")
        if session.verifier is not None:
            return err("already_protected", f"session {session.code}'s verifier is already registered")
        try:
            salt, verifier = bytes.fromhex(msg.salt), bytes.fromhex(msg.verifier)
        except ValueError:
            return err("bad_message", "protect: 'salt' and 'verifier' must be hex")
        if len(salt) < codes.JOIN_SALT_BYTES or len(verifier) != codes.JOIN_KEY_BYTES:
            return err(
                "bad_message",
                f"protect: a salt of at least {codes.JOIN_SALT_BYTES} bytes and a verifier of "
                f"{codes.JOIN_KEY_BYTES} bytes, got {len(salt)} and {len(verifier)}",
            )
        session.salt, session.verifier = salt, verifier
        return [Send(state.id, sig.Protected(session.code, msg.ref))]

    def _challenge(self, state: Conn, msg: sig.JoinChallenge, now: float) -> list[Event]:
        """A nonce for one join, once the code names a live session that takes joins; the answer
        carries the session's salt and nothing about its members."""
        found = self._joinable(state, msg.session, msg.ref, now)
        return self._give_challenge(state, found, "join", msg.session, msg.ref, None, now)

    def _give_challenge(
        self,
        state: Conn,
        found: tuple[str, sig.Error | Session],
        kind: str,
        text: str,
        ref: str | None,
        member: int | str | None,
        now: float,
    ) -> list[Event]:
        """A nonce for one `kind` ("join", "rejoin" of `member`, or "succeed") on the session
        found, or the refusal (counted with the joins)."""
        outcome, session = found
        if isinstance(session, sig.Error):
            self.joins[outcome] += 1
            note = Note(kind, {"outcome": outcome, "source": state.source, "session": text})
            return [Send(state.id, session), note]
        assert session.salt is not None
        nonce = secrets.token_bytes(codes.JOIN_NONCE_BYTES)
        state.challenge = (session.code, nonce, now + self.limits.challenge_s, member)
        reply = sig.Challenge(session.code, session.salt.hex(), nonce.hex(), self.limits.challenge_s, ref)
        return [Send(state.id, reply)]

    def _asked_for(self, state: Conn, text: str, ref: str | None, now: float) -> tuple[str, sig.Error | str]:
        """The public code a challenge asks about, or why it is refused before that: a connection
        already in a session, the per-address limit, a malformed code."""
        if state.session is not None:
            why = f"this connection is already in session {state.session}"
            return refusal("already_in_session", why, ref)
        guesser = guesser_key(state.source)
        if not self._join_by_addr.take(guesser, now):
            wait = self._join_by_addr.retry_after(guesser, now)
            why = f"too many join attempts from {state.source}; retry in {wait:.0f} s"
            return refusal("rate_limited", why, ref)
        try:
            return "ok", codes.parse_public(text)
        except ProtocolError as exc:
            return refusal("bad_code", str(exc), ref)

    def _joinable(
        self, state: Conn, text: str, ref: str | None, now: float
    ) -> tuple[str, sig.Error | Session]:
        """The session a challenge may be given for, or why not (the per-address limit first)."""

        err = partial(refusal, ref=ref)

        outcome, code = self._asked_for(state, text, ref, now)
        if isinstance(code, sig.Error):
            return outcome, code
        session = self.sessions.get(code)
        if session is None:
            return err("unknown_session", f"no open session with code {code} (wrong or expired code)")
        if now >= session.code_deadline and not session.formed:  # the session lives; its code is spent
            ttl = self.limits.code_ttl_s
            return err(
                "unknown_session",
                f"session {code}'s code expired: it takes joins for {ttl:.0f} s after it opened or "
                "was last joined; ask the host for a new session",
            )
        if session.verifier is None:
            return err(
                "not_ready", f"session {code} takes no joins yet (its host is still opening it); retry"
            )
        if self._full(session):
            return err(*self._full_refusal(session))
        return "ok", session

    def _full(self, session: Session) -> bool:
        """A forming session takes `members_expected` members; a formed one (or one re-opened after
        a restart) takes joins up to the per-session limit: its host decides about newcomers."""
        places = self.limits.max_members if session.formed else session.members_expected
        return len(session.members) >= min(places, self.limits.max_members)

    def _full_refusal(self, session: Session) -> tuple[str, str]:
        if session.formed:
            cap = self.limits.max_members
            return (
                "session_full",
                f"session {session.code} has {len(session.members)} members, the limit is {cap}",
            )
        return "session_full", f"session {session.code} already has its {session.members_expected} members"

    def _try_join(
        self, state: Conn, msg: sig.Join, now: float
    ) -> tuple[str, sig.Error | tuple[Session, Member]]:
        outcome, session = self._proven(state, msg.session, msg.proof, None, msg.ref, now)
        if isinstance(session, sig.Error):
            return outcome, session
        if self._full(session):
            return refusal(*self._full_refusal(session), msg.ref)
        session.joins += 1
        session.code_deadline = now + self.limits.code_ttl_s
        member = self._add_member(session, state, msg, host=False)
        if len(session.members) >= session.members_expected:
            session.formed = True  # from now on its host decides about newcomers
        return "ok", (session, member)

    def _proven(
        self, state: Conn, text: str, proof: str, member: int | None, ref: str | None, now: float
    ) -> tuple[str, sig.Error | Session]:
        """The prologue a join and a rejoin share: the connection is in no session, it spends its
        live challenge for this request (a join: `member` None; a rejoin: its member), the session
        still takes it, and `proof` proves the code on that challenge's nonce."""
        err = partial(refusal, ref=ref)
        if state.session is not None:
            return err("already_in_session", f"this connection is already in session {state.session}")
        challenge = self._spend_challenge(state, text, member, now)
        if challenge is None:
            if member is None:
                return err(
                    "no_challenge", "ask for a join_challenge on this session first (a nonce serves one join)"
                )
            return err(
                "no_challenge",
                f"ask for a rejoin_challenge for member {member} on this session first "
                "(a nonce serves one rejoin)",
            )
        session = self.sessions.get(challenge[0])
        if session is None or session.verifier is None:
            gone = "no longer takes joins" if member is None else "is gone"
            return err("unknown_session", f"session {challenge[0]} {gone}")
        if member is None and now >= session.code_deadline and not session.formed:
            return err("unknown_session", f"session {challenge[0]} no longer takes joins")
        refused = self._check_proof(state, session, proof, challenge[1], now)
        if refused is not None:
            return err(*refused)
        return "ok", session

    def _spend_challenge(
        self, state: Conn, text: str, member: int | str | None, now: float
    ) -> tuple[str, bytes] | None:
        """The (session, nonce) of the connection's live challenge for this request (a join: member
        None; a rejoin: its member; a succession: SUCCEED), used up right or wrong: one request
        per nonce. None: none."""
        challenge, state.challenge = state.challenge, None
        if (
            challenge is None
            or challenge[3] != member
            or challenge[0] != _normal(text)
            or now >= challenge[2]
        ):
            return None
        return challenge[0], challenge[1]

    def _check_proof(
        self, state: Conn, session: Session, proof: str, nonce: bytes, now: float
    ) -> tuple[str, str] | None:
        """None when `proof` proves the code on `nonce`; else (error code, text). A wrong proof
        counts against the address's back-off and the failed-proof budgets; an address that failed
        before is tested only when they allow it."""
        guesser = guesser_key(state.source)
        wait = self._proof_wait(guesser, session.code, now)
        if wait > 0:  # refused untested: an address that failed waits out its back-off and budgets
            return "rate_limited", f"too many wrong codes tried; retry in {math.ceil(wait)} s"
        if _proof_ok(session, proof, nonce):
            return None
        self._backoff.fail(guesser, now)
        self._failed_by_session.take(session.code, now)
        self._failed_all.take("all", now)
        text = (
            f"that is not session {session.code}'s code: its secret words differ (a mistyped word?); "
            "join again with the exact code the host printed"
        )
        return "wrong_secret", text

    def _proof_wait(self, guesser: str, code: str, now: float) -> float:
        """Seconds before a proof from `guesser` is tested: 0 for an address that never failed,
        else its back-off and the failed-proof budgets of the session and of the rendezvous."""
        if not self._backoff.failed_before(guesser, now):
            return 0.0
        return max(
            self._backoff.wait(guesser, now),
            self._failed_by_session.retry_after(code, now),
            self._failed_all.retry_after("all", now),
        )

    def _add_member(
        self,
        session: Session,
        state: Conn,
        msg: sig.Open | sig.Join | sig.Reopen | sig.Rejoin,
        host: bool,
        mid: int | None = None,
    ) -> Member:
        """A member on `state`'s connection: a new id, or `mid` (a place taken back after a restart)."""
        if mid is None:
            mid = session.next_id
            session.next_id += 1
        info = sig.MemberInfo(
            id=mid,
            name=msg.name,
            host=host,
            address=state.source,
            capability=msg.capability,
            nat=msg.nat,
            candidates=list(msg.candidates),
        )
        member = Member(mid, state.id, info)
        session.members[mid] = member
        state.session, state.member, state.idle_since = session.code, mid, None
        return member

    # ------------------------------------------------------------ re-registering after a restart

    def _ticket(self, state: Conn, ref: str | None) -> list[Event]:
        session, member = self._member(state)
        if not member.info.host:
            text = f"only the host of session {session.code} gets its re-open ticket"
            return [Send(state.id, sig.Error("not_host", text, ref=ref))]
        if session.salt is None or session.verifier is None:
            text = f"session {session.code} has no verifier yet: send protect first"
            return [Send(state.id, sig.Error("not_ready", text, ref=ref))]
        ticket = make_ticket(self._ticket_key, session.code, session.salt, session.verifier)
        return [Send(state.id, sig.Ticket(session.code, ticket.hex(), self.secret_kept, ref))]

    def _reopen(self, state: Conn, msg: sig.Reopen, now: float) -> list[Event]:
        """The host registers its session again under the same code: the ticket shows that this
        rendezvous (or the one before its restart, with the same kept secret) accepted this code's
        salt and verifier from the host that protected it."""
        claims = _relay_claims(msg.relays, msg.ref)
        checked = claims if isinstance(claims, sig.Error) else self._reopenable(state, msg, now)
        if isinstance(checked, sig.Error):
            return [
                Send(state.id, checked),
                Note(
                    "reopen_refused", {"session": msg.session, "source": state.source, "code": checked.code}
                ),
            ]
        code, salt, verifier = checked
        session = self.sessions.get(code)
        if session is None:
            session = Session(code, msg.model, msg.members_expected, now + self.limits.code_ttl_s)
            session.salt, session.verifier, session.reopened = salt, verifier, True
            session.formed = True
            self.sessions[code] = session
        session.next_id = max(session.next_id, msg.next_member)
        member = self._add_member(session, state, msg, host=True, mid=msg.member)
        assert not isinstance(claims, sig.Error)
        relays = self._adopt(session, member, claims, now)
        opened = self._opened(code, member, max(0.0, session.code_deadline - now), msg.ref)
        fields = {
            "session": code,
            "member": member.id,
            "members": len(session.members),
            "relays": relays,
            "source": state.source,
        }
        return [Send(state.id, opened), Note("session_reopened", fields), *self._tell(session, member, False)]

    def _reopenable(self, state: Conn, msg: sig.Reopen, now: float) -> sig.Error | tuple[str, bytes, bytes]:
        """(code, salt, verifier) of a `reopen` that may take its code, or the error that says why not."""

        def err(code: str, text: str) -> sig.Error:
            return sig.Error(code, text, ref=msg.ref)

        refusal = self._refuse_open(state, msg, now)
        if refusal is not None:
            return refusal
        try:
            code = codes.parse_public(msg.session)
            salt, verifier, ticket = (bytes.fromhex(x) for x in (msg.salt, msg.verifier, msg.ticket))
        except ProtocolError as exc:
            return err("bad_code", str(exc))
        except ValueError:
            return err("bad_message", "reopen: 'salt', 'verifier' and 'ticket' must be hex")
        if msg.member >= msg.next_member:
            return err(
                "bad_message", f"reopen: member {msg.member} is not below next_member {msg.next_member}"
            )
        if not ticket_ok(self._ticket_key, code, salt, verifier, ticket):
            why = (
                "this rendezvous never gave that ticket for this code, salt and verifier"
                if self.secret_kept
                else "this rendezvous draws a new secret at each start (no --relay-secret-file), so no "
                "session outlives its restart"
            )
            return err("bad_ticket", f"cannot re-open session {code}: {why}; open a new session")
        session = self.sessions.get(code)
        if session is None:
            return code, salt, verifier
        if session.verifier is None or not hmac.compare_digest(session.verifier, verifier):
            return err(
                "code_taken",
                f"code {code} belongs to another session on this rendezvous now; open a new session",
            )
        if msg.member in session.members:
            return err(
                "member_present",
                f"session {code} still has its host (member {msg.member}) on another connection; "
                f"retry after {self.limits.heartbeat_timeout_s:g} s of its silence",
            )
        heir = _host_of(session)
        if heir is not None:
            return err(
                "replaced",
                f"member {heir.id} ({heir.info.name}) took session {code} over as its host after "
                f"member {msg.member} was lost",
            )
        return code, salt, verifier

    def _rejoin_challenge(self, state: Conn, msg: sig.RejoinChallenge, now: float) -> list[Event]:
        """A nonce for a member taking its place back in a re-opened session: no limit on the
        session's size or its code's time (the place is its own), the per-address limit as for joins."""
        found = self._rejoinable(state, msg.session, msg.member, msg.ref, now)
        return self._give_challenge(state, found, "rejoin", msg.session, msg.ref, msg.member, now)

    def _rejoinable(
        self, state: Conn, text: str, member: int, ref: str | None, now: float
    ) -> tuple[str, sig.Error | Session]:
        err = partial(refusal, ref=ref)

        outcome, code = self._asked_for(state, text, ref, now)
        if isinstance(code, sig.Error):
            return outcome, code
        session = self.sessions.get(code)
        if session is None or session.verifier is None:
            _, refused = err(
                "unknown_session",
                f"no session with code {code} here (its host has not re-registered it since this "
                "rendezvous started)",
            )
            return "not_reopened", refused  # counted apart: members back before their host, not guessers
        return self._place_free(session, member, ref)

    def _place_free(self, session: Session, member: int, ref: str | None) -> tuple[str, sig.Error | Session]:
        err = partial(refusal, ref=ref)
        if not 1 <= member < session.next_id:
            return err("unknown_member", f"session {session.code} never had a member {member}")
        if member in session.members:
            return err(
                "member_present",
                f"member {member} of session {session.code} is still connected; retry after "
                f"{self.limits.heartbeat_timeout_s:g} s of its silence",
            )
        if len(session.members) >= self.limits.max_members:
            return err(
                "session_full", f"session {session.code} has {len(session.members)} members, the limit"
            )
        return "ok", session

    def _adopt(self, session: Session, member: Member, claims: list[Claim], now: float) -> int:
        """The relay legs a member registering again holds: how many channels learnt their session."""
        return sum(
            self.relay.adopt(session.code, member.id, peer, cid, leg, token, now)
            for cid, leg, peer, token in claims
            if 1 <= peer < session.next_id and peer != member.id
        )

    def _rejoin(self, state: Conn, msg: sig.Rejoin, now: float) -> list[Event]:
        claims = _relay_claims(msg.relays, msg.ref)
        if isinstance(claims, sig.Error):
            return [Send(state.id, claims)]
        outcome, result = self._try_rejoin(state, msg, now)
        self.joins[outcome] += 1
        note = Note(
            "rejoin",
            {"outcome": outcome, "source": state.source, "session": msg.session, "member": msg.member},
        )
        if isinstance(result, sig.Error):
            return [Send(state.id, result), note]
        session, member = result
        self._adopt(session, member, claims, now)
        return [
            Send(state.id, self._joined(session, member, msg.ref)),
            note,
            *self._tell(session, member, False),
        ]

    def _try_rejoin(
        self, state: Conn, msg: sig.Rejoin, now: float
    ) -> tuple[str, sig.Error | tuple[Session, Member]]:
        outcome, proven = self._proven(state, msg.session, msg.proof, msg.member, msg.ref, now)
        if isinstance(proven, sig.Error):
            return outcome, proven
        outcome, free = self._place_free(proven, msg.member, msg.ref)
        if isinstance(free, sig.Error):
            return outcome, free
        return "rejoined", (free, self._add_member(free, state, msg, host=False, mid=msg.member))

    # ------------------------------------------------------------ a member takes the host's place

    def _succeed_challenge(self, state: Conn, msg: sig.SucceedChallenge, now: float) -> list[Event]:
        """A nonce for a member of the session to take the place of its host, once that host is
        gone from the rendezvous (left, or timed out after its silence)."""
        session, member = self._member(state)
        found = self._successor(session, member, msg.session, msg.ref, now)
        guesser = guesser_key(state.source)
        if not isinstance(found[1], sig.Error) and not self._join_by_addr.take(guesser, now):
            wait = self._join_by_addr.retry_after(guesser, now)
            why = f"too many join attempts from {state.source}; retry in {wait:.0f} s"
            found = refusal("rate_limited", why, msg.ref)
        return self._give_challenge(state, found, SUCCEED, msg.session, msg.ref, SUCCEED, now)

    def _successor(
        self, session: Session, member: Member, text: str, ref: str | None, now: float
    ) -> tuple[str, sig.Error | Session]:
        """The session `member` may take the host's place in, or why not: another session's code,
        no verifier to prove, its host still present."""
        err = partial(refusal, ref=ref)
        if _normal(text) != session.code:
            return err("bad_code", f"this connection is in session {session.code}, not {text}")
        host = _host_of(session)
        if host is member:
            return err("already_host", f"member {member.id} is session {session.code}'s host already")
        if host is not None:
            silent = now - self.conns[host.conn].last_seen
            return err(
                "member_present",
                f"session {session.code}'s host (member {host.id}, {host.info.name}) is still "
                f"connected, silent for {silent:.0f} s; retry after "
                f"{self.limits.heartbeat_timeout_s:g} s of its silence",
            )
        if session.verifier is None:
            return err("not_ready", f"session {session.code} has no verifier to prove the code on")
        return "ok", session

    def _succeed(self, state: Conn, msg: sig.Succeed, now: float) -> list[Event]:
        """The member proves the code over its succession nonce and becomes the host: the session
        takes joins through it, and the others hear that it is the host (`member_updated`)."""
        session, member = self._member(state)
        outcome, refused = self._try_succeed(state, session, member, msg, now)
        self.joins[outcome] += 1
        fields = {"outcome": outcome, "source": state.source, "session": session.code, "member": member.id}
        note = Note("succeed", fields)
        if refused is not None:
            return [Send(state.id, refused), note]
        return [
            Send(state.id, self._joined(session, member, msg.ref)),
            note,
            *self._tell(session, member, False),
        ]

    def _try_succeed(
        self, state: Conn, session: Session, member: Member, msg: sig.Succeed, now: float
    ) -> tuple[str, sig.Error | None]:
        err = partial(refusal, ref=msg.ref)
        challenge = self._spend_challenge(state, msg.session, SUCCEED, now)
        if challenge is None:
            return err(
                "no_challenge", "ask for a succeed_challenge on this session first (a nonce serves once)"
            )
        outcome, found = self._successor(session, member, msg.session, msg.ref, now)
        if isinstance(found, sig.Error):
            return outcome, found
        refused = self._check_proof(state, session, msg.proof, challenge[1], now)
        if refused is not None:
            return err(*refused)
        member.info = dataclasses.replace(member.info, host=True)
        return "succeeded", None

    # ------------------------------------------------------------ in-session requests

    def _member(self, state: Conn) -> tuple[Session, Member]:
        assert state.session is not None and state.member is not None
        session = self.sessions[state.session]
        return session, session.members[state.member]

    def _update(self, state: Conn, msg: sig.Update) -> list[Event]:
        session, member = self._member(state)
        info = member.info
        member.info = sig.MemberInfo(
            id=info.id,
            name=info.name,
            host=info.host,
            address=info.address,
            capability=info.capability if msg.capability is None else msg.capability,
            nat=info.nat if msg.nat is None else msg.nat,
            candidates=info.candidates if msg.candidates is None else list(msg.candidates),
        )
        return [Send(m.conn, sig.MemberUpdated(member.info)) for m in session.members.values()]

    def _signal(self, state: Conn, to: int, payload: signaling.JsonObject) -> list[Event]:
        session, member = self._member(state)
        target = session.members.get(to)
        if target is None:
            return [Send(state.id, sig.Error("unknown_member", f"session {session.code} has no member {to}"))]
        return [Send(target.conn, sig.SignalFrom(member.id, payload))]

    def _relay(self, state: Conn, peer: int, ref: str | None, now: float) -> list[Event]:
        session, member = self._member(state)
        other = session.members.get(peer)
        if other is None or other is member:
            text = f"session {session.code} has no other member {peer}"
            return [Send(state.id, sig.Error("unknown_member", text, ref=ref))]
        try:
            channel = self.relay.allocate(session.code, member.id, peer, now)
        except RelayLimitError as exc:
            return [Send(state.id, sig.Error("limit", str(exc), ref=ref))]
        out: list[Event] = []
        for leg_index, leg in enumerate(channel.legs):
            me = session.members[leg.member]
            peer_id = channel.legs[1 - leg_index].member
            msg = sig.RelayAllocated(
                channel.id, peer_id, leg_index, leg.token.hex(), ref if me is member else None
            )
            out.append(Send(me.conn, msg))
        out.append(
            Note(
                "relay_allocated", {"session": session.code, "channel": channel.id, "edge": [member.id, peer]}
            )
        )
        return out

    # ------------------------------------------------------------ leaving and time

    def _remove_by_host(self, state: Conn, target: int, reason: str, now: float) -> list[Event]:
        """The host takes another member out: it leaves as "removed", its connection is closed with
        a fatal `removed`, and the session can take a join in its place."""
        session, member = self._member(state)
        if not member.info.host:
            text = f"member {member.id}: only the host of session {session.code} may remove members"
            return [Send(state.id, sig.Error("not_host", text))]
        other = session.members.get(target)
        if other is None or other is member:
            text = f"session {session.code} has no other member {target}"
            return [Send(state.id, sig.Error("unknown_member", text))]
        gone = self.conns.pop(other.conn)  # nothing it still sends counts (as for a timed-out member)
        text = f"the host removed this member from session {session.code}" + (f": {reason}" if reason else "")
        fields = {"session": session.code, "member": target, "by": member.id, "reason": reason}
        return [
            Note("member_removed", fields),
            *self._remove_member(gone, "removed", now),
            Send(gone.id, sig.Error("removed", text, fatal=True)),
            Close(gone.id, 1000, "removed by the host"),
        ]

    def _remove_member(self, state: Conn, reason: str, now: float) -> list[Event]:
        session, member = self._member(state)
        del session.members[member.id]
        state.session = state.member = None
        state.idle_since = now
        self.left[reason] += 1
        self.relay.release_member(session.code, member.id)
        out: list[Event] = [
            Note("member_left", {"session": session.code, "member": member.id, "reason": reason})
        ]
        out += [Send(m.conn, sig.MemberLeft(member.id, reason)) for m in session.members.values()]
        if not session.members:
            out += self._dissolve(session, "last member left")
        return out

    def _dissolve(self, session: Session, why: str) -> list[Event]:
        del self.sessions[session.code]
        self.relay.release_session(session.code)
        return [Note("session_dissolved", {"session": session.code, "why": why, "joins": session.joins})]

    def tick(self, now: float) -> list[Event]:
        """Time out silent members and expire unused codes."""
        out: list[Event] = []
        deadline = now - self.limits.heartbeat_timeout_s
        for state in [c for c in self.conns.values() if c.last_seen <= deadline]:
            if state.session is not None:
                out += self._remove_member(state, "timed_out", now)
            silent = now - state.last_seen
            out.append(Send(state.id, sig.Error("timed_out", f"no message for {silent:.0f} s", fatal=True)))
            out.append(Close(state.id, 1001, "heartbeat timeout"))
            del self.conns[state.id]
        idle = now - self.limits.heartbeat_timeout_s  # heartbeats alone do not hold a place
        for state in [c for c in self.conns.values() if c.idle_since is not None and c.idle_since <= idle]:
            text = f"no open or join within {self.limits.heartbeat_timeout_s:g} s"
            out += [Send(state.id, sig.Error("timed_out", text, fatal=True)), Close(state.id, 1001, text)]
            del self.conns[state.id]
        alone = [
            s for s in self.sessions.values() if now >= s.code_deadline and s.joins == 0 and not s.reopened
        ]
        for session in alone:
            (host,) = session.members.values()
            text = (
                f"nobody joined session {session.code} within {self.limits.code_ttl_s:.0f} s; open a new one"
            )
            out.append(Send(host.conn, sig.Error("code_expired", text, fatal=True)))
            out.append(Close(host.conn, 1000, "code expired"))
            self.conns[host.conn].session = self.conns[host.conn].member = None
            out += self._dissolve(session, "code expired")
        self.relay.expire(now)
        self._join_by_addr.prune(now)
        self._failed_by_session.prune(now)
        self._failed_all.prune(now)
        self._backoff.prune(now)
        self._open_by_addr.prune(now)
        return out


Claim = tuple[int, int, int, bytes]  # a relay leg a member holds: channel, leg, peer, token


def _relay_claims(texts: list[str], ref: str | None) -> list[Claim] | sig.Error:
    try:
        return [sig.parse_relay_leg_claim(t) for t in texts]
    except ProtocolError as exc:
        return sig.Error("bad_message", str(exc), ref=ref)


def guesser_key(source: str) -> str:
    """Whom a join's limits count against: an IPv4 address, or an IPv6 address's /48 (one site's
    allocation: a /64 each costs an attacker nothing)."""
    try:
        ip = ipaddress.ip_address(source)
    except ValueError:
        return source
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/48", strict=False))
    return str(ip)


def _host_of(session: Session) -> Member | None:
    """The member present that is the session's host (None: its host is gone)."""
    return next((m for m in session.members.values() if m.info.host), None)


def _normal(text: str) -> str | None:
    try:
        return codes.parse_public(text)
    except ProtocolError:
        return None


def _proof_ok(session: Session, proof_hex: str, nonce: bytes) -> bool:
    assert session.verifier is not None
    try:
        proof = bytes.fromhex(proof_hex)
    except ValueError:
        return False
    return codes.proof_matches(session.verifier, session.code, nonce, proof)
