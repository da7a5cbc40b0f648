"""Every Prometheus metric a member exports, defined once, fed from trace records.

The metrics do not measure anything themselves: `observe_request` and `observe_session` copy the
numbers of a trace record (kafila.obs.trace) into per-stage and per-hop series, so traces and
metrics always agree. Names carry the `kafila_` prefix; `member` is the member's name in the
session, `stage` its ring position (0 = head), `hop` an edge "src->dst" with its `path`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kafila.obs.trace import RequestRecord, SessionRecord

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
    "kafila_stage_sent_bytes", "Tensor bytes a stage sent to the next member", ["member"], registry=REGISTRY
)
HOP_BYTES = Counter("kafila_hop_bytes", "Bytes sent over a ring edge", ["hop", "path"], registry=REGISTRY)
HOP_MESSAGES = Counter(
    "kafila_hop_messages", "Messages sent over a ring edge", ["hop", "path"], registry=REGISTRY
)
REQUESTS = Counter("kafila_requests", "Requests finished, by outcome", ["finish"], registry=REGISTRY)
TOKENS = Counter("kafila_generated_tokens", "Tokens generated", registry=REGISTRY)
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
PREDICTED_BOTTLENECK = Gauge("kafila_predicted_bottleneck_ms", "Plan's slowest stage (ms)", registry=REGISTRY)


def observe_request(r: RequestRecord) -> None:
    for s in r.stages:
        STAGE_MEASURED.labels(s.member, str(s.index)).set(s.measured_ms)
        STAGE_PREDICTED.labels(s.member, str(s.index)).set(s.predicted_ms)
        STAGE_BYTES.labels(s.member).inc(s.bytes_out)
    for h in r.hops:
        HOP_BYTES.labels(f"{h.src}->{h.dst}", h.path).inc(h.bytes)
        HOP_MESSAGES.labels(f"{h.src}->{h.dst}", h.path).inc(h.messages)
    REQUESTS.labels(r.finish).inc()
    TOKENS.inc(r.completion_tokens)
    TTFT.labels("queue").observe(r.queue_s)
    TTFT.labels("prefill").observe(r.prefill_s)
    DECODE_RATE.set(r.tokens_per_s)
    CIRCUIT.set(r.circuit_ms)


def observe_session(s: SessionRecord) -> None:
    for i, member in enumerate(s.order):
        STAGE_PREDICTED.labels(member, str(i)).set(s.predicted_stage_ms.get(member, 0.0))
    PREDICTED_BOTTLENECK.set(s.predicted_bottleneck_ms)


def exposition() -> bytes:
    """The text a /metrics endpoint returns."""
    return generate_latest(REGISTRY)
