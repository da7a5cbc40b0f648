"""`kafila run`: flags refused at parse time, before any model is opened."""

import io

import pytest

from kafila.cli import main
from kafila.cli.run import read_prompt


@pytest.mark.parametrize("context", ["0", "-1"])
def test_context_below_1_is_refused_naming_the_flag_alone(tmp_path, capsys, context):
    """--context 0 reached the stage, whose message named a concurrency `run` has no flag for."""
    with pytest.raises(SystemExit) as exit_:
        main(["run", "Hi", "--model", str(tmp_path / "none"), "--context", context])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"argument --context: must be a whole number >= 1, got '{context}'" in err
    assert "concurrency" not in err


class _Stdin(io.StringIO):
    def __init__(self, text: str, tty: bool) -> None:
        super().__init__(text)
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_the_prompt_comes_from_standard_input_for_a_dash_or_a_pipe():
    assert read_prompt("-", _Stdin("The capital of France is\n", tty=False)) == "The capital of France is"
    assert read_prompt(None, _Stdin("line one\nline two\r\n\n", tty=False)) == "line one\nline two"
    assert read_prompt("-", _Stdin("typed, then Ctrl-D\n", tty=True)) == "typed, then Ctrl-D"


def test_a_prompt_given_as_an_argument_is_taken_as_typed_and_stdin_left_unread():
    stdin = _Stdin("unread", tty=False)
    assert read_prompt("Hi\n", stdin) == "Hi\n"
    assert stdin.read() == "unread"


def test_no_prompt_at_a_terminal_is_refused_saying_how_to_give_one(capsys):
    with pytest.raises(ValueError, match=r"give a PROMPT, or '-' to read it from standard input"):
        read_prompt(None, _Stdin("", tty=True))
