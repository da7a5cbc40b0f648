"""Every Prometheus metric a member exports, defined once, fed from trace records and session state.

Conventions (what `promtool check metrics` checks, and what vLLM's dashboards expect):
- base units in the name: `_seconds`, `_bytes`; counters end in `_total` in the exposition;
- the `kafila_` prefix with vLLM's stems where the meaning matches (`kafila_time_to_first_token_seconds`
  for `vllm:time_to_first_token_seconds`, `kafila_num_requests_running`, `kafila_kv_cache_usage_perc`,
  `kafila_prompt_tokens_total`, `kafila_generation_tokens_total`, `kafila_e2e_request_latency_seconds`,
  `kafila_inter_token_latency_seconds`, `kafila_request_queue_time_seconds`);
- every series carries `session` (the session code's public part) and `model` once a session is
  known (`set_identity`, which `observe_session` calls): the registry adds them at scrape time, so
  a series never needs them in its own labels;
- `member` is the member's name in the session, `stage` its ring position (0 = head), `hop` an
  edge "src->dst" with its `path` (direct, relay, or local in-process).

Feeds:
- from trace records (kafila.obs.trace), so traces and metrics agree: `observe_stage` (every member:
  its own stage's gauges and the round trip of the hop it sends on), `observe_request` (the head:
  request-level series and the ring's per-stage gauges), `observe_no_token` (a request that ended
  before its first token), `observe_session` (the plan);
- as a request runs, so a long request shows while it runs: `observe_step` (each decode step and
  prefill chunk of a stage), `observe_first_token`, `observe_tokens` and `observe_token_interval`
  (the head, per token), `observe_circuit` (the head, per decode step), `observe_hop_frame` (each
  hidden-state frame at its sender, so each hop's bytes are counted once in the fleet);
- from a ring channel's link, as each hidden-state frame's ACK comes: `observe_hop_transfer`;
- from the session's state: `observe_state`, `observe_members`, `observe_plan`, `observe_queue`,
  `observe_kv_cache`, `observe_member_nat`, `observe_edge`, `observe_build`; and
  `observe_document`, which reads what it can of a member's /session document at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

import kafila
from kafila.obs.log import get_logger
from kafila.obs.trace import RequestRecord, SessionRecord, StageRecord

log = get_logger("kafila.obs.metrics")
SESSION_STATES = ("forming", "spare", "serving", "replanning", "broken", "ended")
PATHS = ("direct", "relay", "local")
# latency buckets in seconds, from a fast local stage step to a slow relayed request
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class SessionRegistry(CollectorRegistry):
    """A registry that adds the session's identity labels (`session`, `model`) to every sample it
    exposes, once they are known: a member process serves one session of one model."""

    def __init__(self) -> None:
        super().__init__(auto_describe=True)
        self._identity: dict[str, str] = {}
        self._identity_lock = threading.Lock()
        self.source: Callable[[], Mapping[str, Any]] | None = None  # the /session document, read per scrape

    def set_identity(self, session: str, model: str) -> None:
        with self._identity_lock:
            self._identity = {k: v for k, v in (("session", session), ("model", model)) if v}

    def identity(self) -> dict[str, str]:
        with self._identity_lock:
            return dict(self._identity)

    def collect(self) -> Iterator[Metric]:
        self._refresh()
        extra = self.identity()
        for metric in super().collect():
            if extra:
                metric.samples = [s._replace(labels={**s.labels, **extra}) for s in metric.samples]
            yield metric

    def _refresh(self) -> None:
        source = self.source
        if source is None:
            return
        try:
            doc = source()
        except Exception as exc:  # a scrape must not fail on the session's state (read from another thread)
            log.warning("metrics_source_failed", error=repr(exc))
            return
        observe_document(doc)


disable_created_metrics()  # type: ignore[no-untyped-call]  # no `_created` series beside every counter and histogram
REGISTRY = SessionRegistry()
ProcessCollector(registry=REGISTRY)  # process_cpu_seconds_total, process_resident_memory_bytes, ...

# -- build and session --------------------------------------------------------------------------------

BUILD_INFO = Gauge(
    "kafila_build_info",
    "Always 1: the Kafila version, compute backend, dtype and device kind of this member",
    ["version", "backend", "dtype", "device"],
    registry=REGISTRY,
)
SESSION_STATE = Gauge(
    "kafila_session_state",
    "1 for the state the session is in (forming, spare, serving, replanning, broken, ended), 0 for others",
    ["state"],
    registry=REGISTRY,
)
READY = Gauge("kafila_ready", "1 while this member serves requests, 0 otherwise", registry=REGISTRY)
MEMBERS_EXPECTED = Gauge(
    "kafila_session_members_expected", "Members the session was formed for", registry=REGISTRY
)
MEMBERS_PRESENT = Gauge(
    "kafila_session_members_present", "Members in the ring now (0 once it broke)", registry=REGISTRY
)
SPARES = Gauge(
    "kafila_session_spares",
    "Members the host keeps as spares, out of the ring (the host's /session `spares`; the host only)",
    registry=REGISTRY,
)
PLAN_EPOCH = Gauge(
    "kafila_plan_epoch", "Epoch of the plan the ring runs (1 = the first plan)", registry=REGISTRY
)
REPLANS = Counter("kafila_replans", "Plans that replaced an earlier plan of this session", registry=REGISTRY)
STALE_FRAMES = Counter(
    "kafila_ring_stale_frames",
    "Ring messages dropped undecoded because they carried another plan epoch than their channel's",
    ["peer"],
    registry=REGISTRY,
)
WEIGHT_BYTES = Counter(
    "kafila_weight_fetched_bytes",
    "Checkpoint bytes this member fetched and checked against the manifest's digests, by where they "
    "came from (peer, mirror, host)",
    ["source"],
    registry=REGISTRY,
)
MEMBER_NAT = Gauge(
    "kafila_member_nat_info",
    "Always 1: a member's NAT class (permissive, ordinary, restrictive, ...) and mapping behaviour",
    ["member", "nat_class", "mapping"],
    registry=REGISTRY,
)
EDGE_PATH = Gauge(
    "kafila_edge_info",
    "Always 1: a ring edge of the plan epoch `epoch`, the path the plan chose for it, the path it runs "
    "(measured by `measured_by`, or `predicted` when no end of it measured yet)",
    ["edge", "planned_path", "path", "measured_by", "epoch"],
    registry=REGISTRY,
)

# -- queue and cache ------------------------------------------------------------------------------------

REQUESTS_RUNNING = Gauge(
    "kafila_num_requests_running", "Requests admitted to the ring (decoding or in prefill)", registry=REGISTRY
)
REQUESTS_WAITING = Gauge("kafila_num_requests_waiting", "Requests queued at the head", registry=REGISTRY)
SLOTS_USED = Gauge(
    "kafila_request_slots_used",
    "Request slots in use at the head: requests admitted to the ring, each holding a KV-cache slot",
    registry=REGISTRY,
)
SLOTS_TOTAL = Gauge(
    "kafila_request_slots", "Request slots of the session (its --concurrency), in all", registry=REGISTRY
)
KV_BYTES_USED = Gauge(
    "kafila_kv_cache_used_bytes",
    "KV-cache bytes of this member's stage that hold cached positions of open requests",
    ["member"],
    registry=REGISTRY,
)
KV_BYTES = Gauge(
    "kafila_kv_cache_bytes",
    "KV-cache bytes this member's stage holds in memory (context x concurrency, allocated at load)",
    ["member"],
    registry=REGISTRY,
)
KV_USAGE = Gauge(
    "kafila_kv_cache_usage_perc",
    "KV-cache memory of this member's stage in use: cached positions' bytes over the bytes held (1 = full)",
    ["member"],
    registry=REGISTRY,
)

# -- stages and hops ------------------------------------------------------------------------------------

STAGE_COMPUTE = Histogram(
    "kafila_stage_compute_seconds",
    "Compute of a stage for each decode step of each request (phase=decode) and each prefill chunk "
    "(phase=prefill), observed as the step ran",
    ["member", "stage", "phase"],
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
STAGE_BLOCKS = Gauge(
    "kafila_stage_blocks",
    "Transformer blocks a stage of plan epoch `epoch` holds, [first_block, last_block); stage 0 is the head",
    ["member", "stage", "first_block", "last_block", "epoch"],
    registry=REGISTRY,
)
STAGE_MEASURED = Gauge(
    "kafila_stage_measured_seconds",
    "Median compute per decode step of a stage in the last request that decoded in plan epoch `epoch`",
    ["member", "stage", "epoch"],
    registry=REGISTRY,
)
STAGE_PREDICTED = Gauge(
    "kafila_stage_predicted_seconds",
    "Planner's predicted compute per decode step of a stage in plan epoch `epoch`",
    ["member", "stage", "epoch"],
    registry=REGISTRY,
)
STAGE_RATIO = Gauge(
    "kafila_stage_prediction_ratio",
    "Measured over predicted compute per decode step of a stage, last request that decoded in plan epoch "
    "`epoch` (1 = as planned)",
    ["member", "stage", "epoch"],
    registry=REGISTRY,
)
STAGE_WAIT = Gauge(
    "kafila_stage_wait_seconds",
    "Median wait of a decode step at a member before its compute started, last request in plan epoch `epoch`",
    ["member", "stage", "epoch"],
    registry=REGISTRY,
)
STAGE_DECODE_STEPS = Counter(
    "kafila_stage_decode_steps",
    "Decode steps a stage computed, once per request in a step (a batched step of two counts two), "
    "counted as the step ran",
    ["member", "stage"],
    registry=REGISTRY,
)
HOP_BYTES = Counter(
    "kafila_hop_bytes",
    "Hidden-state bytes sent over a ring edge, counted on the link by its sender as each frame left",
    ["hop", "path"],
    registry=REGISTRY,
)
HOP_MESSAGES = Counter(
    "kafila_hop_messages",
    "Hidden-state frames sent over a ring edge, once per request a frame carries, counted as each left",
    ["hop", "path"],
    registry=REGISTRY,
)
HOP_RTT = Gauge(
    "kafila_hop_rtt_seconds",
    "Measured round trip of a ring edge (QUIC smoothed RTT at its sender as its last frame left)",
    ["hop", "path"],
    registry=REGISTRY,
)
HOP_TRANSFER = Histogram(
    "kafila_hop_transfer_seconds",
    "Time of each hidden-state frame over a ring edge's link, on its sender's clock: from handing it to the "
    "link until the receiver's ACK of its last byte came back, less the time the receiver held that "
    "ACK (its way there, queueing and resends included, and an ACK's way back)",
    ["hop", "path"],
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
HOP_PREDICTED_RTT = Gauge(
    "kafila_hop_predicted_rtt_seconds",
    "Round trip the plan of epoch `epoch` priced for a ring edge",
    ["hop", "epoch"],
    registry=REGISTRY,
)

HTTP_RESPONSES = Counter(
    "kafila_http_responses",
    "HTTP responses of this member's API by route (its path template; other: no route) and status",
    ["route", "status"],
    registry=REGISTRY,
)

# -- requests (the head) --------------------------------------------------------------------------------

REQUESTS = Counter(
    "kafila_requests",
    "Requests ended at the head, by finish reason (stop, length, cancelled, error; refused: queue full)",
    ["finished_reason"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter(
    "kafila_prompt_tokens",
    "Prompt tokens through the ring, counted as each request's first token came",
    registry=REGISTRY,
)
TOKENS = Counter(
    "kafila_generation_tokens",
    "Tokens the head sampled, a stop token included (the API's usage leaves it out), counted as each was",
    registry=REGISTRY,
)
E2E = Histogram(
    "kafila_e2e_request_latency_seconds",
    "Request time at the head from arrival to last token (queue + prefill + decode)",
    buckets=REQUEST_BUCKETS,
    registry=REGISTRY,
)
TTFT = Histogram(
    "kafila_time_to_first_token_seconds",
    "Time from a request's arrival at the head to its first token (queue + prefill)",
    buckets=REQUEST_BUCKETS,
    registry=REGISTRY,
)
QUEUE_TIME = Histogram(
    "kafila_request_queue_time_seconds",
    "Time a request waited in the head's queue before admission",
    buckets=REQUEST_BUCKETS,
    registry=REGISTRY,
)
PREFILL_TIME = Histogram(
    "kafila_request_prefill_time_seconds",
    "Time from admission to the first token: the prompt through the whole ring",
    buckets=REQUEST_BUCKETS,
    registry=REGISTRY,
)
ITL = Histogram(
    "kafila_inter_token_latency_seconds",
    "Time between two tokens of a request, each interval observed as its token was sampled",
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
# -- speculative decoding (the head; vLLM's names) ------------------------------------------------------

SPEC_DRAFTS = Counter(
    "kafila_spec_decode_num_drafts",
    "Decode steps that carried drafted tokens to verify",
    registry=REGISTRY,
)
SPEC_DRAFT_TOKENS = Counter(
    "kafila_spec_decode_num_draft_tokens", "Drafted tokens verified", registry=REGISTRY
)
SPEC_ACCEPTED = Counter("kafila_spec_decode_num_accepted_tokens", "Drafted tokens kept", registry=REGISTRY)
SPEC_ACCEPTED_PER_POS = Counter(
    "kafila_spec_decode_num_accepted_tokens_per_pos",
    "Drafted tokens kept, by their place in the draft (0: the first)",
    ["position"],
    registry=REGISTRY,
)
CIRCUITS = Counter(
    "kafila_decode_circuits",
    "Decode steps that went around the ring and came back to be sampled",
    registry=REGISTRY,
)
TOKENS_PER_CIRCUIT = Histogram(
    "kafila_decode_tokens_per_circuit",
    "Tokens a request took from one decode step (1 without drafts; kept drafts + 1 with them)",
    buckets=(0, 1, 2, 3, 4, 5, 6, 8, 10, 12, 16),
    registry=REGISTRY,
)
DECODE_RATE = Gauge(
    "kafila_decode_tokens_per_second",
    "Decode tokens per second of the last request that decoded",
    registry=REGISTRY,
)
CIRCUIT = Gauge(
    "kafila_ring_circuit_seconds",
    "Median time around the ring per decode step, last request that decoded",
    registry=REGISTRY,
)
TRANSIT = Gauge(
    "kafila_ring_transit_seconds",
    "Circuit minus every stage's compute per decode step, last request: time on hops and waiting",
    registry=REGISTRY,
)
PREDICTED_BOTTLENECK = Gauge(
    "kafila_predicted_bottleneck_seconds", "Plan's slowest stage per decode step", registry=REGISTRY
)
PREDICTED_CIRCUIT = Gauge(
    "kafila_predicted_circuit_seconds", "Plan's time around the ring per decode step", registry=REGISTRY
)
PREDICTED_TOKENS_PER_CIRCUIT = Gauge(
    "kafila_predicted_tokens_per_circuit",
    "Tokens a request takes from one decode step in the plan's figures: 1 as planned, the head's "
    "measured tokens per circuit once it counted enough circuits (its bottleneck and circuit then "
    "include the drafted rows)",
    registry=REGISTRY,
)


@dataclass
class _Ring:
    """The ring the series describe: the plan epoch, its order and its ring edges' planned paths."""

    epoch: int = 0  # 0: no ring yet
    order: tuple[str, ...] = ()
    planned: dict[str, str] = field(default_factory=dict)  # "a->b": the path the plan chose
    expected: int = 0  # the most members a ring of this session had

    def stages(self) -> set[tuple[str, str]]:
        return {(m, str(i)) for i, m in enumerate(self.order)}

    def hops(self) -> set[str]:
        n = len(self.order)
        return {f"{self.order[i]}->{self.order[(i + 1) % n]}" for i in range(n)} if n > 1 else set()


