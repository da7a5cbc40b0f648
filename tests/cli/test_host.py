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
