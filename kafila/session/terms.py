"""What a member is started with: its own settings and, for the host, the session's terms."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from kafila.api.overload import DEFAULT_LIMITS, ApiLimits
from kafila.api.security import NO_SECURITY, ApiSecurity
from kafila.api.server import parse_addr
from kafila.engine import PREFILL_CHUNK
from kafila.engine.pace import Pace
from kafila.engine.system import usable_cpus
from kafila.obs.listener import parse_addr as metrics_addr
from kafila.obs.trace import TraceLog
from kafila.proto import signaling as sig
from kafila.proto.session import SessionTerms
from kafila.session.weights.cache import cache_problem
from kafila.session.weights.mirror import mirror_base
from kafila.session.weights.replicas import DEFAULT_REPLICA_BYTES

DEFAULT_PROBE_MAX_AGE_S = 600.0  # `--probe-max-age`: a measurement under the same terms is offered again
DEFAULT_QUEUE = 256  # requests that may wait for a slot before more are refused (`kafila host --queue`)
DEFAULT_RENDEZVOUS = f"ws://127.0.0.1:{sig.DEFAULT_PORT}{sig.SIGNAL_PATH}"  # `kafila rendezvous` here


@dataclass
class Options:
    """A member's settings from its flags; the host's also carry the session's terms (model on)."""

    rendezvous: str = DEFAULT_RENDEZVOUS
    name: str | None = None
    api: str | None = "127.0.0.1:11434"  # None: no API on this member
    api_security: ApiSecurity = NO_SECURITY  # keys, allowed hosts and origins (kafila.api.security)
    api_limits: ApiLimits = (
        DEFAULT_LIMITS  # connections, unauthenticated ones, read deadline (kafila.api.overload)
    )
    metrics: str | None = None  # --metrics HOST:PORT: /metrics on a listener of its own (None: none)
    backend: str = "auto"
    dtype: str = "auto"  # host: the session's (auto: the checkpoint's); a member takes the host's
    quant: str = "auto"  # weight format, as dtype: "none", "int8", "q4" (kafila.engine.QUANT_CHOICES)
    memory_bytes: int | None = None  # cap on what this member offers (default: the probe's figure)
    probe_repeats: int = 2
    probe_max_age_s: float = DEFAULT_PROBE_MAX_AGE_S  # its own earlier measurement, kept on disk, offered
    wait_s: float = 300.0  # host: how long to wait for the members
    trace: Path | None = None
    cache: Path | None = None
    use_local: bool = True  # a member that holds the same checkpoint loads it instead of fetching
    weights_from: str | None = None  # --weights-from: an HTTP(S) mirror or hub URL asked before the host
    replica_bytes: int = DEFAULT_REPLICA_BYTES  # --replica-bytes: the next member's shard kept, at most
    dead_after: float = 3.0  # --lost-after: a neighbour silent this long is lost (session.channel)
    emulate_speed: float = 1.0  # < 1: emulate a slower device (kafila.engine.pace)
    draft: str = "lookup"  # --draft: how it drafts as the head: none, lookup or a draft model (engine.draft)
    draft_ahead: int = 0  # --draft-ahead: steps the head sends past a drafted one in the ring (engine.draft)
    # host only
    model: str = "smollm2-135m"
    members: int = 1
    context: int = 2048
    concurrency: int = 1
    division: str = "kafila"
    objective: str = "load"  # what the kafila division minimizes (kafila.planner.decide.OBJECTIVES)
    chunk: int = PREFILL_CHUNK  # prompt tokens per prefill step (as `kafila run`'s)
    queue: int = DEFAULT_QUEUE  # requests that may wait for a slot at the head; more get 429

    def check(self) -> None:
        """Refuse what cannot work here before anything connects (ValueError, one line). Its own
        step rather than construction's: it reads the machine (CPUs, the trace file's and the
        cache's folders), which a value should not do as it is made."""
        self.pace.check_cpus(usable_cpus())
        if self.api is not None:
            parse_addr(self.api)  # a malformed --api is named before anything connects
        if self.metrics is not None:
            metrics_addr(self.metrics)
        if self.trace is not None:
            TraceLog.check(self.trace)
        if problem := cache_problem(self.cache):
            raise ValueError(problem)
        if self.weights_from is not None:
            mirror_base(self.weights_from)  # not a URL: named before anything connects

    def terms(self) -> SessionTerms:
        """The host's: the session's terms from these flags (the model, dtype and quant as resolved)."""
        return SessionTerms(
            self.model,
            self.chunk,
            self.queue,
            self.dtype,
            self.context,
            self.concurrency,
            self.division,
            self.quant,
        )

    @property
    def pace(self) -> Pace:
        return Pace(self.emulate_speed)