_ring = _Ring()
_epoch: list[int] = []  # the last plan epoch seen (empty before the first)
_lock = threading.RLock()


def set_source(describe: Callable[[], Mapping[str, Any]] | None) -> None:
    """Read `describe()` (a member's /session document) at every scrape: `observe_document`."""
    REGISTRY.source = describe


def set_identity(session: str, model: str) -> None:
    """Every series carries `session` (the session code's public part) and `model` from now on."""
    REGISTRY.set_identity(session, model)


def observe_build(backend: str, dtype: str, device: str, version: str = kafila.__version__) -> None:
    """`kafila_build_info` of this member: once its model's backend, dtype and device are known."""
    BUILD_INFO.clear()
    BUILD_INFO.labels(version, backend, dtype, device).set(1)


BUILD_INFO.labels(kafila.__version__, "unknown", "unknown", "unknown").set(1)


# -- from trace records ----------------------------------------------------------------------------------


def observe_step(member: str, index: int, seconds: float, prefill: bool, session: str = "") -> None:
    """One step of one request computed at member `member`'s stage `index` (a decode step or a
    prefill chunk), as it ran: a stall reaches the histogram's tail at once. A step of a stage the
    ring no longer has (a late step of the epoch before) is left out."""
    _follow(session)
    stage = str(index)
    if not _in_ring(member, stage):
        return
    STAGE_COMPUTE.labels(member, stage, "prefill" if prefill else "decode").observe(seconds)
    if not prefill:
        STAGE_DECODE_STEPS.labels(member, stage).inc()


