"""The draft policy (pure): prompt lookup, how many tokens to draft, and what it learns."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kafila.engine.draft import (
    DraftPolicy,
    DraftStats,
    best_k,
    choose_k,
    draft_model_of,
    lookup,
    observe,
    observe_drafting,
    policy_for,
    propose,
    propose_ahead,
)

histories = st.lists(st.integers(0, 5), min_size=0, max_size=60)


@given(histories, st.integers(0, 10), st.integers(1, 4))
def test_a_lookup_is_what_followed_an_earlier_occurrence_of_the_suffix(
    history: list[int], k: int, n: int
) -> None:
    got = lookup(history, k, max_ngram=n)
    assert len(got) <= k
    if not got:
        return
    matches = [
        (m, s)
        for m in range(n, 0, -1)
        for s in range(len(history) - m)
        if history[s : s + m] == history[len(history) - m :]
        and tuple(history[s + m : s + m + len(got)]) == got
    ]
    assert matches, f"{got} follows no earlier occurrence of a suffix of {history}"


@given(st.lists(st.integers(0, 1000), min_size=6, max_size=40, unique=True), st.integers(1, 3))
def test_a_copied_passage_is_drafted_from_where_it_was_copied(passage: list[int], cut: int) -> None:
    history = [*passage, 9999, *passage[:cut]]  # the answer started to copy the prompt
    assert lookup(history, 3) == tuple(passage[cut : cut + 3])


def test_nothing_is_drafted_where_the_history_never_repeats() -> None:
    assert lookup(list(range(50)), 5) == ()
    assert lookup([7], 5) == () and lookup([], 5) == ()


@given(st.floats(0, 0.99), st.floats(1e-4, 1.0), st.floats(1e-4, 1.0), st.integers(0, 16))
def test_longer_circuits_never_want_shorter_drafts(a: float, base: float, row: float, max_k: int) -> None:
    assert best_k(a, base * 2, row, max_k) >= best_k(a, base, row, max_k)


@given(st.floats(0, 0.99), st.floats(1e-4, 1.0), st.floats(1e-4, 1.0), st.integers(0, 16))
def test_higher_acceptance_never_wants_shorter_drafts(a: float, base: float, row: float, max_k: int) -> None:
    assert best_k(min(a + 0.1, 0.99), base, row, max_k) >= best_k(a, base, row, max_k)


def test_drafts_that_never_pay_are_not_made() -> None:
    assert best_k(0.0, 0.01, 0.001, 8) == 0  # nothing is ever kept
    assert best_k(0.5, 0.01, 0.01, 8) == 0  # a row costs a whole circuit: 1.5 tokens in 2 circuits
    assert best_k(0.9, 0.06, 0.001, 8) == 8  # a WAN circuit, cheap rows, good drafts


@given(st.integers(-3, 20), st.integers(0, 12))
def test_the_draft_fits_the_room_the_request_has(room: int, max_k: int) -> None:
    policy = DraftPolicy(max_k=max_k)
    stats = DraftStats(drafted=10, accepted=10, base_s=0.05, row_s=0.0001)
    assert 0 <= choose_k(policy, stats, room) <= max(0, min(room, max_k))
    assert len(propose(policy, stats, [1, 2, 3] * 10, room)) <= max(0, room)


def test_drafts_that_always_miss_cost_a_plain_request_little_and_are_still_tried() -> None:
    policy, stats = DraftPolicy(), DraftStats()
    stats = observe(policy, stats, 0, 0, 0.010)  # a plain step: 10 ms; each drafted row costs 1 ms more
    assert choose_k(policy, stats, 100) > 0  # the prior: drafts are tried
    drafted = []
    for _ in range(400):  # every drafted token misses
        k = choose_k(policy, stats, 100)
        drafted.append(k)
        stats = observe(policy, stats, k, 0, 0.010 + 0.001 * k)
    extra = sum(0.001 * k for k in drafted) / (0.010 * len(drafted))
    assert extra < 0.03, f"drafts that miss made the request {extra:.1%} slower"
    assert drafted[-100:].count(0) > 50 and any(drafted[-100:]), "never stopped, or never tried again"


def test_kept_drafts_raise_k_and_the_measured_row_cost_lowers_it() -> None:
    policy = DraftPolicy(max_k=8)
    cheap = DraftStats(drafted=40, accepted=38, base_s=0.060, row_s=0.0005)
    dear = DraftStats(drafted=40, accepted=38, base_s=0.060, row_s=0.060)
    assert choose_k(policy, cheap, 100) == 8 and choose_k(policy, dear, 100) == 0
    missing = DraftStats(drafted=40, accepted=4, base_s=0.060, row_s=0.0005)
    assert choose_k(policy, missing, 100) < choose_k(policy, cheap, 100)


def test_impossible_counts_and_settings_are_refused_by_number() -> None:
    with pytest.raises(ValueError, match="accepted 3 of 2 drafted tokens"):
        observe(DraftPolicy(), DraftStats(), 2, 3, 0.01)
    with pytest.raises(ValueError, match="min_ngram 3 <= max_ngram 2"):
        DraftPolicy(min_ngram=3, max_ngram=2)


def test_a_proposer_drafts_instead_of_lookup_and_gets_the_length_chosen() -> None:
    policy = DraftPolicy(max_k=4)
    stats = DraftStats(drafted=10, accepted=10, base_s=0.05, row_s=0.0001)
    asked: list[int] = []

    def model(history, k: int) -> tuple[int, ...]:
        asked.append(k)
        return tuple(range(100, 100 + k + 2))  # more than asked: cut to k

    assert propose(policy, stats, [1, 2, 3], 100, model) == (100, 101, 102, 103) and asked == [4]
    assert propose(policy, stats, [1, 2, 3], 2, model) == (100, 101)  # the room left
    assert propose(DraftPolicy(max_k=0), stats, [1, 2, 3], 100, model) == () and asked == [4, 2]


def test_a_costly_draft_model_drafts_shorter_and_stops_where_it_cannot_pay() -> None:
    """Making each drafted token costs the head `draft_s` (a draft model's steps): it adds to a
    drafted row's cost, so a draft model as slow as a circuit per token drafts nothing."""
    policy = DraftPolicy()
    wan = DraftStats(drafted=10, accepted=8, base_s=0.120, row_s=0.002)  # a 20 ms-per-hop ring
    assert choose_k(policy, wan, 100) == 8
    cheap = observe_drafting(policy, wan, 8, 8 * 0.004)  # 4 ms a token: a small model on the head
    assert cheap.draft_s == pytest.approx(0.004) and 0 < choose_k(policy, cheap, 100) <= 8
    slow = observe_drafting(policy, wan, 4, 4 * 0.120)  # as slow per token as the whole circuit
    assert choose_k(policy, slow, 100) == 0
    smoothed = observe_drafting(policy, cheap, 2, 2 * 0.014)  # one slow draft moves it a tenth
    assert smoothed.draft_s == pytest.approx(0.004 + 0.1 * 0.010)
    assert observe_drafting(policy, cheap, 0, 1.0) == cheap  # nothing drafted: nothing learnt


def test_a_draft_value_names_off_lookup_or_a_model() -> None:
    assert policy_for("none") is None and draft_model_of("none") is None
    assert policy_for("lookup") == DraftPolicy() and draft_model_of("lookup") is None
    assert policy_for("smollm2-135m") == DraftPolicy() and draft_model_of("smollm2-135m") == "smollm2-135m"
    with pytest.raises(ValueError, match="choose none or lookup or a model"):
        policy_for(" ")


def test_a_step_ahead_feeds_the_guess_then_a_draft_after_it() -> None:
    """The history assumes the draft in the ring kept whole: lookup goes on past it, its first
    token the guess of the step's own token, the rest a draft of the chosen length."""
    policy = DraftPolicy(max_k=3)
    sure = DraftStats(drafted=10, accepted=10, base_s=0.1, row_s=0.001)
    copied = [7, 1, 2, 3, 4, 5, 6, 9, 7, 1, 2]  # ... and 1 2 assumed kept: 3 guessed, 4 5 6 drafted
    assert propose_ahead(policy, sure, copied, 100) == (3, 4, 5, 6)
    assert propose_ahead(policy, sure, copied, 2) == (3, 4)  # the room the request has
    assert propose_ahead(policy, sure, copied, 0) == ()
    assert propose_ahead(policy, sure, [1, 2, 3], 100) == ()  # nothing to guess from
    doubtful = DraftStats(drafted=10, accepted=0, base_s=0.1, row_s=0.001)
    assert propose_ahead(policy, doubtful, copied, 100) == (3,)  # the guess alone: no draft pays
    asked: list[int] = []

    def model(history, k: int) -> tuple[int, ...]:
        asked.append(k)
        return tuple(range(k + 1))

    assert propose_ahead(policy, sure, copied, 100, model) == (0, 1, 2, 3) and asked == [4]


def test_drafting_ahead_is_part_of_the_policy() -> None:
    assert policy_for("lookup", ahead=1) == DraftPolicy(ahead=1)
    assert policy_for("none", ahead=1) is None
    with pytest.raises(ValueError, match="ahead -1 must be >= 0"):
        DraftPolicy(ahead=-1)
