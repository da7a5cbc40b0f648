"""Trace records of a session and its requests, JSON lines on disk, and the Table IV summary.

The ring runtime measures; this module only holds and reads what it measured (pure apart from
`TraceLog`, which appends lines to a file). Records are plain dataclasses with stable names so the
Prometheus layer (kafila.obs.metrics) and `kafila trace summarize` read the same fields:

- `SessionRecord` (one per formed session): division, ring order, blocks and predicted compute
  time per stage, predicted bottleneck and circuit time, each edge's path.
- `RequestRecord` (one per request that ended after its first token, written by the head: the
  whole ring's view; `finish` stop, length, cancelled or error): prompt
  and completion tokens, time waiting in the queue, time to first token split into queue and
  prefill, decode tokens/s, circuit and transit time per decode step, per stage the measured
  compute per decode step and per prefill next to the prediction, and per hop the bytes and
  messages counted on the link by its sender, its measured and its predicted round trip.
- `StageRecord` (one per request at every member, the head too: what that member measured): its
  stage's compute per decode step and per prefill chunk, and the hops it owns (bytes and messages
  received from its predecessor and sent to its successor, counted on the link).

A summary groups request records by session and reports the paper's Table IV columns:
bottleneck (slowest stage's measured ms per decode step), imbalance (slowest over fastest stage),
utilisation (mean stage over the bottleneck), tokens/s (median, spread), and prediction error
(median |predicted - measured| / measured over every stage of every request). A stage summary
groups stage records by member: the same figures for one stage, from a member's own trace file.
A figure that is undefined (a ratio over 0 ms) is None, not inf or NaN.

Reading the lines back, every field checked: kafila.obs.tracefile.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kafila.obs.log import get_logger

log = get_logger("kafila.obs.trace")
R = TypeVar("R")  # a record kind
S = TypeVar("S")  # its summary


@dataclass(frozen=True)
class StageTrace:
    member: str
    index: int  # position in the ring, 0 = head
    blocks: tuple[int, int]  # [first, last) block
    head: bool
    predicted_ms: float  # per decode step, from the plan
    measured_ms: float  # median compute per decode step in this request
    steps: int = 0  # decode steps measured
    bytes_out: int = 0  # bytes this stage sent to the next member for this request (counted on the link)
    prefill_ms: float = 0.0  # compute of all this request's prefill chunks at this stage
    prefill_chunks: int = 0


@dataclass(frozen=True)
class HopTrace:
    """One ring edge for one request. `bytes` and `messages` are counted on the link by the side
    that wrote the record (the sender for a hop out, the receiver for a hop in): every hidden-state
    frame that carried rows of the request, a frame shared by several requests split by rows.
    `rtt_ms` is QUIC's smoothed round trip of that link when the request ended (None in-process);
    `predicted_rtt_ms` is the round trip the plan priced for the edge (None when unknown)."""

    src: str
    dst: str
    path: str  # "direct" | "relay" | "local"
    bytes: int
    messages: int
    rtt_ms: float | None = None
    predicted_rtt_ms: float | None = None

    @property
    def name(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass(frozen=True)
class RequestRecord:
    session: str
    request_id: int
    member: str  # the member whose API received the request
    division: str
    prompt_tokens: int
    completion_tokens: int
    queue_s: float
    prefill_s: float  # prompt through the ring until the first token is sampled
    decode_s: float  # first token to last token
    circuit_ms: float  # median time around the ring per decode step, measured at the head
    stages: tuple[StageTrace, ...]
    hops: tuple[HopTrace, ...] = ()
    finish: str = "stop"
    transit_ms: float = 0.0  # median per decode step of circuit minus every stage's compute: hops + waits
    epoch: int = 1  # the plan epoch it ended in (a request carried over a re-plan: the last one)
    type: str = "request"

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.prefill_s

    @property
    def tokens_per_s(self) -> float:
        steps = self.completion_tokens - 1
        return steps / self.decode_s if steps > 0 and self.decode_s > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["ttft_s"], d["tokens_per_s"] = self.ttft_s, self.tokens_per_s
        return d


@dataclass(frozen=True)
class SessionRecord:
    session: str
    model: str
    division: str
    order: tuple[str, ...]
    head: str
    blocks: dict[str, tuple[int, int]]
    predicted_stage_ms: dict[str, float]
    predicted_bottleneck_ms: float
    predicted_circuit_ms: float
    edges: dict[str, str] = field(default_factory=dict)  # "a->b": "direct" | "relay"
    epoch: int = 1  # the plan epoch this ring belongs to
    type: str = "session"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class StageRecord:
    """What one member measured of one request at its own stage."""

    session: str
    member: str
    index: int  # ring position, 0 = head
    blocks: tuple[int, int]
    head: bool
    request_id: int
    predicted_ms: float  # per decode step, from the plan
    decode_ms: float  # median compute per decode step (of the batch the step ran in)
    decode_steps: int
    prefill_ms: tuple[float, ...]  # compute of each prefill chunk, in order
    hop_in: HopTrace | None  # from the previous member (None on a ring of one)
    hop_out: HopTrace | None  # to the next member
    wait_ms: float = 0.0  # median per decode step: frame arrived here -> its batch started (not the head)
    epoch: int = 1  # the plan epoch the stage served it in
    type: str = "stage"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class ReplanRecord:
    """One change of plan epoch (kafila.session.forming.epochs), as the host saw it."""

    session: str
    epoch: int  # the new epoch
    cause: str  # "m2 was lost (silent)"
    old_blocks: dict[str, tuple[int, int]]  # the division before: member -> [start, stop)
    new_blocks: dict[str, tuple[int, int]]  # ... and after
    bytes_fetched: int  # tensor bytes the host served for it
    bytes_minimum: int  # what the new division needs at least (kafila.planner.replan.Fetch)
    ready_s: float  # from the loss to every survivor ready
    carried: int | None  # requests carried into the new epoch (None: the host is not the head)
    first_token_s: float | None = None  # from the loss to the first token after it (None: none came)
    type: str = "replan"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


Record = RequestRecord | SessionRecord | StageRecord | ReplanRecord


def ring_mismatch(first: RequestRecord, r: RequestRecord, first_at: str = "") -> str | None:
    """Why request record `r` cannot be summarised with `first`, its session's first (None if it can):
    every request of a session passes the same members' stages, in ring order."""
    have, want = [s.member for s in r.stages], [s.member for s in first.stages]
    if not have:
        return f"request {r.request_id} of session {r.session} has no stages"
    if have != want:
        return (
            f"request {r.request_id} of session {r.session} has stages {', '.join(have)}; "
            f"request {first.request_id}{first_at} has {', '.join(want) or 'none'}"
        )
    return None


