"""What every member knows of its ring, and the part of its /session document all members share."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RingInfo:
    """Who is where: ring order (head first), block ranges, predicted ms per decode step, edge paths."""

    session: str
    model: str
    division: str
    order: tuple[str, ...]
    blocks: dict[str, tuple[int, int]]
    predicted_ms: dict[str, float]
    # "a->b": the path it runs ("direct" | "relay" | "local" | "closed"): measured on this member's own
    # links (`measured_by`), the plan's on the others' edges
    edges: dict[str, str] = field(default_factory=dict)
    planned: dict[str, str] = field(default_factory=dict)  # "a->b": the path the plan chose
    measured_by: dict[str, str] = field(default_factory=dict)  # "a->b": the member whose link it is
    # member -> (NAT class, mapping behaviour or None), as this member knows them (the host: every
    # member's report; another member: its own)
    nat: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    edge_rtt_ms: dict[str, float] = field(default_factory=dict)  # "a->b": the plan's priced round trip
    dtype: str | None = None  # the session's ("fp32", "bf16", "fp16"): every member computes in it
    quant: str | None = None  # the session's weight format ("none", "int8", "q4"): every member's
    weights: dict[str, Any] = field(default_factory=dict)  # this member's shard: source, bytes fetched
    # this member's signaling connection: {"url", "state": "connected" | "lost", "reason" once lost}
    rendezvous: dict[str, Any] = field(default_factory=dict)
    epoch: int = 1  # the plan epoch this view belongs to: its trace records carry it

    def document(self, state: str, error: str | None, broken: dict[str, Any] | None = None) -> dict[str, Any]:
        """The part of a member's /session document every member shares; `broken`: why the ring
        broke, structured (RoleBase.broken_fields: member, cause, detail, this_member)."""
        return {
            "session": self.session,
            "model": self.model,
            "state": state if error is None else "broken",
            "error": error,
            "broken": broken,
            "head": self.order[0],
            "ring": list(self.order),
            "members": [self._member(m) for m in self.order],
            "links": [
                {
                    "edge": e,
                    "path": p,
                    "planned_path": self.planned.get(e),
                    "measured_by": self.measured_by.get(e),  # None: the plan's path, not measured here
                }
                for e, p in self.edges.items()
            ],
            "division": self.division,
            "dtype": self.dtype,
            "quant": self.quant,
            "plan": self.plan,
            "weights": self.weights,
            "rendezvous": self.rendezvous,
        }

    def _member(self, m: str) -> dict[str, Any]:
        nat_class, mapping = self.nat.get(m, (None, None))
        return {
            "name": m,
            "blocks": list(self.blocks[m]),
            "predicted_ms": self.predicted_ms.get(m),
            "nat_class": nat_class,
            "mapping": mapping,
        }
