"""The Plan value: what the host decides and sends to every member (JSON round trip)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from kafila.planner.drafting import CircuitYield


@dataclass(frozen=True)
class Stage:
    """One member's share: blocks [start, stop) and, on the head, embedding/unembedding/sampler."""

    name: str
    start: int
    stop: int
    head: bool
    cost_s: float | None  # predicted stage time per token (None in the working-set tier)
    resident_bytes: int  # weights + KV reservation (+ head) this share keeps in memory
    memory_bytes: int  # what the member reported available

    @property
    def n_blocks(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class Edge:
    """A ring edge in token direction, predicted direct or relayed through the rendezvous."""

    src: str
    dst: str
    direct: bool
    latency_s: float | None  # one-way: half the priced round trip; None when an rtt is missing


@dataclass(frozen=True)
class Plan:
    division: str  # "kafila" | "uniform" | "memory"
    feasible: bool
    reason: str | None  # why the division was refused (names the device and the numbers)
    tier: str  # "full" | "throughput" | "working_set"
    ordering: str  # how the ring order was chosen (see kafila.planner.order)
    order: tuple[str, ...]  # ring order, head first
    head: str | None
    stages: tuple[Stage, ...]  # in ring order, head first; empty when no division exists
    edges: tuple[Edge, ...]
    n_blocks: int
    context: int
    concurrency: int
    bottleneck_s: float | None = None
    imbalance: float | None = None  # slowest stage / fastest stage
    utilisation: float | None = None  # mean stage / bottleneck
    circuit_s: float | None = None  # sum of stages + edge latencies that are known
    network_priced: bool = False  # every edge latency was known when circuit_s was summed
    tokens_s: float | None = None  # one request: tokens_per_circuit / circuit_s
    # the session's aggregate time per token at its declared concurrency:
    # max(bottleneck_s, circuit_s / concurrency) / tokens_per_circuit; the kafila division
    # minimizes it for one-row steps
    per_token_s: float | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # what a decode circuit yields (kafila.planner.drafting): 1, 1, 0 for plain decoding; with
    # speculative decoding the bottleneck and circuit are of `rows_per_circuit` rows
    tokens_per_circuit: float = 1.0
    rows_per_circuit: float = 1.0
    row_share: float = 0.0
    # bytes the members fetch for this plan from the host and from each other, given what they
    # reported holding (kafila.planner.fetching); None where no member other than the host did
    host_bytes: int | None = None
    peer_bytes: int | None = None

    @property
    def circuit_yield(self) -> CircuitYield:
        return CircuitYield(self.tokens_per_circuit, self.rows_per_circuit, self.row_share)

    @property
    def relayed(self) -> int:
        return sum(not e.direct for e in self.edges)

    def blocks(self) -> dict[str, int]:
        return {s.name: s.n_blocks for s in self.stages}

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise KeyError(f"{name!r} has no stage in this plan; members: {list(self.order)}")

    def block_range(self, name: str) -> tuple[int, int]:
        stage = self.stage(name)
        return stage.start, stage.stop

    def successor(self, name: str) -> str:
        """The member `name` sends its output to (the last member sends back to the head)."""
        i = self.order.index(name)
        return self.order[(i + 1) % len(self.order)]

    def predecessor(self, name: str) -> str:
        """The member `name` receives its input from (the head receives from the last member)."""
        i = self.order.index(name)
        return self.order[(i - 1) % len(self.order)]

    def to_dict(self) -> dict[str, Any]:
        """The byte counts only where known: a plan without them reads the same to an older member."""
        d = asdict(self)
        for key in ("order", "stages", "edges", "notes"):
            d[key] = list(d[key])
        for key in ("host_bytes", "peer_bytes"):
            if d[key] is None:
                del d[key]
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        known = {f.name for f in fields(cls)}
        return cls(
            **{
                **{k: v for k, v in d.items() if k in known},  # a newer host's fields are its own
                "order": tuple(d["order"]),
                "stages": tuple(Stage(**s) for s in d["stages"]),
                "edges": tuple(Edge(**e) for e in d["edges"]),
                "notes": tuple(d.get("notes", ())),
            }
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> Plan:
        return cls.from_dict(json.loads(text))

    def summary(self) -> dict[str, Any]:
        """The `kafila plan --json` entry for this division."""

        def ms(x: float | None) -> float | None:
            return None if x is None else round(x * 1e3, 4)

        return {
            "feasible": self.feasible,
            "reason": self.reason,
            "order": list(self.order),
            "head": self.head,
            "blocks": self.blocks(),
            "stage_ms": {s.name: ms(s.cost_s) for s in self.stages},
            "bottleneck_ms": ms(self.bottleneck_s),
            "imbalance": self.imbalance,
            "utilisation": self.utilisation,
            "circuit_ms": ms(self.circuit_s),
            "tokens_s": self.tokens_s,
            "per_token_ms": ms(self.per_token_s),
            "tokens_per_circuit": self.tokens_per_circuit,
            "tier": self.tier,
            **(
                {"host_bytes": self.host_bytes, "peer_bytes": self.peer_bytes}
                if self.host_bytes is not None
                else {}
            ),
            "edges": [{"src": e.src, "dst": e.dst, "direct": e.direct} for e in self.edges],
        }
