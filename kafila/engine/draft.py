"""Drafts that need no training: prompt lookup, and how many tokens to draft (pure).

Prompt lookup (as vLLM's `ngram` proposer and llama.cpp's lookup decoding): the last n tokens of
prompt and answer (n from `max_ngram` down to `min_ngram`) are looked for earlier in the same
history; the tokens that followed their latest earlier occurrence are the draft. Summaries,
edits and code repeat their input, so those drafts are often right; a chat answer rarely finds
one, and then nothing is drafted.

How many (k): one step of k + 1 rows costs the circuit of a plain step (`base_s`: every hop and
every stage's one-row compute) plus `row_s` for each drafted row, and with a per-token acceptance
a it yields (1 - a^(k+1)) / (1 - a) tokens on average. The policy drafts the k in 0..max_k with
the most tokens per second, 0 where none beats a plain step by `min_gain`. Acceptance and times are measured
per request (`observe`): counts decay each step (`decay`) toward a prior, so a request whose
drafts missed stops drafting, and after some plain steps tries again; the row cost is smoothed
from a prior too, so one slow step (a kernel compiled for a new shape) does not end drafting.
Long circuits (a WAN ring) make extra rows cheap by comparison and want long drafts; a ring on
one machine wants short ones.

A draft model (kafila.engine.draft_model) drafts instead of prompt lookup where `--draft` names
one: `propose` takes the proposer, and making each drafted token costs the head `draft_s` more
(measured per request, `observe_drafting`), which the choice of k adds to the row cost.

Drafting ahead (`ahead` > 0, kafila.session.ring.schedule): while a step is in the ring the head
may send the next one, which feeds the head's guess of the token that step samples after its
draft and a draft after that guess (`propose_ahead`): one longer lookup (or more draft-model
tokens) over the history that assumes every drafted token in the ring is kept.

No clocks or I/O: the head passes each step's measured circuit time in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

DRAFT_MODES = ("none", "lookup")  # --draft: off, or prompt lookup (the default); else a model
DRAFT_HELP = (
    "speculative decoding: 'lookup' (default) drafts the next tokens from n-grams of the prompt and "
    "the answer so far and verifies several per step (one circuit of the ring), keeping the tokens "
    "plain decoding gives; drafts that miss fall back to plain steps. 'none': one token per step. "
    "MODEL (a model name or folder with the served model's tokenizer, e.g. a smaller checkpoint of "
    "its family): that model drafts, run by the head next to its sampler"
)
# draft tokens for the step after `history`: (history, k) -> up to k tokens
Proposer = Callable[[Sequence[int], int], tuple[int, ...]]


@dataclass(frozen=True)
class DraftPolicy:
    max_k: int = 8  # most tokens drafted for one step
    max_ngram: int = 3  # longest suffix looked up
    min_ngram: int = 1  # shortest suffix looked up
    prior_accept: float = 0.6  # acceptance assumed before any draft was verified
    prior_weight: float = 1.0  # ... worth this many verified draft tokens
    decay: float = 0.9  # each step keeps this share of the counts before it
    row_share: float = 0.05  # a drafted row's cost over a plain step's, until measured
    min_gain: float = 0.1  # drafts are made only where they promise this much more than plain steps
    ahead: int = 0  # decode steps a request may send ahead of the one in the ring (0: none)

    def __post_init__(self) -> None:
        if self.ahead < 0:
            raise ValueError(f"ahead {self.ahead} must be >= 0")
        if self.max_k < 0 or not 1 <= self.min_ngram <= self.max_ngram:
            raise ValueError(
                f"max_k {self.max_k} must be >= 0 and 1 <= min_ngram {self.min_ngram} <= "
                f"max_ngram {self.max_ngram}"
            )
        if not 0 < self.decay <= 1 or not 0 <= self.prior_accept < 1 or self.prior_weight <= 0:
            raise ValueError(
                f"decay {self.decay} must be in (0, 1], prior_accept {self.prior_accept} in [0, 1), "
                f"prior_weight {self.prior_weight} > 0"
            )


@dataclass(frozen=True)
class DraftStats:
    """One request's measurements: draft tokens verified and kept (decayed), and step times."""

    drafted: float = 0.0
    accepted: float = 0.0
    base_s: float | None = None  # a plain (one-row) step's circuit, smoothed
    row_s: float | None = None  # what each drafted row adds to it, smoothed
    draft_s: float | None = None  # what making each drafted token costs the head (a draft model), smoothed

    def acceptance(self, policy: DraftPolicy) -> float:
        w = policy.prior_weight
        return (self.accepted + policy.prior_accept * w) / (self.drafted + w)


