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


def test_run_of_a_model_this_machine_lacks_fetches_it_from_a_hub_layout_mirror_once(
    tmp_path, tmp_path_factory, smollm2_tokenizer, monkeypatch, capsys
):
    """A local server laid out like the hub holds a tiny chat model; `kafila run --model tiny
    --weights-from URL` fetches it into the cache's models folder, answers, and the second run
    fetches nothing."""
    from kafila.session.weights.manifest import checkpoint_id
    from tests.session.conftest import make_tiny_chat
    from tests.session.hubserver import Hub, serving

    folder = make_tiny_chat(tmp_path_factory.mktemp("mirror"), smollm2_tokenizer, blocks=2)
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    with serving(Hub(folder)) as hub:
        argv = [
            "run",
            "Hi",
            "--model",
            "tiny",
            "--weights-from",
            hub.url,
            "--max-tokens",
            "2",
            "--context",
            "64",
        ]
        assert main(argv) == 0
        fetched = sum(hub.served.values())
        assert main(argv) == 0 and sum(hub.served.values()) == fetched
    assert checkpoint_id(tmp_path / "cache" / "models" / "tiny") == checkpoint_id(folder)
    assert fetched >= sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    with serving(Hub(folder, repo="other/none")) as hub:
        assert main(["run", "Hi", "--model", "absent", "--weights-from", hub.url + "x"]) == 2
    assert "kafila run: error: mirror" in capsys.readouterr().err