def observe_hop_transfer(hop: str, path: str, seconds: float) -> None:
    """One hidden-state frame's transfer over ring edge `hop` ("src->dst") on `path`, timed at its
    sender (kafila.net.link, `delivered`). A frame of an edge the ring no longer has is left out."""
    with _lock:
        if _ring.order and hop not in _ring.hops():
            return
    HOP_TRANSFER.labels(hop, path).observe(seconds)


def observe_hop_frame(
    hop: str, path: str, nbytes: int, requests: int, rtt_s: float | None = None, session: str = ""
) -> None:
    """One hidden-state frame of `nbytes` carrying `requests` requests' entries sent over ring
    edge `hop` on `path`, counted at its sender as it leaves, with the link's round trip `rtt_s`
    then (None: no network in between), so a long request's bytes and round trip show while it
    runs. A frame of an edge the ring no longer has is left out."""
    _follow(session)
    with _lock:
        if _ring.order and hop not in _ring.hops():
            return
    HOP_BYTES.labels(hop, path).inc(nbytes)
    HOP_MESSAGES.labels(hop, path).inc(requests)
    if rtt_s is not None:
        _set_rtt(hop, path, rtt_s)


def observe_first_token(queue_s: float, prefill_s: float, prompt_tokens: int) -> None:
    """A request's first token at the head, after `queue_s` waiting for a slot and `prefill_s`
    from its admission (its `prompt_tokens` through the whole ring)."""
    PROMPT_TOKENS.inc(prompt_tokens)
    QUEUE_TIME.observe(queue_s)
    PREFILL_TIME.observe(prefill_s)
    TTFT.observe(queue_s + prefill_s)


