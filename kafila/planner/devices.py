"""What a member reports about itself: the planner's device input (JSON-able, built from probes)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from kafila.planner.held import Held
from kafila.planner.reachability import Nat


@dataclass(frozen=True)
class DeviceReport:
    """One member as measured. Every measurement is optional: the planner degrades by tier.

    memory_bytes: memory available for this session's weights and KV cache.
    bandwidth_bytes_s: streaming read bandwidth measured with the member's backend.
    overhead_s: fixed per-token dispatch overhead.
    flops: matmul FLOP/s (the degraded tier's only speed figure).
    block_s: one decode step of one block of the session model, timed by the synthetic-block probe.
    block_dispatch_s: one decode step of one block of the session model's architecture at tiny
        shapes: what the block's op chain costs to dispatch, added to block bytes / bandwidth.
    head_s: the head's final norm and unembedding of one row of the session model, timed by the
        probe with the engine's own code (replaces head bytes / bandwidth, like block_s).
    stage_fixed_s: the part of a stage's decode step that does not grow with its blocks (the
        synthetic-block probe timed at two block counts); replaces overhead_s where block_s is used.
    wake_s, wake_tau_s: a step after g seconds of idle costs wake_s (e^(-1 ms/tau) - e^(-g/tau))
        more than one after 1 ms (the probe's fit, kafila.planner.cost.wake_cost_s): a core that
        slept through most of a circuit comes back slower.
    nat: classified NAT (None: unknown, predicted as restrictive).
    rtt_s: round trip to the rendezvous.
    pair_rtt_s: measured round trips to other members, by name.
    relayed_with: members this one was measured NOT to reach directly (a punch that failed where
        its NAT classes predicted it would succeed): the planner prices those edges as relayed.
    held: what the member's disk holds of the session's checkpoint (None: not reported, as an
        older member's report or a fleet file): the planner's tie-break between plans about as
        fast (kafila.planner.fetching).
    """

    name: str
    memory_bytes: int
    bandwidth_bytes_s: float | None = None
    overhead_s: float | None = None
    flops: float | None = None
    block_s: float | None = None
    block_dispatch_s: float | None = None
    head_s: float | None = None
    stage_fixed_s: float | None = None
    wake_s: float | None = None
    wake_tau_s: float | None = None
    nat: Nat | None = None
    rtt_s: float | None = None
    pair_rtt_s: dict[str, float] = field(default_factory=dict)
    relayed_with: frozenset[str] = frozenset()
    held: Held | None = None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("device name is empty")
        if self.memory_bytes < 0:
            raise ValueError(f"device {self.name}: memory_bytes {self.memory_bytes} is negative")
        for key in ("bandwidth_bytes_s", "flops", "block_s", "head_s", "wake_tau_s"):
            value = getattr(self, key)
            if value is not None and not value > 0:
                raise ValueError(f"device {self.name}: {key} must be > 0, got {value}")
        for key in ("overhead_s", "rtt_s", "block_dispatch_s", "stage_fixed_s", "wake_s"):
            value = getattr(self, key)
            if value is not None and value < 0:
                raise ValueError(f"device {self.name}: {key} must be >= 0, got {value}")

    def to_dict(self) -> dict[str, Any]:
        """`held` only where reported (a report without it reads the same to an older host)."""
        d: dict[str, Any] = {
            "name": self.name,
            "memory_bytes": self.memory_bytes,
            "bandwidth_bytes_s": self.bandwidth_bytes_s,
            "overhead_s": self.overhead_s,
            "flops": self.flops,
            "block_s": self.block_s,
            "block_dispatch_s": self.block_dispatch_s,
            "head_s": self.head_s,
            "stage_fixed_s": self.stage_fixed_s,
            "wake_s": self.wake_s,
            "wake_tau_s": self.wake_tau_s,
            "nat": self.nat.to_dict() if self.nat else None,
            "rtt_s": self.rtt_s,
            "pair_rtt_s": dict(self.pair_rtt_s),
            "relayed_with": sorted(self.relayed_with),
        }
        if self.held is not None:
            d["held"] = self.held.to_dict()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DeviceReport:
        nat = d.get("nat")
        return cls(
            name=str(d["name"]),
            memory_bytes=int(d["memory_bytes"]),
            bandwidth_bytes_s=d.get("bandwidth_bytes_s"),
            overhead_s=d.get("overhead_s"),
            flops=d.get("flops"),
            block_s=d.get("block_s"),
            block_dispatch_s=d.get("block_dispatch_s"),
            head_s=d.get("head_s"),
            stage_fixed_s=d.get("stage_fixed_s"),
            wake_s=d.get("wake_s"),
            wake_tau_s=d.get("wake_tau_s"),
            nat=Nat.from_dict(nat) if nat else None,
            rtt_s=d.get("rtt_s"),
            pair_rtt_s={str(k): float(v) for k, v in (d.get("pair_rtt_s") or {}).items()},
            relayed_with=frozenset(str(n) for n in d.get("relayed_with") or ()),
            held=Held.from_dict(d["held"]) if d.get("held") is not None else None,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict())

    @classmethod
    def from_json(cls, text: str) -> DeviceReport:
        return cls.from_dict(json.loads(text))
