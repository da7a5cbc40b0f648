"""Every Prometheus metric a member exports, defined once, fed from trace records.

The metrics do not measure anything themselves: `observe_stage`, `observe_request` and
`observe_session` copy the numbers of a trace record (kafila.obs.trace) into per-stage and per-hop
series, so traces and metrics always agree. Names carry the `kafila_` prefix; `member` is the
member's name in the session, `stage` its ring position (0 = head), `hop` an edge "src->dst" with
its `path`.

Every member exports its own stage and the hop it sends on (from its `StageRecord`), so each
hop's bytes are counted once in the fleet: scrape every member and sum. The head also exports the
request-level series (time to first token, tokens/s, circuit, transit) and the ring's per-stage
gauges from its `RequestRecord`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kafila.obs.trace import RequestRecord, SessionRecord, StageRecord

REGISTRY = CollectorRegistry(auto_describe=True)

STAGE_MEASURED = Gauge(
    "kafila_stage_compute_ms",
    "Measured compute per decode step of a stage, last request (ms)",
    ["member", "stage"],
    registry=REGISTRY,
)
STAGE_PREDICTED = Gauge(
    "kafila_stage_predicted_ms",
    "Planner's predicted compute per decode step of a stage (ms)",
    ["member", "stage"],
    registry=REGISTRY,
)
STAGE_BYTES = Counter(
    "kafila_stage_sent_bytes",
    "Hidden-state bytes a stage sent to the next member (counted on the link)",
    ["member"],
    registry=REGISTRY,
)
STAGE_WAIT = Gauge(
    "kafila_stage_wait_ms",
    "Median wait of a decode step at a member before its compute started, last request (ms)",
    ["member", "stage"],
    registry=REGISTRY,
)
STAGE_DECODE_STEPS = Counter(
    "kafila_stage_decode_steps",
    "Decode steps a stage computed, once per request in a step (a batched step of two counts two)",
    ["member", "stage"],
    registry=REGISTRY,
)
STAGE_PREFILL_CHUNK = Histogram(
    "kafila_stage_prefill_chunk_ms",
    "Compute of one prefill chunk at a stage (ms)",
    ["member", "stage"],
    buckets=(1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 10000),
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
    "kafila_hop_rtt_ms",
    "Measured round trip of a ring edge (QUIC smoothed RTT at the sender, last request)",
    ["hop", "path"],
    registry=REGISTRY,
)
HOP_PREDICTED_RTT = Gauge(
    "kafila_hop_predicted_rtt_ms",
    "Round trip the plan priced for a ring edge (ms)",
    ["hop"],
    registry=REGISTRY,
)
REQUESTS = Counter(
    "kafila_requests",
    "Requests ended at the head, by outcome (stop, length, cancelled, error; refused: the queue was full)",
    ["finish"],
    registry=REGISTRY,
)
TOKENS = Counter(
    "kafila_generated_tokens",
    "Tokens the head sampled, a stop token included (the API's usage leaves it out)",
    registry=REGISTRY,
)
TTFT = Histogram(
    "kafila_ttft_seconds",
    "Time to first token by phase (queue, prefill)",
    ["phase"],
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
    registry=REGISTRY,
)
DECODE_RATE = Gauge(
    "kafila_decode_tokens_per_second", "Decode tokens/s of the last request", registry=REGISTRY
)
CIRCUIT = Gauge(
    "kafila_circuit_ms", "Measured ring circuit per decode step, last request (ms)", registry=REGISTRY
)
TRANSIT = Gauge(
    "kafila_ring_transit_ms",
    "Circuit minus every stage's compute per decode step, last request: time on hops and waiting (ms)",
    registry=REGISTRY,
)
PREDICTED_BOTTLENECK = Gauge("kafila_predicted_bottleneck_ms", "Plan's slowest stage (ms)", registry=REGISTRY)


def observe_stage(r: StageRecord) -> None:
    """A member's own stage and the hop it sends on."""
    stage = str(r.index)
    if r.decode_steps:
        STAGE_MEASURED.labels(r.member, stage).set(r.decode_ms)
        STAGE_WAIT.labels(r.member, stage).set(r.wait_ms)
    STAGE_PREDICTED.labels(r.member, stage).set(r.predicted_ms)
    STAGE_DECODE_STEPS.labels(r.member, stage).inc(r.decode_steps)
    for ms in r.prefill_ms:
        STAGE_PREFILL_CHUNK.labels(r.member, stage).observe(ms)
    h = r.hop_out
    if h is not None:
        STAGE_BYTES.labels(r.member).inc(h.bytes)
        HOP_BYTES.labels(h.name, h.path).inc(h.bytes)
        HOP_MESSAGES.labels(h.name, h.path).inc(h.messages)
        if h.rtt_ms is not None:
            HOP_RTT.labels(h.name, h.path).set(h.rtt_ms)
        if h.predicted_rtt_ms is not None:
            HOP_PREDICTED_RTT.labels(h.name).set(h.predicted_rtt_ms)


def observe_request(r: RequestRecord) -> None:
    """The head's whole-ring view of one request (gauges per stage; hop counters come from
    `observe_stage` at each sender, so a hop is counted once). The "last request" gauges keep the
    last request that decoded: one that ended at its first token measured no decode step."""
    for s in r.stages:
        if s.steps:
            STAGE_MEASURED.labels(s.member, str(s.index)).set(s.measured_ms)
        STAGE_PREDICTED.labels(s.member, str(s.index)).set(s.predicted_ms)
    REQUESTS.labels(r.finish).inc()
    TOKENS.inc(r.completion_tokens)
    TTFT.labels("queue").observe(r.queue_s)
    TTFT.labels("prefill").observe(r.prefill_s)
    if any(s.steps for s in r.stages):
        DECODE_RATE.set(r.tokens_per_s)
        CIRCUIT.set(r.circuit_ms)
        TRANSIT.set(r.transit_ms)


def observe_no_token(finish: str) -> None:
    """A request that ended before its first token (cancelled while queued or in prefill, failed)."""
    REQUESTS.labels(finish).inc()


def observe_session(s: SessionRecord, ring_view: bool = True) -> None:
    """The plan: its bottleneck on every member, every stage's prediction where `ring_view` (the
    head's, as its request records set them)."""
    if ring_view:
        for i, member in enumerate(s.order):
            STAGE_PREDICTED.labels(member, str(i)).set(s.predicted_stage_ms.get(member, 0.0))
    PREDICTED_BOTTLENECK.set(s.predicted_bottleneck_ms)


def exposition() -> bytes:
    """The text a /metrics endpoint returns."""
    return generate_latest(REGISTRY)