def observe_tokens(n: int) -> None:
    """`n` tokens the head just sampled from one step (a stop token included)."""
    TOKENS.inc(n)


def observe_token_interval(seconds: float) -> None:
    """The time from a request's last token to the token just sampled (the head, per token)."""
    ITL.observe(seconds)


def observe_circuit(tokens: int, drafted: int, accepted: int) -> None:
    """A decode step came back and gave a request `tokens` tokens, keeping `accepted` of the
    `drafted` tokens it carried."""
    CIRCUITS.inc()
    TOKENS_PER_CIRCUIT.observe(tokens)
    if drafted:
        SPEC_DRAFTS.inc()
        SPEC_DRAFT_TOKENS.inc(drafted)
        SPEC_ACCEPTED.inc(accepted)
        for position in range(accepted):
            SPEC_ACCEPTED_PER_POS.labels(str(position)).inc()


def observe_stage(r: StageRecord) -> None:
    """A member's own stage and the hop it sends on, when a request ended there (its steps were
    observed as they ran, `observe_step`, and its frames' bytes as they left, `observe_hop_frame`)."""
    _follow(r.session)
    stage, epoch = str(r.index), _epoch_label()
    if not _in_ring(r.member, stage):
        return
    if r.decode_steps:
        STAGE_MEASURED.labels(r.member, stage, epoch).set(r.decode_ms / 1000)
        STAGE_WAIT.labels(r.member, stage, epoch).set(r.wait_ms / 1000)
        _set_ratio(r.member, stage, r.decode_ms, r.predicted_ms)
    STAGE_PREDICTED.labels(r.member, stage, epoch).set(r.predicted_ms / 1000)
    h = r.hop_out
    if h is None:
        return
    if h.rtt_ms is not None:
        _set_rtt(h.name, h.path, h.rtt_ms / 1000)
    if h.predicted_rtt_ms is not None:
        HOP_PREDICTED_RTT.labels(h.name, epoch).set(h.predicted_rtt_ms / 1000)
    with _lock:
        planned = _ring.planned.get(h.name)
    if planned is not None and h.path != "local":
        observe_edge(h.name, planned, h.path, measured_by=r.member)


