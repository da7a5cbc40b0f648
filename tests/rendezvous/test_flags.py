"""`kafila rendezvous` refuses flags it cannot serve with at the parser (or before binding anything),
naming the flag and the value: a bad limit used to start and fail every client silently."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import pytest

from kafila.cli import build_parser
from kafila.cli.rendezvous import flag_problems, main
from kafila.rendezvous.limits import ZERO_ALLOWED, Limits

LIMIT_FLAGS = ["--" + f.name.replace("_", "-") for f in dataclasses.fields(Limits)]


def parse(*argv: str) -> argparse.Namespace:
    return build_parser("rendezvous").parse_args(["rendezvous", *argv])


def refusal(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("flag", LIMIT_FLAGS)
@pytest.mark.parametrize("value", ["nan", "inf", "-inf", "-1", "abc"])
def test_every_limit_flag_refuses_non_finite_and_negative_values(
    capsys: pytest.CaptureFixture[str], flag: str, value: str
) -> None:
    err = refusal(capsys, f"{flag}={value}")  # "-inf" alone would read as an option
    assert f"argument {flag}: must be a " in err and f"got '{value}'" in err


def test_zero_is_refused_except_where_it_means_off(capsys: pytest.CaptureFixture[str]) -> None:
    for flag in LIMIT_FLAGS:
        name = flag[2:].replace("-", "_")
        if name in ZERO_ALLOWED:  # no byte rate limit / a rendezvous that does not relay
            assert getattr(parse(flag, "0"), "limit_" + name) == 0
        else:
            assert f"argument {flag}: must be a " in refusal(capsys, flag, "0"), flag
    assert parse("--code-ttl-s", "1.5").limit_code_ttl_s == 1.5


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--code-ttl-s", "-5"], "argument --code-ttl-s: must be a finite number > 0, got '-5'"),
        (["--max-connections", "-1"], "argument --max-connections: must be a whole number >= 1, got '-1'"),
        (["--max-message-bytes", "100"], "argument --max-message-bytes: must be a whole number >= 1024"),
        (["--relay-session-bytes-per-s", "-5"], "--relay-session-bytes-per-s: must be a finite number >= 0"),
        (["--relay-channels", "1.5"], "argument --relay-channels: must be a whole number >= 0, got '1.5'"),
        (["--open-burst-per-address", "0"], "--open-burst-per-address: must be a whole number >= 1, got '0'"),
    ],
)
def test_limit_refusals_name_the_flag_the_rule_and_the_value(
    capsys: pytest.CaptureFixture[str], argv: list[str], said: str
) -> None:
    assert said in refusal(capsys, *argv)


@pytest.mark.parametrize("flag", ["--port", "--udp-port", "--udp-alt-port"])
@pytest.mark.parametrize("value", ["-1", "70000", "65536", "abc", "1.5"])
def test_ports_outside_0_65535_are_refused(capsys: pytest.CaptureFixture[str], flag: str, value: str) -> None:
    assert f"argument {flag}: must be 0-65535, got '{value}'" in refusal(capsys, flag, value)
    dest = flag[2:].replace("-", "_")
    assert [getattr(parse(flag, port), dest) for port in ("0", "65535")] == [0, 65535]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (
            ["--host", "127.0.0.1", "--udp-alt-host", "127.0.0.1"],
            "--udp-alt-host 127.0.0.1 is the primary UDP address (--udp-host, default --host): "
            "the alternate address must differ from the primary",
        ),
        (
            ["--udp-host", "::1", "--udp-alt-host", "0:0::1"],
            "--udp-alt-host 0:0::1 is the primary UDP address",
        ),
        (
            ["--udp-alt-host", "127.0.0.2"],  # --host defaults to 0.0.0.0: it takes 127.0.0.2's ports too
            "--udp-alt-host needs a specific primary UDP address, but --udp-host (default --host) is "
            "'0.0.0.0', which takes the UDP ports on every address, 127.0.0.2 included",
        ),
        (
            ["--udp-host", "127.0.0.1", "--udp-alt-host", "0.0.0.0"],
            "--udp-alt-host '0.0.0.0' means every address, the primary included",
        ),
        (
            ["--advertise-alt-host", "203.0.113.11"],
            "--advertise-alt-host 203.0.113.11 is how members reach --udp-alt-host, which is not given",
        ),
        (
            ["--udp-port", "3478", "--udp-alt-port", "3478"],
            "--udp-alt-port 3478 is also --udp-port: the alternate port must differ from the primary",
        ),
        (
            ["--heartbeat-s", "60"],
            "--heartbeat-timeout-s 30 must be longer than --heartbeat-s 60: members would be timed out",
        ),
    ],
)
def test_flags_that_contradict_each_other_are_named(argv: list[str], said: str) -> None:
    problems = flag_problems(parse(*argv))
    assert len(problems) == 1 and problems[0].startswith(said), problems


def test_only_a_distinct_specific_second_address_is_taken() -> None:
    assert flag_problems(parse("--udp-alt-host", "127.0.0.1")) != []  # the same as the primary 0.0.0.0
    assert flag_problems(parse()) == []
    assert flag_problems(parse("--udp-port", "0", "--udp-alt-port", "0")) == []  # two free ports
    assert flag_problems(parse("--udp-alt-host", "")) == []  # compose passes an empty one when unset
    two = ["--udp-host", "127.0.0.1", "--udp-alt-host", "127.0.0.2", "--advertise-alt-host", "203.0.113.11"]
    assert flag_problems(parse(*two)) == []


def test_main_refuses_contradicting_flags_before_binding(capfd: pytest.CaptureFixture[str]) -> None:
    args = parse("--host", "127.0.0.1", "--udp-alt-host", "127.0.0.1", "--log-format", "json")
    assert main(args) == 2
    events = [json.loads(line) for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    assert [(e["event"], e["level"]) for e in events] == [("bad_flags", "error")]
    assert "the alternate address must differ from the primary" in events[0]["error"]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("code_ttl_s", math.inf),
        ("heartbeat_s", math.nan),
        ("max_connections", -1),
        ("open_burst_per_address", 0),
    ],
)
def test_limits_refuse_what_the_flags_refuse(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"limit {field} must be finite and > 0, got {value!r}"):
        dataclasses.replace(Limits(), **{field: value})


def test_limits_refuse_a_heartbeat_timeout_within_the_heartbeat() -> None:
    with pytest.raises(
        ValueError, match=r"heartbeat_timeout_s \(5 s\) must be longer than heartbeat_s \(10 s\)"
    ):
        Limits(heartbeat_timeout_s=5.0)
    assert Limits(relay_session_bytes_per_s=0, relay_channels=0).relay_channels == 0
