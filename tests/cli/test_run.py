"""`kafila run`: flags refused at parse time, before any model is opened."""

import pytest

from kafila.cli import main


@pytest.mark.parametrize("context", ["0", "-1"])
def test_context_below_1_is_refused_naming_the_flag_alone(tmp_path, capsys, context):
    """--context 0 reached the stage, whose message named a concurrency `run` has no flag for."""
    with pytest.raises(SystemExit) as exit_:
        main(["run", "Hi", "--model", str(tmp_path / "none"), "--context", context])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert f"argument --context: must be a whole number >= 1, got '{context}'" in err
    assert "concurrency" not in err