def observe_request(r: RequestRecord) -> None:
    """The head's whole-ring view of one request (gauges per stage; hop counters come from
    `observe_hop_frame` at each sender, so a hop is counted once; the first token's times, the
    tokens and their intervals were observed as each token came: `observe_first_token`,
    `observe_tokens`, `observe_token_interval`). The "last request" gauges keep the last request
    that decoded: one that ended at its first token measured no decode step."""
    _follow(r.session)
    decoded = any(s.steps for s in r.stages)
    epoch = _epoch_label()
    for s in r.stages:
        if not _in_ring(s.member, str(s.index)):
            continue  # a request carried over a re-plan names the stages it ran through before
        if s.steps:
            STAGE_MEASURED.labels(s.member, str(s.index), epoch).set(s.measured_ms / 1000)
            _set_ratio(s.member, str(s.index), s.measured_ms, s.predicted_ms)
        STAGE_PREDICTED.labels(s.member, str(s.index), epoch).set(s.predicted_ms / 1000)
    REQUESTS.labels(r.finish).inc()
    E2E.observe(r.ttft_s + r.decode_s)
    if decoded:
        DECODE_RATE.set(r.tokens_per_s)
        CIRCUIT.set(r.circuit_ms / 1000)
        TRANSIT.set(r.transit_ms / 1000)


