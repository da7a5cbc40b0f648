"""The environment every `kafila` command reads: shown in each command's help, and a bad value
refused by name rather than taken for the default."""

import pytest

from kafila.cli import COMMANDS, main


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_commands_help_lists_the_environment(command: str, capsys) -> None:
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    shown = capsys.readouterr().out
    for name in ("KAFILA_LOG=console|json", "KAFILA_LOG_LEVEL=LEVEL", "KAFILA_CACHE=DIR"):
        assert name in shown, command


@pytest.mark.parametrize(
    ("env", "value", "named"),
    [
        (
            "KAFILA_LOG_LEVEL",
            "verbose",
            "KAFILA_LOG_LEVEL='verbose': expected one of debug, info, warning, error",
        ),
        ("KAFILA_LOG", "yaml", "KAFILA_LOG='yaml': expected one of console, json"),
    ],
)
def test_a_log_setting_that_is_not_one_is_refused_by_name(env, value, named, monkeypatch, capsys) -> None:
    """KAFILA_LOG_LEVEL=verbose used to log at info, as if it were not set."""
    monkeypatch.setenv(env, value)
    with pytest.raises(SystemExit) as done:
        main(["models"])
    assert done.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and f"kafila: error: {named}" in err


def test_log_settings_are_read_whatever_their_case(monkeypatch, capsys) -> None:
    monkeypatch.setenv("KAFILA_LOG_LEVEL", "WARNING")
    monkeypatch.setenv("KAFILA_LOG", "Json")
    assert main(["trace", "summarize", "/nonexistent/trace.jsonl"]) == 1
    assert "kafila trace: /nonexistent/trace.jsonl: No such file or directory" in capsys.readouterr().err
