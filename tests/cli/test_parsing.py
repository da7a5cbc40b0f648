"""What `kafila` says for arguments a command does not take: the command's own usage, not the
top-level one (which lists commands, not the flags the person was looking for)."""

import pytest

from kafila.cli import main


@pytest.mark.parametrize(
    ("argv", "usage", "error"),
    [
        (
            ["run", "hi", "--prompt", "x"],
            "usage: kafila run ",
            "kafila run: error: unrecognized arguments: --prompt x",
        ),
        (
            ["trace", "summarize", "f.jsonl", "--foo"],
            "usage: kafila trace summarize ",
            "kafila trace summarize: error: unrecognized arguments: --foo",
        ),
        (["--foo"], "usage: kafila ", "kafila: error: unrecognized arguments: --foo"),
    ],
)
def test_an_unknown_flag_is_refused_with_its_commands_usage(
    argv: list[str], usage: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage) and err.strip().endswith(error), err
