"""Trace records: JSON-lines round trip, Table IV summary arithmetic, the CLI (metrics: test_metrics)."""

from __future__ import annotations

import json
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from kafila.cli import main as cli_main
from kafila.obs.trace import (
    HopTrace,
    RequestRecord,
    SessionRecord,
    StageRecord,
    StageTrace,
    TraceLog,
    summarize,
    summarize_stages,
)
from kafila.obs.tracefile import read_lines


def request(rid: int, measured: tuple[float, float, float], decode_s: float = 1.0) -> RequestRecord:
    members = ("a", "b", "c")
    predicted = (10.0, 10.0, 20.0)
    stages = tuple(
        StageTrace(m, i, (i * 3, i * 3 + 3), i == 0, predicted[i], measured[i], steps=9, bytes_out=100)
        for i, m in enumerate(members)
    )
    hops = (HopTrace("a", "b", "direct", 100, 10, 0.5, 0.4), HopTrace("b", "c", "relay", 100, 10, 30.0))
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
        transit_ms=3.0,
    )


def stage(rid: int, member: str, decode_ms: float, bytes_out: int = 4000) -> StageRecord:
    index = {"a": 0, "b": 1, "c": 2}[member]
    before, after = "abc"[index - 1], "abc"[(index + 1) % 3]
    return StageRecord(
        session="s1",
        member=member,
        index=index,
        blocks=(index * 3, index * 3 + 3),
        head=index == 0,
        request_id=rid,
        predicted_ms=10.0,
        decode_ms=decode_ms,
        decode_steps=9,
        prefill_ms=(4.0, 6.0),
        hop_in=HopTrace(before, member, "direct", 3000, 11, 0.8, None),
        hop_out=HopTrace(member, after, "relay", bytes_out, 11, 25.0, 20.0),
        wait_ms=decode_ms / 10,
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
    records = [session(), request(1, (10, 10, 20)), request(2, (11, 9, 22)), stage(2, "b", 9.5)]
    for r in records:
        log.write(r)
    assert list(read_lines((tmp_path / "t" / "trace.jsonl").read_text().splitlines())) == records
    assert [d["type"] for d in log.recent()] == ["request", "stage"]


def test_old_request_lines_without_hop_times_still_read() -> None:
    d = request(1, (10, 10, 20)).to_json()
    del d["transit_ms"]
    for h in d["hops"]:
        del h["rtt_ms"], h["predicted_rtt_ms"]
    [r] = read_lines([json.dumps(d)])
    assert isinstance(r, RequestRecord) and r.hops[0].rtt_ms is None and r.transit_ms == 0.0


def test_stage_summary_per_member() -> None:
    recs = [stage(1, "b", 50.0, 1), stage(2, "b", 8.0), stage(3, "b", 12.0), stage(2, "c", 10.0)]
    b, c = summarize_stages([session(), *recs])
    assert (b.member, b.requests, c.member, c.requests) == ("b", 2, "c", 1)  # b's first dropped as cold
    assert b.decode_ms == pytest.approx(10.0) and b.predicted_ms == 10.0
    assert b.prediction_error == pytest.approx(statistics.median([2 / 8, 2 / 12]))
    assert b.prefill_chunk_ms == pytest.approx(5.0) and b.wait_ms == pytest.approx(1.0)
    assert (b.bytes_in, b.bytes_out, b.rtt_ms, b.predicted_rtt_ms) == (3000, 4000, 25.0, 20.0)
    [b_all, _] = summarize_stages(recs, drop_cold=False)
    assert b_all.requests == 3


def test_table_iv_counts_finished_requests_only() -> None:
    """A cancelled request's 7 tokens (4.92 tok/s against 3.5) and a broken ring's failed one
    widened the spread of a tester's three finished requests from 3.6 +-0.1 to +-1.1."""
    finished = [request(i, (10, 10, 20), 1.0) for i in (1, 2, 3)]
    cut = [
        replace(request(4, (10, 10, 20), 0.2), finish="cancelled"),
        replace(request(5, (90, 10, 20)), finish="error"),
    ]
    [s] = summarize([session(), *finished, *cut], drop_cold=False)
    assert s.requests == 3 and s.tokens_per_s_spread == 0 and s.stage_ms["a"] == 10


def test_cli_says_how_many_cancelled_or_failed_requests_it_left_out(tmp_path: Path, capsys) -> None:
    path = tmp_path / "trace.jsonl"
    log = TraceLog(path)
    for r in [session(), request(1, (10, 10, 20)), replace(request(2, (10, 10, 20)), finish="error")]:
        log.write(r)
    assert cli_main(["trace", "summarize", str(path), "--keep-cold"]) == 0
    title = "Table IV from 2 request records (the head's whole-ring view; 1 cancelled or failed not counted;"
    assert title in capsys.readouterr().out


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
    assert s.transit_ms == 3.0  # hops and waits: the circuit less the stages' compute


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
    assert "transit ms" in out and "3.00" in out
    assert "2.00" in out and "20.00" in out and " c" in out
    assert "Table IV from 2 request records" in out
    assert cli_main(["trace", "summarize", str(path), "--json"]) == 0
    [d] = json.loads(capsys.readouterr().out)["table_iv"]
    assert d["bottleneck_member"] == "c" and d["tokens_per_s"] == pytest.approx(5.0)


def test_cli_summarize_reads_a_member_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "member.jsonl"
    log = TraceLog(path)
    for r in [stage(1, "b", 30.0), stage(2, "b", 11.0), stage(3, "b", 13.0)]:
        log.write(r)
    assert cli_main(["trace", "summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert "no request records" in out and "not the head's trace" in out
    assert "stages from 3 stage records of b" in out
    assert "12.00" in out and "4000" in out and "25.00" in out  # decode ms, bytes out, rtt
    assert cli_main(["trace", "summarize", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["table_iv"] == [] and d["stages"][0]["decode_ms"] == pytest.approx(12.0)


def test_cli_summarize_refuses_an_empty_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "empty.jsonl").write_text("")
    assert cli_main(["trace", "summarize", str(tmp_path / "empty.jsonl")]) == 1
    assert "no finished request" in capsys.readouterr().err


def test_a_file_that_cannot_be_written_does_not_raise(tmp_path: Path) -> None:
    log = TraceLog(tmp_path / "t.jsonl")
    (tmp_path / "t.jsonl").mkdir()  # opening it for appending fails (IsADirectoryError)
    log.write(request(1, (10, 10, 20)))
    assert len(log.recent()) == 1  # /traces still has it
