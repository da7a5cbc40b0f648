"""`kafila models`: what --convert refuses (the listing itself is tested in tests/models/test_default.py)."""

from kafila.cli import main


def test_convert_refuses_an_empty_name_rather_than_listing(tmp_path, monkeypatch, capsys):
    """`--convert ""` was falsy, so it listed the models, exit 0, as if no --convert was given."""
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    assert main(["models", "--convert", ""]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kafila models: '' is not a default model (smollm2-135m")


def test_convert_refuses_a_name_that_is_not_a_default_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    assert main(["models", "--convert", "qwen3-8b"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("kafila models: 'qwen3-8b' is not a default model")
