"""Verifying drafts (pure): greedy keeps what plain decoding would, sampling keeps the model's
distribution (chi-square on an 8-token vocabulary), seeded answers repeat whatever was drafted."""

from __future__ import annotations

import numpy as np
import pytest

from kafila.engine.sampler import Sampler, SamplingParams
from kafila.engine.speculative import Verdict, holds, verify

V = 8
# chi-square with 7 degrees of freedom: exceeded with probability 1e-4 by a right distribution
CHI2_7DOF_P1E4 = 29.88


def _rows(*best: int) -> np.ndarray:
    """Logits rows whose argmax is `best[i]`, each clear of the others by 2."""
    rows = np.zeros((len(best), V), dtype=np.float32)
    for i, b in enumerate(best):
        rows[i, b] = 2.0
    return rows


def test_greedy_keeps_the_matched_prefix_and_the_models_own_token_at_the_first_miss() -> None:
    v = verify(Sampler(SamplingParams(max_tokens=50)), _rows(3, 5, 1, 2), [3, 5, 4])
    assert (v.tokens, v.accepted, v.reason) == ((3, 5, 1), 2, None)


def test_a_draft_kept_whole_gives_the_bonus_token() -> None:
    v = verify(Sampler(SamplingParams(max_tokens=50)), _rows(3, 5, 4, 6), [3, 5, 4])
    assert (v.tokens, v.accepted) == ((3, 5, 4, 6), 3)


def test_a_stop_token_or_max_tokens_ends_the_step_where_it_falls() -> None:
    v = verify(Sampler(SamplingParams(max_tokens=50), eos_ids=(5,)), _rows(3, 5, 4, 6), [3, 5, 4])
    assert (v.tokens, v.accepted, v.reason) == ((3, 5), 2, "stop")
    v = verify(Sampler(SamplingParams(max_tokens=2)), _rows(3, 5, 4, 6), [3, 5, 4])
    assert (v.tokens, v.reason) == ((3, 5), "length")


def test_penalties_see_the_kept_draft_tokens_before_each_row() -> None:
    rows = np.zeros((3, V), dtype=np.float32)
    rows[:, 3], rows[:, 6] = 2.0, 1.5  # 3 is best, 6 next; a repeated 3 falls below 6
    params = SamplingParams(max_tokens=50, repeat_penalty=1.5)
    plain = Sampler(params)
    expected = [plain.sample(row) for row in rows]  # one row at a time, as plain decoding
    v = verify(Sampler(params), rows, [3, 6])
    assert list(v.tokens) == expected == [3, 6, 3]


def test_a_near_tie_in_a_batched_row_ends_the_step_before_it() -> None:
    rows = _rows(3, 5, 4)
    rows[1, 2] = 1.99  # 5 and 2 within 0.01
    v = verify(Sampler(SamplingParams(max_tokens=50)), rows, [3, 5], tie_margin=0.05)
    assert (v.tokens, v.accepted, v.tied) == ((3,), 1, True)
    alone = verify(Sampler(SamplingParams(max_tokens=50)), rows[1:2], [], tie_margin=0.05)
    assert alone.tokens == (5,) and not alone.tied  # a one-row step is plain decoding: no guard


def test_the_logits_must_cover_the_draft_and_one_more() -> None:
    with pytest.raises(ValueError, match="2 rows of logits verify a draft of 3: need 4"):
        verify(Sampler(SamplingParams()), _rows(1, 2), [1, 2, 3])


def _probs(row: np.ndarray) -> np.ndarray:
    p = np.exp(row - row.max())
    return p / p.sum()


ROW = np.log(np.array([0.30, 0.20, 0.15, 0.12, 0.10, 0.07, 0.04, 0.02], dtype=np.float64)).astype(np.float32)


def _chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = counts.sum() * probs
    return float(((counts - expected) ** 2 / expected).sum())


def test_sampled_verification_keeps_the_models_distribution_for_any_draft() -> None:
    n, p = 6000, _probs(ROW)
    for drafted in (0, 4, 7):  # a likely, an unlikely and the least likely token drafted
        counts, kept = np.zeros(V), 0
        for seed in range(n):
            v = verify(Sampler(SamplingParams(temperature=1.0, seed=seed)), np.stack([ROW, ROW]), [drafted])
            counts[v.tokens[0]] += 1
            kept += v.accepted
        assert _chi2(counts, p) < CHI2_7DOF_P1E4, (drafted, counts / n, p)
        # the standard rule for a point-mass draft: kept with probability p(x)
        assert abs(kept / n - p[drafted]) < 4 * np.sqrt(p[drafted] * (1 - p[drafted]) / n)


def test_a_rejected_position_draws_from_the_normalised_residual() -> None:
    n, drafted, p = 6000, 0, _probs(ROW)
    residual = np.maximum(p - np.eye(V)[drafted], 0)  # max(p - q, 0), q a point mass on the draft
    residual /= residual.sum()
    counts = np.zeros(V)
    for seed in range(n):
        v = verify(Sampler(SamplingParams(temperature=1.0, seed=seed)), np.stack([ROW, ROW]), [drafted])
        if v.accepted == 0:
            counts[v.tokens[0]] += 1
    assert counts[drafted] == 0
    keep = residual > 0
    assert _chi2(counts[keep], residual[keep]) < CHI2_7DOF_P1E4  # 6 degrees of freedom: stricter still


def test_a_wrong_rule_is_caught_by_the_same_check() -> None:
    """Keeping every draft (no acceptance test) skews the distribution: the check sees it."""
    counts, p = np.zeros(V), _probs(ROW)
    counts[4] = 6000
    assert _chi2(counts, p) > CHI2_7DOF_P1E4


def test_a_seeded_answer_is_the_same_whatever_was_drafted() -> None:
    rng = np.random.default_rng(5)
    rows = rng.normal(size=(6, V)).astype(np.float32)
    params = SamplingParams(temperature=0.8, top_k=6, seed=11, max_tokens=50)
    plain = Sampler(params)
    expected = [plain.sample(row) for row in rows]
    for draft in ([], expected[:5], [1, 2, 3, 4, 5], [*expected[:2], 7, 0, 0]):
        s, out, at = Sampler(params), [], 0
        while at < len(rows):  # verify in steps of what the draft allows, as a decode loop does
            d = draft[at : min(at + 2, len(rows) - 1)]
            v = verify(s, rows[at : at + len(d) + 1], d)
            out += v.tokens
            at += len(v.tokens)
        assert out[: len(expected)] == expected, draft


def test_a_step_ahead_holds_only_where_the_whole_draft_and_the_guess_were_kept() -> None:
    assert holds(Verdict((4, 5, 6), 2, None), (4, 5, 6))
    assert not holds(Verdict((4, 5, 7), 2, None), (4, 5, 6))  # another token than the guess
    assert not holds(Verdict((4, 8), 1, None), (4, 5, 6))  # a draft token missed
    assert not holds(Verdict((4, 5, 6), 2, "stop"), (4, 5, 6))  # the request ended there
    assert not holds(Verdict((4,), 1, None, tied=True), (4, 5, 6))  # a near tie cut it short
