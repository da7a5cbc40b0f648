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


def test_quantize_writes_a_packed_folder_that_kafila_run_serves(tiny_checkpoint, tmp_path, capsys):
    from kafila.models.checkpoint import Checkpoint

    out = tmp_path / "tiny-q4"
    args = [
        "models",
        "--quantize",
        "q4",
        "--model",
        str(tiny_checkpoint("llama-gqa3-tied")),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    ckpt = Checkpoint.open(out, complete=True)
    assert ckpt.stored_format == "q4" and ckpt.manifest().quant == "q4"
    capsys.readouterr()
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err
