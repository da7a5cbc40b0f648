"""Verifying a draft: which of k drafted tokens the model keeps, from one step's k + 1 rows (pure).

A verification step feeds the model the last sampled token and the k drafted ones; its row i
holds the logits of the answer position after draft token i - 1. Rows are sampled in order by
the request's own `Sampler` (its penalties see every token kept before them) and the draft is
kept while the sampled token equals the drafted one; the first token that differs is the
model's own (the correction) and ends the step; when all k are kept, row k's token comes free
(the bonus). A stop token or max_tokens ends the step where it falls.

Greedy requests get exactly the tokens plain decoding gives, provided each row's logits are the
bits a one-row step would give: the CPU kernels promise that (`Stage.batch_rows`); elsewhere a
row whose two best logits lie within `tie_margin` of each other is not trusted (a batched
product may round it the other way), the step ends before it and the next step samples that
position alone.

Sampled requests: each answer position draws from its own generator (kafila.engine.sampler), so
the token sampled at a position is the target model's draw whatever was drafted. For a draft
that is one fixed token x per position (a point mass q, as prompt lookup gives), this is the
standard speculative-sampling rule: x is kept with probability p(x) = min(1, p(x) / q(x)), and a
rejected position's token has the distribution p restricted to the other tokens, renormalised,
which is max(p - q, 0) / sum(max(p - q, 0)). The answer's distribution is the model's, and a
seeded request gives the same tokens with drafting on or off.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from kafila.engine.sampler import Sampler, StopReason


@dataclass(frozen=True)
class Verdict:
    """What one verification step gave a request."""

    tokens: tuple[int, ...]  # the kept draft tokens, then the model's own token (if sampled)
    accepted: int  # draft tokens kept (accepted per position: the first `accepted` of the draft)
    reason: StopReason | None  # the last token ended the request ("stop", "length")
    tied: bool = False  # the step ended before a row whose best two logits were within tie_margin


def verify(sampler: Sampler, rows: np.ndarray, draft: Sequence[int], tie_margin: float = 0.0) -> Verdict:
    """Logits `rows` [k + 1, V] of a step that fed the last token and `draft` (k tokens): the
    tokens the answer takes. `tie_margin` > 0: a greedy row whose best two (penalised) logits
    differ by less is not sampled when it was computed with other rows (only in a step of several
    rows; a one-row step is plain decoding)."""
    if rows.shape[0] != len(draft) + 1:
        n, k = rows.shape[0], len(draft)
        raise ValueError(f"{n} rows of logits verify a draft of {k}: need {k + 1}")
    out: list[int] = []
    for i, row in enumerate(rows):
        if tie_margin > 0 and rows.shape[0] > 1 and sampler.greedy and _margin(sampler, row) < tie_margin:
            return Verdict(tuple(out), len(out), None, tied=True)
        token = sampler.sample(row)
        out.append(token)
        reason = sampler.stop_reason(token)
        kept = i < len(draft) and token == draft[i]
        if reason is not None or not kept:
            return Verdict(tuple(out), len(out) - 1 if not kept else len(out), reason)
    return Verdict(tuple(out), len(draft), None)


def holds(verdict: Verdict, expect: Sequence[int]) -> bool:
    """Whether a step that gave `verdict` gave what a step sent ahead of it assumed: `expect`,
    its whole draft and then the guessed token, with the request going on."""
    return verdict.reason is None and not verdict.tied and verdict.tokens == tuple(expect)


def _margin(sampler: Sampler, row: np.ndarray) -> float:
    z = sampler.penalized(row)
    top2 = np.partition(z, -2)[-2:] if z.shape[0] > 1 else np.array([-np.inf, z[0]])
    return float(top2[1] - top2[0])