def stage_mismatch(first: StageRecord, r: StageRecord, first_at: str = "") -> str | None:
    """Why stage record `r` cannot be summarised with `first`, its member's first (None if it can):
    a member keeps one stage, the same blocks, for its session's life."""
    if (r.index, r.blocks) == (first.index, first.blocks):
        return None
    return (
        f"stage record of member {r.member} in session {r.session} (request {r.request_id}) has stage "
        f"{r.index}, blocks {r.blocks[0]}-{r.blocks[1]}; its record of request {first.request_id}{first_at} "
        f"has stage {first.index}, blocks {first.blocks[0]}-{first.blocks[1]}"
    )


class TraceLog:
    """Appends records as JSON lines and keeps the last `keep` in memory for the /traces endpoint."""

    def __init__(self, path: Path | None, keep: int = 256) -> None:
        self.path = path
        self._recent: deque[dict[str, Any]] = deque(maxlen=keep)
        self._lock = threading.Lock()
        self._failed = False
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def check(path: Path) -> None:
        """ValueError (one line) when records could not be appended to `path`: named before a session
        starts, not after its probe and load (a record that fails later is logged, never raised)."""
        import os

        try:
            if path.is_dir():
                raise IsADirectoryError(21, "Is a directory")
            for folder in path.parents:
                if folder.exists() and not folder.is_dir():
                    raise NotADirectoryError(20, f"{folder} is a file, not a folder")
            path.parent.mkdir(parents=True, exist_ok=True)
            if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
                raise PermissionError(13, "Permission denied")
        except OSError as exc:
            raise ValueError(f"cannot write the trace to {path}: {exc.strerror or exc}") from None

    def write(self, record: Record) -> None:
        """Keep and append one record. A file that cannot be written is logged once, never raised:
        the ring loops that write records must not stop over a full disk."""
        line = record.to_json()
        with self._lock:
            self._recent.append(line)
            if self.path is not None:
                try:
                    with self.path.open("a") as f:
                        f.write(json.dumps(line) + "\n")
                except OSError as exc:
                    if not self._failed:
                        log.error("trace_write_failed", path=str(self.path), reason=str(exc))
                    self._failed = True

    def recent(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._recent)


