"""Session codes: format, parsing a person's typing, entropy figures the docs quote."""

from __future__ import annotations

import random
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kafila.proto import codes
from kafila.proto.errors import ProtocolError


def test_word_list_is_256_distinct_lowercase_words() -> None:
    assert len(codes.WORDS) == 256 == len(set(codes.WORDS))
    assert all(w.isalpha() and w.islower() for w in codes.WORDS)


def test_entropy_figures() -> None:
    assert codes.PUBLIC_SPACE == 8 * 32**4
    assert round(codes.PUBLIC_BITS, 6) == 23.0
    assert round(codes.SECRET_BITS, 6) == 24.0


def test_new_code_shape_and_round_trip() -> None:
    rng = random.Random(7)
    public = codes.new_public(rng.randrange)
    code = codes.new_code(public, rng.randrange)
    text = str(code)
    assert text.count("-") == 4 and text.startswith(public + "-")
    assert codes.parse_code(text) == code
    assert codes.parse_code(text.upper().replace("-", " ")) == code


def test_parse_forgives_lookalikes_and_spacing() -> None:
    assert codes.parse_public(" 4 K7M2 ") == "4-k7m2"
    assert codes.parse_public("4-koil") == "4-k011"


@pytest.mark.parametrize("text", ["", "4", "1-k7m2", "4-k7m", "4-k7m2u", "44-k7m2", "4-k7m2-x"])
def test_bad_public_parts(text: str) -> None:
    with pytest.raises(ProtocolError):
        codes.parse_public(text)


@pytest.mark.parametrize(
    ("typed", "why"),
    [
        (
            "1-abcd-tiger-lamp-ocean",
            "'1-abcd' should look like '4-k7m2': it starts with one digit 2-9, not '1'",
        ),
        (
            "44 k7m2 tiger lamp ocean",
            "'44-k7m2' should look like '4-k7m2': it starts with one digit 2-9, not '44'",
        ),
        (  # "45" is in "23456789" as a substring: not a lead digit all the same
            "45-k7m2-tiger-lamp-ocean",
            "'45-k7m2' should look like '4-k7m2': it starts with one digit 2-9, not '45'",
        ),
        (
            "4-k7m22-tiger-lamp-ocean",
            "'4-k7m22' should look like '4-k7m2': 4 characters follow the digit, not 5",
        ),
        ("4-k7mu-tiger-lamp-ocean", "'4-k7mu' should look like '4-k7m2': 'u' cannot be in it"),
    ],
)
def test_a_bad_public_part_says_what_is_wrong_as_typed(typed: str, why: str) -> None:
    # it said only "should look like '4-k7m2'", and quoted "1 abcd" for "1-abcd"
    with pytest.raises(ProtocolError, match=re.escape(f"session code public part {why}")):
        codes.parse_code(typed)


def test_bad_full_codes() -> None:
    with pytest.raises(ProtocolError, match="has 4 parts, expected 5"):
        codes.parse_code("4-k7m2-tiger-lamp")
    with pytest.raises(ProtocolError, match=r"\['zzzz'\] are not in the word list$"):
        codes.parse_code("4-k7m2-tiger-zzzz-ocean")


def test_a_mistyped_word_is_answered_with_the_words_it_may_have_meant() -> None:
    with pytest.raises(ProtocolError) as err:
        codes.parse_code("4-k7m2-tigre-lamp-ocaen")
    assert str(err.value) == (
        "session code words ['tigre', 'ocaen'] are not in the word list "
        "('tigre': did you mean 'tiger'?; 'ocaen': did you mean 'ocean'?)"
    )


@pytest.mark.parametrize("dash", ["\u2010", "\u2011", "\u2013", "\u2014", "\u2212", " \u2013 "])
def test_dashes_that_chat_apps_and_word_processors_substitute_still_separate(dash: str) -> None:
    """A code pasted from a chat whose hyphens became en dashes was "1 parts, expected 5"."""
    code = codes.parse_code("4-k7m2-tiger-lamp-ocean")
    assert codes.parse_code(dash.join(["4", "k7m2", "tiger", "lamp", "ocean"])) == code


@pytest.mark.parametrize("text", ["", "  ", "- -"])
def test_an_empty_code_is_called_empty(text: str) -> None:
    """It was "session code has 0 parts", which says neither that nothing was typed nor what to type."""
    with pytest.raises(ProtocolError) as err:
        codes.parse_code(text)
    assert str(err.value) == "session code is empty; it looks like '4-k7m2-tiger-lamp-ocean'"
    assert err.value.code == "bad_code"


def test_secret_material_binds_public_and_secret() -> None:
    a = codes.SessionCode("4-k7m2", "tiger-lily-ocean")
    b = codes.SessionCode("5-k7m2", "tiger-lily-ocean")
    assert a.secret_material() != b.secret_material()
    assert b"tiger-lily-ocean" in a.secret_material()


@settings(deadline=None)
@given(st.text(max_size=60))
def test_fuzz_parse_is_defined(text: str) -> None:
    for parse in (codes.parse_public, codes.parse_code):
        try:
            parse(text)
        except ProtocolError as exc:
            assert exc.code == "bad_code"


@pytest.mark.parametrize(
    "pasted",
    ["4-k7m2-tiger-lamp-ocean.", '"4-k7m2-tiger-lamp-ocean"', "(4-k7m2-tiger-lamp-ocean)",
     "`4-k7m2-tiger-lamp-ocean`", "\u201c4-k7m2-tiger-lamp-ocean\u201d", " 4-k7m2-tiger-lamp-ocean!\n"],
)  # fmt: skip
def test_a_code_copied_out_of_a_sentence_parses_without_its_quotes_and_full_stop(pasted: str) -> None:
    """'... join with 4-k7m2-tiger-lamp-ocean.' gave "words ['ocean.'] are not in the word list"."""
    assert codes.parse_code(pasted) == codes.parse_code("4-k7m2-tiger-lamp-ocean")
