"""What speculative decoding makes of a circuit, for the plan's figures (pure).

Plain decoding takes one token per request from each decode circuit. A head that drafts
(kafila.engine.draft) sends 1 + k rows round the ring per step and takes 1 + the drafted tokens
kept, so one circuit gives a request `tokens` tokens on average (measured: the head's tokens per
circuit) while each stage computes `rows` rows, each row after the first costing it `row_share`
of its one-row step (the CPU kernels read the weights once per step; measured: the head's
drafted-row cost over its plain circuit). A stage's step is then its one-row time x
(1 + (rows - 1) x row_share), the circuit is every step plus every edge, and one request's
time per token is that circuit over `tokens`: on a WAN ring, where the edges are most of the
circuit, drafting divides the time per token by nearly the tokens per circuit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

PLAIN_ROW_SHARE = 0.0  # plain decoding computes one row per step: no extra rows to price


@dataclass(frozen=True)
class CircuitYield:
    """What one decode circuit gives a request and costs each stage."""

    tokens: float = 1.0  # tokens a circuit gives a request: 1 + drafted tokens kept, on average
    rows: float = 1.0  # rows each stage computes per circuit: 1 + drafted tokens, on average
    row_share: float = PLAIN_ROW_SHARE  # each row after the first, over a stage's one-row step

    def __post_init__(self) -> None:
        finite = all(math.isfinite(x) for x in (self.tokens, self.rows, self.row_share))
        if not finite or not 1.0 <= self.tokens <= self.rows or self.row_share < 0:
            raise ValueError(
                f"a circuit yields 1 <= tokens {self.tokens} <= rows {self.rows} (each drafted row kept "
                f"or not), with row_share {self.row_share} >= 0"
            )

    @classmethod
    def measured(cls, circuits: int, drafted: int, accepted: int, row_share: float) -> CircuitYield:
        """From a head's counts: `circuits` decode circuits that carried `drafted` drafted tokens
        and kept `accepted` of them; plain decoding where it ran none."""
        if circuits < 1:
            return cls()
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
        return cls(1 + accepted / circuits, 1 + drafted / circuits, row_share)

    def step_s(self, stage_s: float) -> float:
        """A stage's time for one circuit's rows, from its one-row step `stage_s`."""
        return stage_s * (1 + (self.rows - 1) * self.row_share)


@dataclass(frozen=True)
class Figures:
    bottleneck_s: float  # the slowest stage's step of one circuit's rows
    circuit_s: float  # every step of one circuit's rows plus every edge
    tokens_s: float  # one request: tokens per circuit / circuit
    per_token_s: float  # the session at its concurrency: max(bottleneck, circuit / U) / tokens


def figures(
    stage_s: Sequence[float], latencies_s: Sequence[float], concurrency: int, y: CircuitYield
) -> Figures:
    """The plan's figures for one-row stage steps `stage_s` and one-way edge `latencies_s`, each
    circuit yielding as `y` says."""
    if not stage_s or concurrency < 1:
        raise ValueError(f"{len(stage_s)} stages at concurrency {concurrency}: need one stage and 1 request")
    steps = [y.step_s(s) for s in stage_s]
    bottleneck, circuit = max(steps), sum(steps) + sum(latencies_s)
    per_token = max(bottleneck, circuit / concurrency) / y.tokens
    return Figures(bottleneck, circuit, y.tokens / circuit, per_token)
