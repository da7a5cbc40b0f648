"""Every limit the rendezvous enforces, in one value (flags of `kafila rendezvous` fill it)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kafila.proto import signaling

# Limits where 0 is a setting of its own: no byte rate limit, or a rendezvous that does not relay.
ZERO_ALLOWED = frozenset(
    {"relay_session_bytes_per_s", "relay_channels", "relay_channels_per_session", "relay_recover_s"}
)
MIN_MESSAGE_BYTES = 1024  # a smaller frame limit would refuse ordinary open/join frames


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_bytes: int = signaling.MAX_MESSAGE_BYTES  # one signaling frame
    max_bad_frames: int = 5  # malformed frames in a row before the connection is closed
    max_connections: int = 5000
    max_connections_per_address: int = 256  # one source address (a campus NAT: many members)
    max_sessions: int = 1000
    max_members: int = 64  # per session
    code_ttl_s: float = 600.0  # a code with no join for this long stops working
    heartbeat_s: float = 10.0  # interval members are told to keep
    heartbeat_timeout_s: float = 30.0  # silence after which a member is timed out
    join_rate_per_address: float = 10 / 60  # join challenges per second per source address...
    join_burst_per_address: int = 10  # ...with this burst
    # wrong proofs of a code's secret, tested only while these allow it once an address has failed
    # (an address that has not is always tested: a member with the right code never waits)
    failed_proof_rate_per_session: float = 10 / 60  # per second on one session's code...
    failed_proof_burst_per_session: int = 10
    failed_proof_rate: float = 1.0  # per second on the whole rendezvous...
    failed_proof_burst: int = 60
    failed_proof_backoff_s: float = 2.0  # an address's first wait after a wrong proof, doubling...
    failed_proof_backoff_max_s: float = 300.0  # ...up to this
    failed_proof_memory_s: float = 3600.0  # an address that failed is remembered this long
    challenge_s: float = 30.0  # a join nonce stays good this long
    open_rate_per_address: float = 6 / 60  # sessions opened per second per source address
    open_burst_per_address: int = 6
    relay_channels: int = 4096  # all sessions together (0: no relay)
    relay_channels_per_session: int = 32  # (0: no relay)
    relay_session_bytes_per_s: float = 100e6  # forwarded per session (0: unlimited)
    relay_idle_s: float = 60.0  # a channel with no bind or data for this long is removed
    # for this long after a start, a bind of an unknown channel whose token the relay secret signed
    # brings the channel back (a restart that kept the secret; 0: never)
    relay_recover_s: float = 120.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            problem = limit_problem(f.name, getattr(self, f.name))
            if problem:
                raise ValueError(f"limit {f.name} {problem}")
        if not self.heartbeat_timeout_s > self.heartbeat_s:
            raise ValueError(
                f"limit heartbeat_timeout_s ({self.heartbeat_timeout_s:g} s) must be longer than "
                f"heartbeat_s ({self.heartbeat_s:g} s), or members are timed out between heartbeats"
            )


def limit_problem(name: str, value: float) -> str | None:
    """Why `value` cannot be the limit `name` ("must be ..."), or None when it can."""
    if name == "max_message_bytes":
        ok, bound = value >= MIN_MESSAGE_BYTES, f">= {MIN_MESSAGE_BYTES}"
    elif name in ZERO_ALLOWED:
        ok, bound = value >= 0, ">= 0"
    else:
        ok, bound = value > 0, "> 0"
    if ok and math.isfinite(value):
        return None
    return f"must be finite and {bound}, got {value!r}"
