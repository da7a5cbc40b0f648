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
  its own stage and the hop it sends on, so each hop's bytes are counted once in the fleet),
  `observe_request` (the head: request-level series and the ring's per-stage gauges),
  `observe_no_token` (a request that ended before its first token), `observe_session` (the plan);
- from the session's state: `observe_state`, `observe_members`, `observe_plan`, `observe_queue`,
  `observe_kv_cache`, `observe_member_nat`, `observe_edge`, `observe_build`; and
  `observe_document`, which reads what it can of a member's /session document at scrape time.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.metrics_core import Metric

import kafila
from kafila.obs.log import get_logger
from kafila.obs.trace import RequestRecord, SessionRecord, StageRecord

log = get_logger("kafila.obs.metrics")
SESSION_STATES = ("forming", "serving", "replanning", "broken", "ended")
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
    "1 for the state the session is in (forming, serving, replanning, broken, ended), 0 for the others",
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
MEMBER_NAT = Gauge(
    "kafila_member_nat_info",
    "Always 1: a member's NAT class (permissive, ordinary, restrictive, ...) and mapping behaviour",
    ["member", "nat_class", "mapping"],
    registry=REGISTRY,
)
EDGE_PATH = Gauge(
    "kafila_edge_info",
    "Always 1: a ring edge, the path the plan chose for it, the path it runs (measured by `measured_by`, "
    "or `predicted` when no end of it measured yet)",
    ["edge", "planned_path", "path", "measured_by"],
    registry=REGISTRY,
)

# -- queue and cache ------------------------------------------------------------------------------------

REQUESTS_RUNNING = Gauge(
    "kafila_num_requests_running", "Requests admitted to the ring (decoding or in prefill)", registry=REGISTRY
)
REQUESTS_WAITING = Gauge("kafila_num_requests_waiting", "Requests queued at the head", registry=REGISTRY)
KV_SLOTS_USED = Gauge("kafila_kv_cache_slots_used", "KV-cache slots (requests) in use", registry=REGISTRY)
KV_SLOTS_TOTAL = Gauge(
    "kafila_kv_cache_slots", "KV-cache slots (concurrency) of the session, in all", registry=REGISTRY
)
KV_USAGE = Gauge(
    "kafila_kv_cache_usage_perc", "KV-cache use, slots used over slots total (1 = full)", registry=REGISTRY
)

# -- stages and hops ------------------------------------------------------------------------------------

STAGE_COMPUTE = Histogram(
    "kafila_stage_compute_seconds",
    "Compute of a stage per decode step (phase=decode; each step of a request at its median) and per "
    "prefill chunk (phase=prefill)",
    ["member", "stage", "phase"],
    buckets=STEP_BUCKETS,
    registry=REGISTRY,
)
STAGE_BLOCKS = Gauge(
    "kafila_stage_blocks",
    "Transformer blocks a stage holds, [first_block, last_block); stage 0 is the head",
    ["member", "stage", "first_block", "last_block"],
    registry=REGISTRY,
)
STAGE_MEASURED = Gauge(
    "kafila_stage_measured_seconds",
    "Median compute per decode step of a stage in the last request that decoded",
    ["member", "stage"],
    registry=REGISTRY,
)
STAGE_PREDICTED = Gauge(
    "kafila_stage_predicted_seconds",
    "Planner's predicted compute per decode step of a stage",
    ["member", "stage"],
    registry=REGISTRY,
)
STAGE_RATIO = Gauge(
    "kafila_stage_prediction_ratio",
    "Measured over predicted compute per decode step of a stage, last request that decoded (1 = as planned)",
    ["member", "stage"],
    registry=REGISTRY,
)
STAGE_WAIT = Gauge(
    "kafila_stage_wait_seconds",
    "Median wait of a decode step at a member before its compute started, last request",
    ["member", "stage"],
    registry=REGISTRY,
)
STAGE_DECODE_STEPS = Counter(
    "kafila_stage_decode_steps",
    "Decode steps a stage computed, once per request in a step (a batched step of two counts two)",
    ["member", "stage"],
    registry=REGISTRY,
)
HOP_BYTES = Counter(
    "kafila_hop_bytes",
    "Hidden-state bytes sent over a ring edge, counted on the link by its sender",
    ["hop", "path"],
    registry=REGISTRY,
)
HOP_MESSAGES = Counter(
    "kafila_hop_messages",
    "Hidden-state frames sent over a ring edge, once per request a frame carries",
    ["hop", "path"],
    registry=REGISTRY,
)
HOP_RTT = Gauge(
    "kafila_hop_rtt_seconds",
    "Measured round trip of a ring edge (QUIC smoothed RTT at the sender when its last request ended)",
    ["hop", "path"],
    registry=REGISTRY,
)
HOP_PREDICTED_RTT = Gauge(
    "kafila_hop_predicted_rtt_seconds",
    "Round trip the plan priced for a ring edge",
    ["hop"],
    registry=REGISTRY,
)

# -- requests (the head) --------------------------------------------------------------------------------

REQUESTS = Counter(
    "kafila_requests",
    "Requests ended at the head, by finish reason (stop, length, cancelled, error; refused: queue full)",
    ["finished_reason"],
    registry=REGISTRY,
)
PROMPT_TOKENS = Counter("kafila_prompt_tokens", "Prompt tokens of requests that ended", registry=REGISTRY)
TOKENS = Counter(
    "kafila_generation_tokens",
    "Tokens the head sampled, a stop token included (the API's usage leaves it out)",
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
    "Time between two tokens of a request (each interval of a request counted at that request's mean)",
    buckets=STEP_BUCKETS,
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

_planned_edges: dict[str, str] = {}  # "a->b": the path the plan chose (from the session record)
_epoch: list[int] = []  # the last plan epoch seen (empty before the first)
_lock = threading.Lock()


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


def observe_stage(r: StageRecord) -> None:
    """A member's own stage and the hop it sends on."""
    stage = str(r.index)
    if r.decode_steps:
        decode_s = r.decode_ms / 1000
        _observe_many(STAGE_COMPUTE.labels(r.member, stage, "decode"), decode_s, r.decode_steps)
        STAGE_MEASURED.labels(r.member, stage).set(decode_s)
        STAGE_WAIT.labels(r.member, stage).set(r.wait_ms / 1000)
        _set_ratio(r.member, stage, r.decode_ms, r.predicted_ms)
    STAGE_PREDICTED.labels(r.member, stage).set(r.predicted_ms / 1000)
    STAGE_DECODE_STEPS.labels(r.member, stage).inc(r.decode_steps)
    for ms in r.prefill_ms:
        STAGE_COMPUTE.labels(r.member, stage, "prefill").observe(ms / 1000)
    h = r.hop_out
    if h is not None:
        HOP_BYTES.labels(h.name, h.path).inc(h.bytes)
        HOP_MESSAGES.labels(h.name, h.path).inc(h.messages)
        if h.rtt_ms is not None:
            HOP_RTT.labels(h.name, h.path).set(h.rtt_ms / 1000)
        if h.predicted_rtt_ms is not None:
            HOP_PREDICTED_RTT.labels(h.name).set(h.predicted_rtt_ms / 1000)
        with _lock:
            planned = _planned_edges.get(h.name)
        if planned is not None and h.path != "local":
            observe_edge(h.name, planned, h.path, measured_by=r.member)


def observe_request(r: RequestRecord) -> None:
    """The head's whole-ring view of one request (gauges per stage; hop counters come from
    `observe_stage` at each sender, so a hop is counted once). The "last request" gauges keep the
    last request that decoded: one that ended at its first token measured no decode step."""
    decoded = any(s.steps for s in r.stages)
    for s in r.stages:
        if s.steps:
            STAGE_MEASURED.labels(s.member, str(s.index)).set(s.measured_ms / 1000)
            _set_ratio(s.member, str(s.index), s.measured_ms, s.predicted_ms)
        STAGE_PREDICTED.labels(s.member, str(s.index)).set(s.predicted_ms / 1000)
    REQUESTS.labels(r.finish).inc()
    PROMPT_TOKENS.inc(r.prompt_tokens)
    TOKENS.inc(r.completion_tokens)
    QUEUE_TIME.observe(r.queue_s)
    PREFILL_TIME.observe(r.prefill_s)
    TTFT.observe(r.ttft_s)
    E2E.observe(r.ttft_s + r.decode_s)
    intervals = r.completion_tokens - 1
    if intervals > 0 and r.decode_s > 0:
        _observe_many(ITL, r.decode_s / intervals, intervals)
    if decoded:
        DECODE_RATE.set(r.tokens_per_s)
        CIRCUIT.set(r.circuit_ms / 1000)
        TRANSIT.set(r.transit_ms / 1000)


def observe_no_token(finish: str) -> None:
    """A request that ended before its first token (cancelled while queued or in prefill, failed)."""
    REQUESTS.labels(finish).inc()


def observe_session(s: SessionRecord, ring_view: bool = True) -> None:
    """The plan a session formed with: its identity on every series, its bottleneck and circuit, its
    edges as predicted, and every stage's prediction where `ring_view` (the head's, as its request
    records set them). A session record is written when the ring formed and serves."""
    set_identity(s.session, s.model)
    if ring_view:
        for i, member in enumerate(s.order):
            STAGE_PREDICTED.labels(member, str(i)).set(s.predicted_stage_ms.get(member, 0.0) / 1000)
    STAGE_BLOCKS.clear()
    for i, member in enumerate(s.order):
        first, last = s.blocks.get(member, (0, 0))
        STAGE_BLOCKS.labels(member, str(i), str(first), str(last)).set(last - first)
    PREDICTED_BOTTLENECK.set(s.predicted_bottleneck_ms / 1000)
    PREDICTED_CIRCUIT.set(s.predicted_circuit_ms / 1000)
    with _lock:
        _planned_edges.clear()
        _planned_edges.update(s.edges)
    EDGE_PATH.clear()
    for edge, path in s.edges.items():
        EDGE_PATH.labels(edge, path, path, "predicted").set(1)
    MEMBERS_EXPECTED.set(len(s.order))
    MEMBERS_PRESENT.set(len(s.order))
    observe_state("serving")


# -- from the session's state ----------------------------------------------------------------------------


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


def observe_queue(running: int, waiting: int) -> None:
    """Requests admitted to the ring and requests queued at the head."""
    REQUESTS_RUNNING.set(running)
    REQUESTS_WAITING.set(waiting)


def observe_kv_cache(used: int, total: int) -> None:
    """KV-cache slots in use and in all (a slot holds one request's cache)."""
    if not 0 <= used <= total:
        raise ValueError(f"KV-cache slots: {used} used of {total} is not a count within the total")
    KV_SLOTS_USED.set(used)
    KV_SLOTS_TOTAL.set(total)
    KV_USAGE.set(used / total if total else 0.0)


def observe_member_nat(member: str, nat_class: str, mapping: str) -> None:
    """A member's NAT class and mapping behaviour (from its probe), one series per member."""
    for labels in [k for k in _label_sets(MEMBER_NAT) if k[0] == member]:
        MEMBER_NAT.remove(*labels)
    MEMBER_NAT.labels(member, nat_class, mapping).set(1)


def observe_edge(edge: str, planned: str, path: str, measured_by: str) -> None:
    """The path ring edge `edge` runs: measured by member `measured_by` (or "predicted")."""
    for labels in [k for k in _label_sets(EDGE_PATH) if k[0] == edge]:
        EDGE_PATH.remove(*labels)
    EDGE_PATH.labels(edge, planned, path, measured_by).set(1)


def observe_document(doc: Mapping[str, Any]) -> None:
    """What a member's /session document says at scrape time: its state and, on the head, its queue
    ("active" and "queued") and KV-cache slots ("slots", its concurrency, where the document has it).
    A document without a state (no session yet) changes nothing."""
    state = doc.get("state")
    if state in SESSION_STATES:
        observe_state(str(state))
    active = doc.get("active")
    if isinstance(active, list) and isinstance(doc.get("queued"), int):
        observe_queue(len(active), int(doc["queued"]))
        slots = doc.get("slots")  # the head's concurrency: one KV-cache slot per admitted request
        if isinstance(slots, int) and 0 <= len(active) <= slots:
            observe_kv_cache(len(active), slots)


def exposition() -> bytes:
    """The text a /metrics endpoint returns."""
    return generate_latest(REGISTRY)


# -- helpers ------------------------------------------------------------------------------------------


def _observe_many(h: Histogram, value: float, times: int) -> None:
    for _ in range(times):
        h.observe(value)


def _set_ratio(member: str, stage: str, measured_ms: float, predicted_ms: float) -> None:
    if predicted_ms > 0:
        STAGE_RATIO.labels(member, stage).set(measured_ms / predicted_ms)


def _label_sets(g: Gauge) -> Iterable[tuple[str, ...]]:
    return [tuple(k) for k in g._metrics]  # every child's label values (prometheus_client keeps them there)
