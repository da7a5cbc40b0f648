"""What a member offers the session: a real probe, and its reuse by a spare that joins again under
the same terms (kafila.session.forming.measure)."""

from __future__ import annotations

import pytest

from kafila.probe import measure as probing
from kafila.session.forming.measure import Measurements, probe_report
from kafila.session.terms import Options

TINY = {
    "model_type": "qwen3", "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256, "vocab_size": 256,
}  # fmt: skip


@pytest.fixture(autouse=True)
def short_windows(monkeypatch):
    monkeypatch.setattr(probing, "WINDOW_S", 0.01)
    monkeypatch.setattr(probing, "QUOTA_WINDOW_S", 0.1)


def test_a_second_report_under_the_same_terms_reuses_the_measurement_and_other_terms_measure(capsys):
    opts = Options(model="tiny", probe_repeats=1, memory_bytes=300_000_000)
    measured = Measurements()
    first = probe_report("beta", None, opts, TINY, measured)
    assert capsys.readouterr().err.count("measuring this device") == 1

    again = probe_report("beta-2", None, opts, TINY, measured)  # joining again: a new name
    said = capsys.readouterr().err
    assert "measuring this device" not in said and "beta-2: measured 0 s ago" in said, said
    assert again.name == "beta-2" and again.memory_bytes == 300_000_000  # --memory-gb still caps it
    assert {**again.to_dict(), "name": "beta"} == first.to_dict()

    other = {**TINY, "num_hidden_layers": 3}  # another model: measured anew, and kept beside
    probe_report("beta", None, opts, other, measured)
    assert capsys.readouterr().err.count("measuring this device") == 1
    probe_report("beta", None, opts, TINY, None)  # no store (a host): always measured
    assert capsys.readouterr().err.count("measuring this device") == 1
