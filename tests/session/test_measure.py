"""What a member offers the session: a real probe, and its reuse under the same terms by a spare
that joins again and by a member started again (kafila.session.forming.measure)."""

from __future__ import annotations

import json
import os

import pytest

from kafila.probe import measure as probing
from kafila.session.forming.measure import MEASURED_FILE, Measurements, measurement_terms, probe_report
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
    probe_report("beta", None, opts, TINY, None)  # no store: always measured
    assert capsys.readouterr().err.count("measuring this device") == 1


def test_a_member_started_again_offers_its_measurement_from_disk_while_young_with_memory_read_again(
    tmp_path, capsys
):
    """A new process (a new `Measurements` on the same cache folder) offers the measurement the last
    one kept, at most --probe-max-age old; its memory figure is read now, not the one kept. A
    damaged store is measured over and written anew; an unwritable one loses nothing but the copy."""
    (tmp_path / MEASURED_FILE).write_text("{not json")
    opts = Options(model="tiny", probe_repeats=1)
    first = probe_report("beta", None, opts, TINY, Measurements(tmp_path, 600))
    assert capsys.readouterr().err.count("measuring this device") == 1
    kept = json.loads((tmp_path / MEASURED_FILE).read_text())
    (terms,) = kept
    kept[terms]["report"]["memory_bytes"] = 1  # what was free then is not what is free now
    (tmp_path / MEASURED_FILE).write_text(json.dumps(kept))

    again = probe_report("beta", None, opts, TINY, Measurements(tmp_path, 600))
    said = capsys.readouterr().err
    assert "measuring this device" not in said and "offering that measurement" in said, said
    assert again.memory_bytes > 1 and again.memory_bytes == pytest.approx(first.memory_bytes, rel=0.2)
    assert again.bandwidth_bytes_s == first.bandwidth_bytes_s and again.block_s == first.block_s

    at = float(kept[terms]["at"])
    assert Measurements(tmp_path, 600).get(terms, at + 599) is not None
    assert Measurements(tmp_path, 600).get(terms, at + 601) is None  # too old: measured again
    assert Measurements(tmp_path, 0).get(terms, at) is None  # --probe-max-age 0: always measured
    blocked = tmp_path / "a-file"
    blocked.write_text("")
    report, _ = Measurements(tmp_path, 600).get(terms, at) or pytest.fail("kept")
    unwritable = Measurements(blocked / "cache", 600)  # a file where its folder must be
    unwritable.put(terms, report, at)
    assert unwritable.get(terms, at) == (report, 0.0)  # kept in memory for this process


def test_the_terms_name_the_cpus_the_process_may_use_so_a_pinned_member_measures_for_itself():
    opts = Options(model="tiny")
    everything = os.sched_getaffinity(0)
    whole = measurement_terms(opts, TINY)
    try:
        os.sched_setaffinity(0, {min(everything)})
        pinned = measurement_terms(opts, TINY)
    finally:
        os.sched_setaffinity(0, everything)
    assert (pinned != whole) == (len(everything) > 1)
    assert measurement_terms(opts, TINY) == whole
    assert measurement_terms(Options(model="tiny", emulate_speed=0.5), TINY) != whole


def test_a_member_at_an_emulated_pace_says_so_whether_it_measures_or_offers_a_kept_measurement(capsys):
    """It serves at that pace either way, so the console says so either way (a member started again
    within --probe-max-age used to say nothing of it)."""
    opts = Options(model="tiny", probe_repeats=1, emulate_speed=0.5)
    measured = Measurements()
    for offered in ("measuring this device", "measured 0 s ago"):
        probe_report("beta", None, opts, TINY, measured)
        said = capsys.readouterr().err
        assert offered in said and "beta: emulating a slower device, 0.5 of this machine's speed" in said
    probe_report("beta", None, Options(model="tiny", probe_repeats=1), TINY, measured)
    assert "emulating" not in capsys.readouterr().err