@dataclass(frozen=True)
class Summary:
    """Table IV for one session: medians over its requests, the first dropped as cold unless it is the
    only one (`cold_dropped` says which). A figure is None where it is undefined: imbalance when the
    fastest stage measured 0 ms, utilisation and the bottleneck member when every stage did, tokens/s
    when no request took decode time, prediction error when no stage measured more than 0 ms."""

    session: str
    division: str
    requests: int
    stage_ms: dict[str, float]  # member -> measured ms per decode step
    predicted_ms: dict[str, float]
    bottleneck_ms: float
    bottleneck_member: str | None
    imbalance: float | None
    utilisation: float | None
    tokens_per_s: float | None
    tokens_per_s_spread: float | None  # half the range of the counted requests
    prediction_error: float | None  # median relative error over stages x requests
    circuit_ms: float
    ttft_prefill_s: float
    ttft_queue_s: float
    transit_ms: float = 0.0  # median per decode step of the circuit less every stage's compute
    cold_dropped: bool = False  # the session's first request is not counted


def _ratio(a: float, b: float) -> float | None:
    """a / b, None where that is undefined or not finite (b is 0)."""
    if b <= 0:
        return None
    r = a / b
    return r if math.isfinite(r) else None


FINISHED = ("stop", "length")  # Table IV counts these; a cancelled or failed request's figures
# stop part way (a request cancelled after 7 tokens decoded at positions the others passed fast)


def summarize(records: Iterable[Record], drop_cold: bool = True) -> list[Summary]:
    """Table IV per session from its finished request records of more than one token. Requests of
    one session that pass different members' stages (or none) raise ValueError naming them."""
    by_session: dict[str, list[RequestRecord]] = {}
    for r in records:
        if isinstance(r, RequestRecord) and r.completion_tokens > 1 and r.finish in FINISHED:
            by_session.setdefault(r.session, []).append(r)
    return [_warm(reqs, ring_mismatch, drop_cold, _summarize_one) for reqs in by_session.values()]


def _warm(
    group: list[R], mismatch: Callable[[R, R], str | None], drop_cold: bool, one: Callable[[list[R], bool], S]
) -> S:
    """`one` of a group of records that agree with its first (ValueError naming the first that does
    not), the first dropped as cold when asked and not the only one."""
    for r in group:
        problem = mismatch(group[0], r)
        if problem is not None:
            raise ValueError(problem)
    drop = drop_cold and len(group) > 1
    return one(group[1:] if drop else group, drop)


def _summarize_one(reqs: list[RequestRecord], cold_dropped: bool) -> Summary:
    members = [s.member for s in reqs[0].stages]
    stage_ms = {m: statistics.median(_stage(r, m).measured_ms for r in reqs) for m in members}
    predicted = {m: _stage(reqs[0], m).predicted_ms for m in members}
    slowest = max(members, key=stage_ms.__getitem__)
    bneck, fastest = stage_ms[slowest], min(stage_ms.values())
    rates = [r.tokens_per_s for r in reqs if r.decode_s > 0]
    errors = [
        abs(s.predicted_ms - s.measured_ms) / s.measured_ms for r in reqs for s in r.stages if s.measured_ms
    ]
    return Summary(
        session=reqs[0].session,
        division=reqs[0].division,
        requests=len(reqs),
        stage_ms=stage_ms,
        predicted_ms=predicted,
        bottleneck_ms=bneck,
        bottleneck_member=slowest if bneck > 0 else None,
        imbalance=_ratio(bneck, fastest),
        utilisation=statistics.fmean(v / bneck for v in stage_ms.values()) if bneck > 0 else None,
        tokens_per_s=statistics.median(rates) if rates else None,
        tokens_per_s_spread=(max(rates) - min(rates)) / 2 if rates else None,
        prediction_error=statistics.median(errors) if errors else None,
        circuit_ms=statistics.median(r.circuit_ms for r in reqs),
        ttft_prefill_s=statistics.median(r.prefill_s for r in reqs),
        ttft_queue_s=statistics.median(r.queue_s for r in reqs),
        transit_ms=statistics.median(r.transit_ms for r in reqs),
        cold_dropped=cold_dropped,
    )


def _stage(r: RequestRecord, member: str) -> StageTrace:
    for s in r.stages:
        if s.member == member:
            return s
    raise ValueError(f"request {r.request_id} has no stage for member {member}")


def _cell(v: float | None, spec: str, width: int) -> str:
    """`v` formatted by `spec` (`width` wide), or "-" in its place where the figure is undefined."""
    return format(v, spec) if v is not None else "-".rjust(width)


def format_table(summaries: list[Summary]) -> str:
    head = (
        f"{'session':<14} {'division':<8} {'reqs':>4} {'imbal':>6} {'bneck ms':>9} {'util':>5} "
        f"{'tok/s':>13} {'pred err':>8} {'circuit ms':>10} {'transit ms':>10} {'prefill s':>9}  bottleneck"
    )
    rows = [head]
    for s in summaries:
        rate = (
            f"{s.tokens_per_s:>7.1f} ±{s.tokens_per_s_spread or 0.0:<4.1f}"
            if s.tokens_per_s is not None
            else f"{'-':>7}{'':6}"
        )
        rows.append(
            f"{s.session[:14]:<14} {s.division:<8} {s.requests:>4} {_cell(s.imbalance, '>6.2f', 6)} "
            f"{s.bottleneck_ms:>9.2f} {_cell(s.utilisation, '>5.0%', 5)} "
            f"{rate} {_cell(s.prediction_error, '>8.0%', 8)} {s.circuit_ms:>10.2f} {s.transit_ms:>10.2f} "
            f"{s.ttft_prefill_s:>9.3f}  {s.bottleneck_member or '-'}"
        )
    return "\n".join(rows)