def observe_no_token(finish: str) -> None:
    """A request that ended before its first token (cancelled while queued or in prefill, failed)."""
    REQUESTS.labels(finish).inc()


def observe_session(s: SessionRecord, ring_view: bool = True, epoch: int = 1) -> None:
    """The plan of epoch `epoch` a member's ring was built for: its identity on every series, its
    bottleneck and circuit, its edges as predicted, and every stage's prediction where
    `ring_view` (the head's, as its request records set them)."""
    _identify(s.session, s.model)
    predicted = {m: ms / 1000 for m, ms in s.predicted_stage_ms.items()} if ring_view else {}
    _rebuild(epoch, s.order, s.blocks, predicted, s.edges)
    PREDICTED_BOTTLENECK.set(s.predicted_bottleneck_ms / 1000)
    PREDICTED_CIRCUIT.set(s.predicted_circuit_ms / 1000)
    observe_state("serving")


# -- the ring, rebuilt at each plan epoch -----------------------------------------------------------------


def observe_ring(doc: Mapping[str, Any]) -> None:
    """The ring a member's /session document describes now (its `ring`, `members`, `links` and
    `epoch`): at a new epoch, or a new ring, every series that describes the ring is rebuilt from
    it, the series of members and edges that left removed; at every read the edges' paths, the
    members present and the plan's predicted figures follow the document."""
    order, epoch = doc.get("ring"), doc.get("epoch")
    members = doc.get("members")
    if not (isinstance(order, list) and isinstance(epoch, int) and isinstance(members, list)):
        return
    ring = tuple(str(m) for m in order)
    _identify(str(doc.get("session") or ""), str(doc.get("model") or ""))
    with _lock:
        same = (_ring.epoch, _ring.order) == (epoch, ring)
    if not same:
        me, head = doc.get("me"), doc.get("head")
        blocks = {str(m["name"]): (int(m["blocks"][0]), int(m["blocks"][1])) for m in members}
        predicted = {
            str(m["name"]): float(m["predicted_ms"]) / 1000
            for m in members
            if isinstance(m.get("predicted_ms"), int | float) and (me == head or m["name"] == me)
        }
        planned = {
            str(link["edge"]): str(link["planned_path"])
            for link in doc.get("links") or []
            if link.get("planned_path") is not None
        }
        _rebuild(epoch, ring, blocks, predicted, planned)
    _predicted_from((doc.get("plan") or {}).get("chosen") or {})
    observe_plan(epoch)
    spares = doc.get("spares")
    if isinstance(spares, list):
        SPARES.set(len(spares))
    _edges_from(doc.get("links") or [])
    MEMBERS_PRESENT.set(0 if doc.get("state") in ("broken", "ended") else len(ring))


def _predicted_from(chosen: Mapping[str, Any]) -> None:
    """The plan's figures as the document gives them now (the head's: priced for the tokens per
    circuit it measured, once it counted enough)."""
    for key, gauge, scale in (
        ("bottleneck_ms", PREDICTED_BOTTLENECK, 1000),
        ("circuit_ms", PREDICTED_CIRCUIT, 1000),
        ("tokens_per_circuit", PREDICTED_TOKENS_PER_CIRCUIT, 1),
    ):
        if isinstance(value := chosen.get(key), int | float):
            gauge.set(value / scale)


def _rebuild(
    epoch: int,
    order: tuple[str, ...],
    blocks: Mapping[str, tuple[int, int]],
    predicted_s: Mapping[str, float],
    planned: Mapping[str, str],
) -> None:
    """Every series of the ring, for plan epoch `epoch`'s `order` (stage i is order[i])."""
    e = str(epoch)
    with _lock:
        _ring.epoch, _ring.order, _ring.planned = epoch, tuple(order), dict(planned)
        _ring.expected = max(_ring.expected, len(order))
        stages, hops, expected = _ring.stages(), _ring.hops(), _ring.expected
        STAGE_BLOCKS.clear()
        for i, member in enumerate(order):
            first, last = blocks.get(member, (0, 0))
            STAGE_BLOCKS.labels(member, str(i), str(first), str(last), e).set(last - first)
        STAGE_PREDICTED.clear()
        for i, member in enumerate(order):
            if member in predicted_s:
                STAGE_PREDICTED.labels(member, str(i), e).set(predicted_s[member])
        for g in (STAGE_MEASURED, STAGE_RATIO, STAGE_WAIT):
            _remove(g, lambda k: k[2] != e or (k[0], k[1]) not in stages)
        for per_stage in (STAGE_COMPUTE, STAGE_DECODE_STEPS):
            _remove(per_stage, lambda k: (k[0], k[1]) not in stages)
        for per_hop in (HOP_BYTES, HOP_MESSAGES, HOP_RTT, HOP_TRANSFER):
            _remove(per_hop, lambda k: k[0] not in hops)
        _remove(HOP_PREDICTED_RTT, lambda k: k[1] != e or k[0] not in hops)
        EDGE_PATH.clear()
        for edge, path in planned.items():
            EDGE_PATH.labels(edge, path, path, "predicted", e).set(1)
    MEMBERS_EXPECTED.set(expected)
    MEMBERS_PRESENT.set(len(order))


