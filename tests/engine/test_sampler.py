"""Sampler: greedy, temperature, top-k, top-p, seeds, stop rules."""

from __future__ import annotations

import numpy as np
import pytest

from kafila.engine.sampler import Sampler, SamplingParams, distribution

LOGITS = np.array([1.0, 3.0, 2.0, 0.5, 2.9, -1.0], dtype=np.float32)


def test_greedy_is_argmax() -> None:
    assert Sampler(SamplingParams()).sample(LOGITS) == 1


def test_temperature_gives_softmax_of_scaled_logits() -> None:
    p = distribution(LOGITS, temperature=0.5)
    z = np.exp((LOGITS - LOGITS.max()) / 0.5)
    np.testing.assert_allclose(p, z / z.sum(), rtol=1e-6)


def test_top_k_keeps_only_the_k_most_likely() -> None:
    p = distribution(LOGITS, temperature=1.0, top_k=2)
    assert set(np.flatnonzero(p)) == {1, 4}
    assert p.sum() == pytest.approx(1.0)


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    full = distribution(LOGITS, temperature=1.0)
    order = np.argsort(-full)
    p = distribution(LOGITS, temperature=1.0, top_p=0.8)
    kept = set(np.flatnonzero(p))
    assert full[order[:2]].sum() < 0.8 <= full[order[:3]].sum()
    assert kept == set(order[:3].tolist())


def test_seeded_requests_repeat_and_different_seeds_differ() -> None:
    logits = np.zeros(1000, dtype=np.float32)

    def draw(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, seed=seed, max_tokens=50))
        return [s.sample(logits) for _ in range(20)]

    assert draw(7) == draw(7)
    assert draw(7) != draw(8)


def test_sampling_frequencies_follow_the_distribution() -> None:
    s = Sampler(SamplingParams(temperature=1.0, top_k=3, seed=0, max_tokens=10_000))
    counts = np.bincount([s.sample(LOGITS) for _ in range(4000)], minlength=6) / 4000
    np.testing.assert_allclose(counts, distribution(LOGITS, 1.0, top_k=3), atol=0.03)


def test_stops_on_eos_stop_tokens_and_max_tokens() -> None:
    s = Sampler(SamplingParams(max_tokens=3, stop_token_ids=(9,)), eos_ids=(2,))
    s.sample(LOGITS)
    assert s.stop_reason(2) == "stop" and s.stop_reason(9) == "stop" and s.stop_reason(5) is None
    s.sample(LOGITS)
    s.sample(LOGITS)
    assert s.stop_reason(5) == "length"


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"temperature": -1}, "temperature must be a finite number >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \[0, 1\]"),
        ({"top_k": -2}, "top_k must be >= 0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1"),
    ],
)
def test_bad_parameters_are_refused_by_name(kw: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_negative_seeds_repeat_and_differ_from_each_other() -> None:
    def draw(seed: int) -> list[int]:
        s = Sampler(SamplingParams(temperature=1.0, seed=seed, max_tokens=50))
        rng = np.random.default_rng(7)
        return [s.sample(rng.standard_normal(100).astype(np.float32)) for _ in range(20)]

    assert draw(-1) == draw(-1) and draw(-5) == draw(-5)
    assert draw(-1) != draw(-5)


def test_top_p_zero_keeps_only_the_most_likely_token() -> None:
    logits = np.random.default_rng(3).standard_normal(1000).astype(np.float32)
    s = Sampler(SamplingParams(temperature=1.5, top_p=0.0, seed=1, max_tokens=50))
    assert {s.sample(logits) for _ in range(20)} == {int(np.argmax(logits))}


@pytest.mark.parametrize("temperature", [5e-324, 1e-300, 1e-6])
def test_a_temperature_near_zero_samples_greedily_instead_of_overflowing(temperature: float) -> None:
    """logits / 5e-324 overflows to inf and the draw took NaN probabilities: one such request
    failed the ring member sampling it, and with it every request of the session."""
    logits = np.random.default_rng(4).standard_normal(1000).astype(np.float32) * 30
    s = Sampler(SamplingParams(temperature=temperature, seed=2, max_tokens=50))
    with np.errstate(all="raise"):
        assert {s.sample(logits) for _ in range(20)} == {int(np.argmax(logits))}


@pytest.mark.parametrize("temperature", [float("nan"), float("inf"), -0.5])
def test_a_temperature_that_is_not_a_finite_number_at_least_zero_is_refused(temperature: float) -> None:
    with pytest.raises(ValueError, match="temperature must be a finite number >= 0"):
        SamplingParams(temperature=temperature)


# ------------------------------------------------------------------ penalties


def test_no_penalty_leaves_the_logits_untouched() -> None:
    sampler = Sampler(SamplingParams(), prompt=[1, 2, 3])
    assert sampler.penalized(LOGITS) is LOGITS  # not even copied: the default path costs nothing
    sampler.sample(LOGITS)
    assert sampler.penalized(LOGITS) is LOGITS


def test_repeat_penalty_divides_positive_and_multiplies_negative_logits_of_recent_tokens() -> None:
    """llama.cpp's and transformers' rule, over the last repeat_last_n tokens of prompt and answer."""
    sampler = Sampler(SamplingParams(repeat_penalty=2.0, repeat_last_n=3), prompt=[0, 1, 5, 3])
    z = sampler.penalized(LOGITS)  # window [1, 5, 3]: token 0 fell out of it
    np.testing.assert_allclose(z, [1.0, 1.5, 2.0, 0.25, 2.9, -2.0])
    assert sampler.sample(LOGITS) == 4  # greedy: 2.9 now beats token 1's 1.5
    np.testing.assert_allclose(sampler.penalized(LOGITS), [1.0, 3.0, 2.0, 0.25, 1.45, -2.0])  # [5, 3, 4]


def test_presence_and_frequency_penalties_count_the_answer_only() -> None:
    """OpenAI's rule as vLLM reads it: logit - presence * [seen] - frequency * count, over the
    answer's tokens (the prompt's are not counted)."""
    sampler = Sampler(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[4, 4, 4])
    assert sampler.penalized(LOGITS) is LOGITS
    assert sampler.sample(LOGITS) == 1
    np.testing.assert_allclose(sampler.penalized(LOGITS), [1.0, 2.25, 2.0, 0.5, 2.9, -1.0])
    assert sampler.sample(LOGITS) == 4
    assert sampler.sample(LOGITS) == 1  # 2.25 beats 4's 2.15 and 2's 2.0
    np.testing.assert_allclose(sampler.penalized(LOGITS), [1.0, 2.0, 2.0, 0.5, 2.15, -1.0])


def test_a_negative_presence_penalty_favours_what_was_said() -> None:
    sampler = Sampler(SamplingParams(presence_penalty=-2.0))
    assert [sampler.sample(np.array([1.0, 0.0, 0.9], dtype=np.float32)) for _ in range(3)] == [0, 0, 0]
    sampler = Sampler(SamplingParams(presence_penalty=2.0))
    assert [sampler.sample(np.array([1.0, 0.0, 0.9], dtype=np.float32)) for _ in range(3)] == [0, 2, 1]


@pytest.mark.parametrize(
    ("kw", "named"),
    [
        ({"repeat_penalty": 0.0}, "repeat_penalty must be a finite number > 0, got 0.0"),
        ({"repeat_penalty": float("nan")}, "repeat_penalty must be a finite number > 0"),
        ({"repeat_last_n": -1}, "repeat_last_n must be >= 0, got -1"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2], got 2.5"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty must be in [-2, 2], got nan"),
    ],
)
def test_penalties_out_of_range_are_refused_by_name(kw, named) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(**kw)
    assert named in str(err.value)


