"""Trace records: JSON-lines round trip, Table IV summary arithmetic, the CLI, and metrics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kafila.cli import main as cli_main
from kafila.obs import metrics
from kafila.obs.trace import (
    HopTrace,
    RequestRecord,
    SessionRecord,
    StageTrace,
    TraceLog,
    read_lines,
    summarize,
)


def request(rid: int, measured: tuple[float, float, float], decode_s: float = 1.0) -> RequestRecord:
    members = ("a", "b", "c")
    predicted = (10.0, 10.0, 20.0)
    stages = tuple(
        StageTrace(m, i, (i * 3, i * 3 + 3), i == 0, predicted[i], measured[i], steps=9, bytes_out=100)
        for i, m in enumerate(members)
    )
    hops = (HopTrace("a", "b", "direct", 100, 10), HopTrace("b", "c", "relay", 100, 10))
    return RequestRecord(
        session="s1",
        request_id=rid,
        member="b",
        division="kafila",
        prompt_tokens=5,
        completion_tokens=11,
        queue_s=0.5,
        prefill_s=0.25,
        decode_s=decode_s,
        circuit_ms=44.0,
        stages=stages,
        hops=hops,
    )


def session() -> SessionRecord:
    return SessionRecord(
        session="s1",
        model="tiny",
        division="kafila",
        order=("a", "b", "c"),
        head="a",
        blocks={"a": (0, 3), "b": (3, 6), "c": (6, 9)},
        predicted_stage_ms={"a": 10.0, "b": 10.0, "c": 20.0},
        predicted_bottleneck_ms=20.0,
        predicted_circuit_ms=41.0,
        edges={"a->b": "direct", "b->c": "relay", "c->a": "direct"},
    )


def test_request_derived_figures() -> None:
    r = request(1, (10, 10, 20), decode_s=2.0)
    assert r.ttft_s == pytest.approx(0.75)
    assert r.tokens_per_s == pytest.approx(10 / 2.0)  # 10 decode steps after the first token


def test_log_round_trips_through_json_lines(tmp_path: Path) -> None:
    log = TraceLog(tmp_path / "t" / "trace.jsonl", keep=2)
    records = [session(), request(1, (10, 10, 20)), request(2, (11, 9, 22))]
    for r in records:
        log.write(r)
    assert list(read_lines((tmp_path / "t" / "trace.jsonl").read_text().splitlines())) == records
    assert [d["type"] for d in log.recent()] == ["request", "request"]


def test_summary_gives_table_iv_columns() -> None:
    cold = request(1, (50, 50, 50), decode_s=10.0)
    warm = [request(2, (8, 10, 25), 1.0), request(3, (12, 10, 15), 2.0), request(4, (10, 10, 20), 4.0)]
    [s] = summarize([session(), cold, *warm])
    assert s.requests == 3  # the cold first request is dropped
    assert s.stage_ms == {"a": 10, "b": 10, "c": 20}
    assert (s.bottleneck_ms, s.bottleneck_member) == (20, "c")
    assert s.imbalance == pytest.approx(2.0)
    assert s.utilisation == pytest.approx((40 / 3) / 20)
    assert s.tokens_per_s == pytest.approx(5.0)
    assert s.tokens_per_s_spread == pytest.approx((10 - 2.5) / 2)
    # |pred - meas| / meas over 9 stages: 0.25, 0, 0.2, 0.1667, 0, 0.3333, 0, 0, 0 -> median 0
    assert s.prediction_error == pytest.approx(0.0)
    assert s.circuit_ms == 44.0


def test_bad_trace_line_names_the_line() -> None:
    with pytest.raises(ValueError, match="trace line 2"):
        list(read_lines([json.dumps(session().to_json()), '{"type": "nonsense"}']))


def test_cli_summarize_prints_the_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.jsonl"
    log = TraceLog(path)
    for r in [session(), request(1, (10, 10, 20)), request(2, (10, 10, 20), 2.0)]:
        log.write(r)
    assert cli_main(["trace", "summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert "imbal" in out and "bneck ms" in out and "util" in out and "pred err" in out
    assert "2.00" in out and "20.00" in out and " c" in out
    assert cli_main(["trace", "summarize", str(path), "--json"]) == 0
    [d] = json.loads(capsys.readouterr().out)
    assert d["bottleneck_member"] == "c" and d["tokens_per_s"] == pytest.approx(5.0)


def test_cli_summarize_refuses_an_empty_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    assert cli_main(["trace", "summarize", str(tmp_path / "empty.jsonl")]) == 1
    assert "no finished request" in capsys.readouterr().err


def test_metrics_are_fed_from_the_record() -> None:
    metrics.observe_session(session())
    metrics.observe_request(request(7, (10, 12, 21), 2.0))
    text = metrics.exposition().decode()
    assert 'kafila_stage_compute_ms{member="b",stage="1"} 12.0' in text
    assert 'kafila_stage_predicted_ms{member="c",stage="2"} 20.0' in text
    assert 'kafila_hop_bytes_total{hop="b->c",path="relay"}' in text
    assert "kafila_decode_tokens_per_second 5.0" in text
    assert "kafila_predicted_bottleneck_ms 20.0" in text