def _edges_from(links: Iterable[Mapping[str, Any]]) -> None:
    """kafila_edge_info as a /session document's links say: each ring edge of the plan on the
    path its link runs (measured by this member), or the plan's (`predicted`); a closed link's edge
    has no path to show."""
    with _lock:
        for link in links:
            edge, planned = str(link.get("edge")), link.get("planned_path")
            if planned is None or edge not in _ring.planned:
                continue
            path, by = link.get("path"), link.get("measured_by")
            if path in PATHS:
                observe_edge(edge, str(planned), str(path), measured_by=str(by) if by else "predicted")
            else:
                _remove(EDGE_PATH, lambda k, edge=edge: k[0] == edge)  # type: ignore[misc]


# -- from the session's state ----------------------------------------------------------------------------
def observe_response(route: str, status: int) -> None:
    """One HTTP response of the member's API (kafila.obs.http)."""
    HTTP_RESPONSES.labels(route, str(status)).inc()


def observe_state(state: str) -> None:
    """The session's state: one of SESSION_STATES."""
    if state not in SESSION_STATES:
        raise ValueError(f"session state {state!r} is not one of {', '.join(SESSION_STATES)}")
    for s in SESSION_STATES:
        SESSION_STATE.labels(s).set(1 if s == state else 0)
    READY.set(1 if state == "serving" else 0)
    if state in ("broken", "ended"):
        MEMBERS_PRESENT.set(0)


def observe_members(expected: int, present: int) -> None:
    """Members the session holds at most (`expected`) and members in its ring now (`present`)."""
    with _lock:
        _ring.expected = max(_ring.expected, expected)
    MEMBERS_EXPECTED.set(expected)
    MEMBERS_PRESENT.set(present)


def observe_plan(epoch: int) -> None:
    """The plan epoch the ring runs; a later epoch than the last seen counts one re-plan."""
    with _lock:
        if _epoch and epoch > _epoch[0]:
            REPLANS.inc()
        _epoch[:] = [epoch]
    PLAN_EPOCH.set(epoch)


def observe_stale_frame(peer: str) -> None:
    """A ring message from `peer` of another plan epoch, dropped (kafila.proto.epoch)."""
    STALE_FRAMES.labels(peer).inc()


def observe_weight_bytes(source: str, nbytes: int) -> None:
    """`nbytes` of weights fetched from a `source` kind (peer, mirror, host), each range checked."""
    WEIGHT_BYTES.labels(source).inc(nbytes)


def observe_queue(running: int, waiting: int) -> None:
    """Requests admitted to the ring and requests queued at the head."""
    REQUESTS_RUNNING.set(running)
    REQUESTS_WAITING.set(waiting)


def observe_slots(used: int, total: int) -> None:
    """Request slots in use and in all at the head (a slot is one admitted request's KV cache)."""
    if not 0 <= used <= total:
        raise ValueError(f"request slots: {used} used of {total} is not a count within the total")
    SLOTS_USED.set(used)
    SLOTS_TOTAL.set(total)


def observe_kv_bytes(member: str, used: int, held: int) -> None:
    """KV-cache bytes of member `member`'s stage: holding cached positions, and held in memory."""
    if not 0 <= used <= held:
        raise ValueError(f"KV cache of {member}: {used} bytes used is not within the {held} bytes held")
    for g in (KV_BYTES_USED, KV_BYTES, KV_USAGE):
        _remove(g, lambda k: k[0] != member)  # a process holds one member's stage
    KV_BYTES_USED.labels(member).set(used)
    KV_BYTES.labels(member).set(held)
    KV_USAGE.labels(member).set(used / held if held else 0.0)


