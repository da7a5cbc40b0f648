"""The API's context check (kafila.api.params.fit): a prompt and its answer must fit the session's
declared context; what does not is refused with the numbers, in words that count right."""

import pytest

from kafila.api.errors import ApiError
from kafila.api.params import fit


def refusal(prompt_len: int, max_tokens: int | None, context: int) -> str:
    with pytest.raises(ApiError) as err:
        fit(list(range(prompt_len)), max_tokens, context, "max_tokens", "prompt")
    assert err.value.code == "context_length_exceeded"
    return err.value.message


def test_the_answer_takes_what_the_prompt_leaves_and_no_more() -> None:
    assert fit([1, 2, 3], None, 8, "max_tokens") == 5
    assert fit([1, 2, 3], 5, 8, "max_tokens") == 5
    assert refusal(3, 6, 8) == (
        "prompt of 3 tokens plus max_tokens=6 exceeds the session's context of 8 tokens; "
        "at most 5 answer tokens fit"
    )


def test_one_token_is_one_token() -> None:
    # "prompt of 1 tokens ... at most 1 answer tokens fit"
    assert refusal(1, 100, 2) == (
        "prompt of 1 token plus max_tokens=100 exceeds the session's context of 2 tokens; "
        "at most 1 answer token fits"
    )


def test_a_prompt_that_fills_the_context_is_refused_never_truncated() -> None:
    assert refusal(8, None, 8) == (
        "prompt is 8 tokens; the session's context is 8 tokens (prompt plus answer); "
        "shorten the prompt (Kafila never truncates it)"
    )


def test_the_usage_block_says_how_many_drafted_tokens_were_kept_and_dropped() -> None:
    from kafila.api.openai import _usage
    from kafila.api.stream import Tally

    usage = _usage(Tally(prompt_tokens=7, completion_tokens=20, drafted=15, accepted=11))
    assert usage == {
        "prompt_tokens": 7,
        "completion_tokens": 20,
        "total_tokens": 27,
        "completion_tokens_details": {"accepted_prediction_tokens": 11, "rejected_prediction_tokens": 4},
    }