def lookup(history: Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> tuple[int, ...]:
    """Up to `k` tokens that followed the latest earlier occurrence of the longest suffix of
    `history` (of `max_ngram` down to `min_ngram` tokens) found in it; () when none is."""
    n_hist = len(history)
    if k < 1 or n_hist < 2:
        return ()
    for n in range(min(max_ngram, n_hist - 1), min_ngram - 1, -1):
        suffix = list(history[n_hist - n :])
        first = suffix[0]
        for start in range(n_hist - n - 1, -1, -1):  # latest first; not the suffix itself
            if history[start] == first and list(history[start : start + n]) == suffix:
                return tuple(history[start + n : start + n + k])
    return ()


def best_k(acceptance: float, base_s: float, row_s: float, max_k: int, min_gain: float = 0.0) -> int:
    """The draft length in 0..max_k with the most expected tokens per second of circuit; 0 unless
    that is more than (1 + `min_gain`) times a plain step's."""
    best, best_rate = 0, 0.0
    expected, term = 1.0, 1.0
    for k in range(1, max_k + 1):
        term *= acceptance
        expected += term  # 1 + a + ... + a^k
        rate = expected / (base_s + k * row_s)
        if rate > best_rate * (1 + 1e-9):
            best, best_rate = k, rate
    return best if best_rate > (1 + min_gain) / base_s else 0


def choose_k(policy: DraftPolicy, stats: DraftStats, room: int) -> int:
    """How many tokens to draft for the next step; `room`: most the request can take (its tokens
    left to generate and its context, less the step's own token)."""
    base = stats.base_s if stats.base_s is not None else 1.0
    row = stats.row_s if stats.row_s is not None else policy.row_share * base
    row += stats.draft_s or 0.0
    k = best_k(stats.acceptance(policy), base, max(row, 0.0), policy.max_k, policy.min_gain)
    return min(k, max(room, 0))


def propose(
    policy: DraftPolicy,
    stats: DraftStats,
    history: Sequence[int],
    room: int,
    proposer: Proposer | None = None,
) -> tuple[int, ...]:
    """The draft for the step after `history` (prompt and answer so far), of the length
    `choose_k` gives: `proposer`'s (a draft model's), or prompt lookup's (shorter where the
    history ends sooner, () where nothing matches)."""
    k = choose_k(policy, stats, room)
    return _tokens_after(policy, history, k, proposer) if k else ()


def propose_ahead(
    policy: DraftPolicy,
    stats: DraftStats,
    assumed: Sequence[int],
    room: int,
    proposer: Proposer | None = None,
) -> tuple[int, ...]:
    """What a step sent ahead feeds: the guess of the token sampled after `assumed` (the prompt,
    the answer and every token the steps in the ring are assumed to keep), then a draft after
    it of the length `choose_k` gives; `room` tokens at most (the request's and its context's);
    () where nothing is guessed."""
    if room < 1:
        return ()
    return _tokens_after(policy, assumed, 1 + choose_k(policy, stats, room - 1), proposer)


def _tokens_after(
    policy: DraftPolicy, history: Sequence[int], n: int, proposer: Proposer | None
) -> tuple[int, ...]:
    """Up to `n` tokens after `history`: `proposer`'s (a draft model's), else prompt lookup's."""
    if proposer is not None:
        return proposer(history, n)[:n]
    return lookup(history, n, policy.max_ngram, policy.min_ngram)


def observe_drafting(policy: DraftPolicy, stats: DraftStats, tokens: int, seconds: float) -> DraftStats:
    """`stats` after making a draft of `tokens` tokens took the head `seconds` (a draft model's)."""
    if tokens < 1 or seconds < 0:
        return stats
    per_token = seconds / tokens
    old = stats.draft_s
    return replace(stats, draft_s=per_token if old is None else old + (1 - policy.decay) * (per_token - old))


def observe(
    policy: DraftPolicy, stats: DraftStats, drafted: int, accepted: int, circuit_s: float
) -> DraftStats:
    """`stats` after a step that verified `drafted` tokens and kept `accepted`, in `circuit_s`."""
    if not 0 <= accepted <= drafted:
        raise ValueError(f"accepted {accepted} of {drafted} drafted tokens")
    d = policy.decay
    s = replace(stats, drafted=stats.drafted * d + drafted, accepted=stats.accepted * d + accepted)
    if circuit_s <= 0:
        return s
    if drafted == 0:
        base = circuit_s if s.base_s is None else s.base_s + (1 - d) * (circuit_s - s.base_s)
        return replace(s, base_s=base)
    if s.base_s is None:
        return s
    per_row = max(circuit_s - s.base_s, 0.0) / drafted
    row = policy.row_share * s.base_s if s.row_s is None else s.row_s  # the prior is the first value
    return replace(s, row_s=row + (1 - d) * (per_row - row))


def policy_for(mode: str, ahead: int = 0) -> DraftPolicy | None:
    """The policy of a --draft value: None for "none", else the default policy (prompt lookup
    for "lookup", a draft model for a model's name or folder) sending up to `ahead` steps ahead
    (--draft-ahead)."""
    if not mode.strip():
        raise ValueError(f"unknown draft {mode!r}; choose {' or '.join(DRAFT_MODES)} or a model")
    return None if mode == "none" else DraftPolicy(ahead=ahead)


def draft_model_of(mode: str) -> str | None:
    """The draft model a --draft value names (None for "none" and "lookup")."""
    return None if mode in DRAFT_MODES else mode
