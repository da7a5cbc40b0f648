"""`kafila host` / `kafila join` refuse bad input with one line naming it, never a traceback."""

import subprocess
import sys

import pytest


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["host", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["join", "4-zzzz-bad"], "session code has 3 parts"),
    ],
)
def test_bad_input_is_one_named_error(argv: list[str], named: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kafila", *argv], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert named in done.stderr
    assert "Traceback" not in done.stderr
