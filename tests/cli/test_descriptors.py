"""A serving command's start: the soft descriptor limit raised to the hard one, said once; the
API's limit flags reach a member's options."""

from __future__ import annotations

import logging
import resource

import pytest
import structlog

from kafila.api.overload import ApiLimits
from kafila.cli import build_parser
from kafila.cli.descriptors import raise_descriptor_limit


def test_the_soft_descriptor_limit_is_raised_to_the_hard_one_and_logged_once() -> None:
    """Logged at debug level: a host's first lines are its code, which scripts read."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    lowered = 256 if hard == resource.RLIM_INFINITY else min(256, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (lowered, hard))
    wrapper = structlog.get_config()["wrapper_class"]
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG))
    try:
        with structlog.testing.capture_logs() as logs:
            after = raise_descriptor_limit()
        assert after is not None
        now = resource.getrlimit(resource.RLIMIT_NOFILE)
        assert now == after and now[1] == hard
        assert now[0] == hard if hard != resource.RLIM_INFINITY else now[0] > lowered
        [event] = [e for e in logs if e["event"] == "descriptor_limit"]
        assert event["soft_before"] == lowered and event["soft"] == now[0]
    finally:
        structlog.configure(wrapper_class=wrapper)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


@pytest.mark.parametrize("command", [["host"], ["join", "4-k7m2-tiger-lamp-ocean"]])
def test_the_api_limit_flags_reach_a_members_options_and_bad_values_are_refused(capsys, command) -> None:
    from kafila.cli.host import options

    parser = build_parser(command[0])
    assert options(parser.parse_args(command)).api_limits == ApiLimits()  # type: ignore[attr-defined]
    flags = ["--api-max-connections", "100", "--api-max-unauthenticated", "8", "--api-read-timeout", "3"]
    given = options(parser.parse_args([*command, *flags]))
    assert given.api_limits == ApiLimits(100, 8, 3.0)  # type: ignore[attr-defined]
    for flag, value in (("--api-max-connections", "0"), ("--api-read-timeout", "-1")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args([*command, flag, value])
        assert exit_.value.code == 2
        assert f"argument {flag}: must be" in capsys.readouterr().err