def test_min_p_keeps_the_tokens_at_least_p_times_as_likely_as_the_most_likely() -> None:
    full = distribution(LOGITS, temperature=1.0)
    p = distribution(LOGITS, temperature=1.0, min_p=0.3)
    kept = set(np.flatnonzero(p))
    assert kept == {i for i in range(len(LOGITS)) if full[i] >= 0.3 * full.max()} == {1, 2, 4}
    np.testing.assert_allclose(p[[1, 2, 4]], full[[1, 2, 4]] / full[[1, 2, 4]].sum())
    assert set(np.flatnonzero(distribution(LOGITS, temperature=1.0, min_p=1.0))) == {1}
    with pytest.raises(ValueError, match=r"min_p must be in \[0, 1\], got 1.5"):
        SamplingParams(min_p=1.5)


def test_a_seeded_draw_with_min_p_only_picks_kept_tokens() -> None:
    sampler = Sampler(SamplingParams(temperature=1.0, min_p=0.3, seed=3))
    assert {sampler.sample(LOGITS) for _ in range(200)} == {1, 2, 4}


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, seed=7, max_tokens=12, repeat_penalty=1.3, repeat_last_n=4),
        SamplingParams(max_tokens=12, presence_penalty=0.8, frequency_penalty=0.5),
        SamplingParams(temperature=1.2, top_k=4, seed=3, max_tokens=12, frequency_penalty=0.3),
    ],
)
def test_a_sampler_replaying_the_tokens_of_another_goes_on_as_that_one_would(params: SamplingParams) -> None:
    """A request carried to a new head: a sampler given the prompt and replaying the tokens a lost
    head sampled continues with the same tokens and stop rule as the sampler that went on."""
    rng = np.random.default_rng(11)
    steps = [rng.normal(size=LOGITS.shape[0]).astype(np.float32) for _ in range(12)]
    prompt = [1, 2, 5]
    whole = Sampler(params, (), prompt)
    tokens = [whole.sample(z) for z in steps]
    for cut in (1, 5, 11):
        carried = Sampler(params, (), prompt)
        carried.replay(tokens[:cut])
        assert [carried.sample(z) for z in steps[cut:]] == tokens[cut:]
        assert carried.stop_reason(tokens[-1]) == whole.stop_reason(tokens[-1]) == "length"


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9, max_tokens=12, repeat_penalty=1.3, repeat_last_n=4),  # unseeded
        SamplingParams(max_tokens=12, presence_penalty=0.8, frequency_penalty=0.5),
    ],
)
def test_a_sampler_rewound_to_the_tokens_delivered_forgets_a_lost_draw(params: SamplingParams) -> None:
    """A sampling turn cut off by a re-plan still ran and drew a token that was never delivered:
    the sampler rewound to the tokens delivered (same key, unseeded too) goes on as if that draw had
    not happened, to the same last token and "length"."""
    rng = np.random.default_rng(5)
    steps = [rng.normal(size=LOGITS.shape[0]).astype(np.float32) for _ in range(12)]
    prompt = [3, 1, 4]
    whole = Sampler(params, (7,), prompt)
    moved = Sampler(params, (7,), prompt)
    moved.key = whole.key
    tokens = [whole.sample(z) for z in steps]
    delivered = [moved.sample(z) for z in steps[:5]]
    moved.sample(steps[9])  # the cut turn's draw
    rewound = moved.rewound(prompt, delivered)
    assert rewound.key == whole.key and rewound.stop_ids == whole.stop_ids
    assert [rewound.sample(z) for z in steps[5:]] == tokens[5:]
    assert rewound.stop_reason(tokens[-1]) == "length" and moved.generated == 6
