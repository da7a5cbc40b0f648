"""Re-open tickets: what lets a host register its session again after the rendezvous restarted.

The rendezvous keeps no session state on disk. When the host has protected its session (its
code's salt and scrypt verifier), it asks for a ticket: an HMAC-SHA256 of the public part, the
salt and the verifier under a key derived from the rendezvous's kept secret (the relay secret of
`--relay-secret-file`). After a restart with the same secret, a `reopen` that carries the public
part, salt, verifier and ticket is one this rendezvous itself accepted before, so the code goes
back to the host that protected it and to no one else (docs/rendezvous.md, "Re-registering after
a restart"). Pure: no clock, no state.
"""

from __future__ import annotations

import hashlib
import hmac

TICKET_BYTES = 32
_KEY_LABEL = b"kafila-session-ticket-key-v1"
_TICKET_LABEL = b"kafila-reopen-ticket-v1"


def ticket_key(secret: bytes) -> bytes:
    """The ticket key of a rendezvous whose kept secret is `secret` (distinct from the relay's use
    of it: a leg token never verifies as a ticket, nor the other way round)."""
    return hmac.new(secret, _KEY_LABEL, hashlib.sha256).digest()


def make_ticket(key: bytes, public: str, salt: bytes, verifier: bytes) -> bytes:
    """The ticket of session `public` protected with `salt` and `verifier` (lengths are framed, so
    no two different triples share a message)."""
    parts = (public.encode(), salt, verifier)
    message = _TICKET_LABEL + b"".join(len(p).to_bytes(2, "big") + p for p in parts)
    return hmac.new(key, message, hashlib.sha256).digest()


def ticket_ok(key: bytes, public: str, salt: bytes, verifier: bytes, ticket: bytes) -> bool:
    """Whether `ticket` is this key's for the triple (constant time)."""
    return hmac.compare_digest(make_ticket(key, public, salt, verifier), ticket)