def observe_member_nat(member: str, nat_class: str, mapping: str) -> None:
    """A member's NAT class and mapping behaviour (from its probe), one series per member."""
    _remove(MEMBER_NAT, lambda k: k[0] == member)
    MEMBER_NAT.labels(member, nat_class, mapping).set(1)


def observe_edge(edge: str, planned: str, path: str, measured_by: str) -> None:
    """The path ring edge `edge` of the ring's plan runs: measured by member `measured_by` (or
    "predicted"). An edge the plan has not (a link of a ring re-planned away) is left out."""
    with _lock:
        if edge not in _ring.planned:
            return
        _remove(EDGE_PATH, lambda k: k[0] == edge)
        EDGE_PATH.labels(edge, planned, path, measured_by, _epoch_label()).set(1)


def observe_document(doc: Mapping[str, Any]) -> None:
    """What a member's /session document says at scrape time: its state, its ring (`observe_ring`),
    its stage's KV cache ("kv") and, on the head, its queue ("active" and "queued") and request
    slots ("slots", its concurrency). A document without a state (no session yet) changes nothing."""
    state = doc.get("state")
    if state in SESSION_STATES:
        observe_state(str(state))
    # kafila.api.forming.FormingStatus: a member forming, or a spare (whose first scrape may come
    # after its host made it one), is of its session from its first scrape
    if state in ("forming", "spare") and isinstance(doc.get("session"), str):
        _identify(str(doc["session"]), str(doc.get("model") or ""))
        if isinstance(expected := doc.get("members_expected"), int):
            observe_members(expected, 0)
    observe_ring(doc)
    kv = doc.get("kv")
    if isinstance(kv, dict) and isinstance(doc.get("me"), str):
        used, held = kv.get("used_bytes"), kv.get("bytes")
        if isinstance(used, int) and isinstance(held, int) and 0 <= used <= held:
            observe_kv_bytes(str(doc["me"]), used, held)
    active = doc.get("active")
    if isinstance(active, list) and isinstance(doc.get("queued"), int):
        observe_queue(len(active), int(doc["queued"]))
        slots = doc.get("slots")  # the head's concurrency: one KV-cache slot per admitted request
        if isinstance(slots, int) and 0 <= len(active) <= slots:
            observe_slots(len(active), slots)


def exposition() -> bytes:
    """The text a /metrics endpoint returns."""
    return generate_latest(REGISTRY)


# -- helpers ------------------------------------------------------------------------------------------


def _identify(session: str, model: str) -> None:
    """The session every series is of from now on; another session than before starts its ring
    series afresh (its epochs, and the most members a ring of it had, too)."""
    if session and REGISTRY.identity().get("session") != session:
        with _lock:
            _ring.expected = 0
            _epoch.clear()
            _rebuild(0, (), {}, {}, {})  # no ring yet: the other session's ring series go
    set_identity(session, model)


def _follow(session: str) -> None:
    """A record of `session`: where the series describe another session (a process serves one; a
    test process many), they start afresh for it, its model known at its next scrape."""
    if session and REGISTRY.identity().get("session") != session:
        _identify(session, "")


def _epoch_label() -> str:
    with _lock:
        return str(_ring.epoch or (_epoch[0] if _epoch else 1))


def _in_ring(member: str, stage: str) -> bool:
    """Whether the ring the series describe has `member` at stage `stage` (True before any ring)."""
    with _lock:
        return not _ring.order or (member, stage) in _ring.stages()


def _set_rtt(hop: str, path: str, seconds: float) -> None:
    _remove(HOP_RTT, lambda k: k[0] == hop and k[1] != path)  # the path it ran before
    HOP_RTT.labels(hop, path).set(seconds)


def _set_ratio(member: str, stage: str, measured_ms: float, predicted_ms: float) -> None:
    if predicted_ms > 0:
        STAGE_RATIO.labels(member, stage, _epoch_label()).set(measured_ms / predicted_ms)


def _label_sets(g: Gauge | Counter | Histogram) -> Iterable[tuple[str, ...]]:
    # every child's label values (prometheus_client keeps them there), copied under its lock: the
    # ring's series are rebuilt at a scrape while the event loop observes steps
    with g._lock:
        return [tuple(k) for k in g._metrics]


def _remove(g: Gauge | Counter | Histogram, which: Callable[[tuple[str, ...]], bool]) -> None:
    """Remove every child of `g` whose label values `which` picks."""
    for labels in [k for k in _label_sets(g) if which(k)]:
        g.remove(*labels)
