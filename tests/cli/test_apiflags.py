"""The API limit flags: their defaults, their values, and what they refuse."""

from __future__ import annotations

import argparse

import pytest

from kafila.api.overload import ApiLimits
from kafila.cli.apiflags import add_api_limit_flags, limits_from_args


def test_flags_give_the_limits_and_their_defaults() -> None:
    parser = argparse.ArgumentParser()
    add_api_limit_flags(parser)
    assert limits_from_args(parser.parse_args([])) == ApiLimits()
    args = parser.parse_args(["--api-max-connections", "100", "--api-max-unauthenticated", "5"])
    assert limits_from_args(args) == ApiLimits(100, 5)
    assert limits_from_args(parser.parse_args(["--api-read-timeout", "2.5"])).read_timeout_s == 2.5


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--api-max-connections", "0"], "--api-max-connections: must be a whole number >= 1, got '0'"),
        (["--api-max-unauthenticated", "x"], "--api-max-unauthenticated: must be a whole number >= 1"),
        (["--api-read-timeout", "0"], "--api-read-timeout: must be a finite number > 0, got '0'"),
        (["--api-read-timeout", "inf"], "--api-read-timeout: must be a finite number > 0, got 'inf'"),
    ],
)
def test_flags_refuse_values_the_limits_cannot_take(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    parser = argparse.ArgumentParser()
    add_api_limit_flags(parser)
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert said in capsys.readouterr().err
