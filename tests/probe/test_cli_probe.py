"""`kafila probe` refuses bad flags before it measures anything (no backend loads for a refusal)."""

from __future__ import annotations

import pytest

from kafila.cli import main
from kafila.probe.measure import probe


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "smollm2-135m", "--position", "-5"], "argument --position: must be a whole number >= 0"),
        (["--repeats", "0"], "argument --repeats: must be a whole number >= 1, got '0'"),
        (["--repeats", "-1"], "argument --repeats: must be a whole number >= 1, got '-1'"),
        (["--dtype", "fp8"], "argument --dtype: invalid choice: 'fp8'"),  # as `kafila run --dtype`
        (["--backend", "nope"], "argument --backend: invalid choice: 'nope'"),
        (["--name", ""], "argument --name: must not be empty"),
        (["--model", ""], "argument --model: must not be empty"),
    ],
)
def test_bad_flags_are_refused_by_the_parser_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["probe", *argv])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_a_model_that_is_neither_a_preset_nor_a_folder_is_named_with_the_presets(tmp_path, capsys):
    """It said "/tmp/bogus: no such model folder", where `kafila plan --model bogus` listed the presets."""
    assert main(["probe", "--model", str(tmp_path / "bogus")]) == 2
    err = capsys.readouterr().err
    presets = "qwen3-14b, qwen3-32b, qwen3-8b, smollm2-135m"
    assert f"model '{tmp_path / 'bogus'}' is neither a preset ({presets}) nor a folder" in err


def test_position_needs_a_model_and_a_position_it_was_trained_for(capsys):
    assert main(["probe", "--position", "5"]) == 2
    assert "--position sets where --model's block is timed; without --model" in capsys.readouterr().err
    # beyond the model's positions the block's KV cache would be allocated for nothing (gigabytes)
    assert main(["probe", "--model", "smollm2-135m", "--position", "100000000", "--repeats", "1"]) == 2
    err = capsys.readouterr().err
    assert (
        "--position 100000000 is beyond the 8192 positions smollm2-135m was trained for (at most 8191)" in err
    )
    assert main(["probe", "--model", "smollm2-135m", "--position", "8192"]) == 2


def test_probe_refuses_repeats_and_positions_it_cannot_time():
    with pytest.raises(ValueError, match="probe repeats must be at least 1, got 0"):
        probe("torch", "fp32", repeats=0)  # no longer the default (`repeats or 5`)
    with pytest.raises(ValueError, match="probe position must be at least 0, got -5"):
        probe("torch", "fp32", repeats=1, position=-5)
