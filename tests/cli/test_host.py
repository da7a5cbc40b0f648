"""`kafila host`: the session's counts are refused at parse time, as `kafila plan` refuses them."""

import pytest

from kafila.cli import build_parser
from kafila.planner.fleet import MAX_COUNT


@pytest.mark.parametrize("flag", ["--context", "--concurrency"])
def test_counts_past_the_wires_32_bits_are_refused_before_anything_runs(capsys, flag):
    """--concurrency 5000000000 was accepted and refused only after the member had probed."""
    parser = build_parser("host")
    assert getattr(parser.parse_args(["host", flag, str(MAX_COUNT)]), flag[2:]) == MAX_COUNT
    for value, message in ((str(MAX_COUNT + 1), f"must be at most {MAX_COUNT}"), ("0", "must be a whole")):
        with pytest.raises(SystemExit) as exit_:
            parser.parse_args(["host", flag, value])
        assert exit_.value.code == 2
        assert f"argument {flag}: {message}" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["host"], ["join", "4-k7m2-tiger-lamp-ocean"]])
def test_a_members_metrics_address_is_checked_by_the_parser_and_reaches_its_options(capsys, command):
    from kafila.cli.host import options

    parser = build_parser(command[0])
    args = parser.parse_args([*command, "--metrics", "0.0.0.0:9464"])
    assert options(args).metrics == "0.0.0.0:9464"  # type: ignore[attr-defined]
    assert options(parser.parse_args(command)).metrics is None  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*command, "--metrics", "0.0.0.0:99999"])
    assert exit_.value.code == 2
    refused = "argument --metrics: metrics address '0.0.0.0:99999': port 99999 is not 0-65535"
    assert refused in capsys.readouterr().err


def test_quant_is_a_documented_host_flag_that_reaches_the_sessions_options(capsys):
    """`kafila host --quant` chooses the session's weight format (auto by default); the options
    the session is formed with carry it, and a format that is none is refused at parse time."""
    from kafila.cli import main
    from kafila.cli.host import options
    from kafila.engine import QUANT_CHOICES

    with pytest.raises(SystemExit) as done:
        main(["host", "--help"])
    assert done.value.code == 0
    shown = " ".join(capsys.readouterr().out.split())
    assert "--quant {auto,none,int8,q4}" in shown and "members fetch the packed bytes" in shown
    parser = build_parser("host")
    assert parser.parse_args(["host"]).quant == "auto"
    for fmt in QUANT_CHOICES:
        assert options(parser.parse_args(["host", "--quant", fmt, "--api", "off"])).quant == fmt  # type: ignore[attr-defined]
    with pytest.raises(SystemExit):
        parser.parse_args(["host", "--quant", "q3"])
    assert "argument --quant: invalid choice: 'q3'" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["host"], ["join", "4-k7m2-tiger-lamp-ocean"]])
def test_draft_ahead_is_a_members_flag_off_by_default_that_reaches_its_options(capsys, command):
    from kafila.cli.host import options

    parser = build_parser(command[0])
    assert options(parser.parse_args(command)).draft_ahead == 0  # type: ignore[attr-defined]
    assert options(parser.parse_args([*command, "--draft-ahead", "2"])).draft_ahead == 2  # type: ignore[attr-defined]
    with pytest.raises(SystemExit) as exit_:
        parser.parse_args([*command, "--draft-ahead", "-1"])
    assert exit_.value.code == 2
    assert "argument --draft-ahead" in capsys.readouterr().err