@dataclass(frozen=True)
class StageSummary:
    """One member's stage over its stage records: medians per request, the first dropped as cold unless
    it is the only one (`cold_dropped` says which)."""

    session: str
    member: str
    index: int
    blocks: tuple[int, int]
    requests: int
    decode_ms: float  # median over requests of the median compute per decode step
    predicted_ms: float
    prediction_error: float | None  # median |predicted - measured| / measured (None: none measured > 0)
    prefill_chunk_ms: float  # median compute of one prefill chunk
    wait_ms: float  # median over requests of the median wait before a decode step's compute
    bytes_in: float  # median bytes received per request from the previous member
    bytes_out: float  # median bytes sent per request to the next member
    rtt_ms: float | None  # median measured round trip of the link to the next member
    predicted_rtt_ms: float | None
    cold_dropped: bool = False  # the member's first request is not counted


def summarize_stages(records: Iterable[Record], drop_cold: bool = True) -> list[StageSummary]:
    """One row per member from its stage records with decode steps. Records of one member at
    different stages or blocks raise ValueError naming them."""
    by_member: dict[tuple[str, str], list[StageRecord]] = {}
    for r in records:
        if isinstance(r, StageRecord) and r.decode_steps > 0:
            by_member.setdefault((r.session, r.member), []).append(r)
    return [_warm(recs, stage_mismatch, drop_cold, _summarize_stage) for recs in by_member.values()]


def _summarize_stage(recs: list[StageRecord], cold_dropped: bool) -> StageSummary:
    first = recs[0]
    chunks = [ms for r in recs for ms in r.prefill_ms]
    rtts = [r.hop_out.rtt_ms for r in recs if r.hop_out is not None and r.hop_out.rtt_ms is not None]
    errors = [abs(r.predicted_ms - r.decode_ms) / r.decode_ms for r in recs if r.decode_ms > 0]
    return StageSummary(
        session=first.session,
        member=first.member,
        index=first.index,
        blocks=first.blocks,
        requests=len(recs),
        decode_ms=statistics.median(r.decode_ms for r in recs),
        predicted_ms=first.predicted_ms,
        prediction_error=statistics.median(errors) if errors else None,
        prefill_chunk_ms=statistics.median(chunks) if chunks else 0.0,
        wait_ms=statistics.median(r.wait_ms for r in recs),
        bytes_in=statistics.median(r.hop_in.bytes if r.hop_in else 0 for r in recs),
        bytes_out=statistics.median(r.hop_out.bytes if r.hop_out else 0 for r in recs),
        rtt_ms=statistics.median(rtts) if rtts else None,
        predicted_rtt_ms=first.hop_out.predicted_rtt_ms if first.hop_out else None,
        cold_dropped=cold_dropped,
    )


def format_stage_table(summaries: list[StageSummary]) -> str:
    head = (
        f"{'session':<14} {'member':<12} {'stage':>5} {'blocks':>8} {'reqs':>4} {'decode ms':>9} "
        f"{'pred ms':>8} {'pred err':>8} {'wait ms':>7} {'chunk ms':>8} {'in B/req':>9} {'out B/req':>9} "
        f"{'rtt ms':>7} {'pred rtt':>8}"
    )
    rows = [head]
    for s in summaries:
        rtt = f"{s.rtt_ms:>7.2f}" if s.rtt_ms is not None else f"{'-':>7}"
        prtt = f"{s.predicted_rtt_ms:>8.2f}" if s.predicted_rtt_ms is not None else f"{'-':>8}"
        rows.append(
            f"{s.session[:14]:<14} {s.member[:12]:<12} {s.index:>5} {s.blocks[0]:>3}-{s.blocks[1]:<4} "
            f"{s.requests:>4} {s.decode_ms:>9.2f} {s.predicted_ms:>8.2f} "
            f"{_cell(s.prediction_error, '>8.0%', 8)} "
            f"{s.wait_ms:>7.2f} {s.prefill_chunk_ms:>8.2f} {s.bytes_in:>9.0f} {s.bytes_out:>9.0f} "
            f"{rtt} {prtt}"
        )
    return "\n".join(rows)
