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
from dataclasses import dataclass, replace

PLAIN_ROW_SHARE = 0.0  # plain decoding computes one row per step: no extra rows to price
MIN_CIRCUITS = 32  # decode circuits a head counts before its yield prices the plan
MIN_TIMED = 8  # circuits of each kind (one row, several) timed alone before a row's share is measured


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
        and kept `accepted` of them; plain decoding where it ran none or drafted none (no drafted
        row to price)."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
        if circuits < 1 or drafted == 0:
            return cls()
        return cls(1 + accepted / circuits, 1 + drafted / circuits, row_share)

    def step_s(self, stage_s: float) -> float:
        """A stage's time for one circuit's rows, from its one-row step `stage_s`."""
        return stage_s * (1 + (self.rows - 1) * self.row_share)


@dataclass(frozen=True)
class CircuitCounts:
    """A head's decode circuits so far: what they carried and kept, and the stages' compute of
    those that carried one request alone (the rows of other requests make the rest unfit to price
    a row), split into one-row circuits and circuits with drafted rows."""

    circuits: int = 0
    drafted: int = 0  # drafted tokens the circuits verified
    accepted: int = 0  # ... and kept
    one_row: int = 0  # one-row circuits timed alone
    one_row_s: float = 0.0  # their stages' compute, summed
    more_rows: int = 0  # circuits with drafted rows timed alone
    more_rows_s: float = 0.0  # their stages' compute, summed
    extra_rows: int = 0  # their drafted rows

    def add(self, drafted: int, accepted: int, compute_s: float | None = None) -> CircuitCounts:
        """With one more circuit that verified `drafted` tokens and kept `accepted`; `compute_s`:
        every stage's compute for it, where it carried one request alone."""
        if not 0 <= accepted <= drafted:
            raise ValueError(f"a circuit kept {accepted} of {drafted} drafted tokens")
        c = replace(self, circuits=self.circuits + 1, drafted=self.drafted + drafted)
        c = replace(c, accepted=self.accepted + accepted)
        if compute_s is None or not math.isfinite(compute_s) or compute_s < 0:
            return c
        if drafted == 0:
            return replace(c, one_row=c.one_row + 1, one_row_s=c.one_row_s + compute_s)
        more = replace(c, more_rows=c.more_rows + 1, more_rows_s=c.more_rows_s + compute_s)
        return replace(more, extra_rows=more.extra_rows + drafted)

    def row_share(self) -> float | None:
        """What each drafted row added to the stages' compute, over a one-row circuit's compute
        (the mean of each kind); None until MIN_TIMED of each kind were timed."""
        if self.one_row < MIN_TIMED or self.more_rows < MIN_TIMED or self.one_row_s <= 0:
            return None
        one = self.one_row_s / self.one_row
        return max(0.0, (self.more_rows_s - self.more_rows * one) / (self.extra_rows * one))

    def priced_share(self, assumed_share: float) -> float:
        """The share a drafted row is priced at: the measured one where there is one, else `assumed_share`."""
        share = self.row_share()
        return assumed_share if share is None else share

    def circuit_yield(self, assumed_share: float) -> CircuitYield:
        """The yield these circuits measured, each drafted row at `priced_share`."""
        share = self.priced_share(assumed_share)
        return CircuitYield.measured(self.circuits, self.drafted, self.accepted, share)


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
