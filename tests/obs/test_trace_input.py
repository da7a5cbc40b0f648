"""`kafila trace summarize` on lines it cannot summarise: each is named by its line and field, and
the figures it prints are strict JSON (null where undefined), never a traceback or a silent gap."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from kafila.cli import main as cli_main
from kafila.obs.trace import Record, summarize, summarize_stages
from kafila.obs.tracefile import read_lines
from tests.obs.test_trace import request, session, stage

Line = Record | dict[str, Any] | list[Any] | int | str | None | bytes


def text(line: Line) -> bytes:
    """One line of a trace file: a record as its writer writes it, any other value as JSON, bytes as is."""
    if isinstance(line, bytes):
        return line
    value = line.to_json() if hasattr(line, "to_json") else line
    return json.dumps(value).encode()


def write(tmp_path: Path, lines: list[Line]) -> Path:
    path = tmp_path / "trace.jsonl"
    path.write_bytes(b"".join(text(line) + b"\n" for line in lines))
    return path


def refusal(tmp_path: Path, capsys: pytest.CaptureFixture[str], lines: list[Line], *flags: str) -> str:
    """The one line `kafila trace summarize` prints as it exits 1 (no traceback)."""
    path = write(tmp_path, lines)
    assert cli_main(["trace", "summarize", str(path), *flags]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"kafila trace: {path}: ")
    return captured.err.strip()


def reject_constant(name: str) -> Any:
    raise AssertionError(f"not strict JSON: {name}")


@pytest.mark.parametrize(
    ("value", "described"),
    [([1, 2], "array [1, 2]"), (5, "number 5"), ("hello", 'string "hello"'), (None, "null")],
)
def test_a_line_that_is_not_an_object_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: Any, described: str
) -> None:
    err = refusal(tmp_path, capsys, [session(), value])
    assert err.endswith(f"trace line 2: expected a JSON object, got {described}")


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b'{"type": ', "trace line 2: not JSON: Expecting value at column 10"),
        (b"[" * 100_000, "trace line 2: not JSON this reader can hold: nested too deeply"),
        (b'{"type": "\xff"}', "trace line 2: not UTF-8 text: byte 0xff at column 11"),
    ],
    ids=["cut short", "nested 100000 deep", "not UTF-8"],
)
def test_a_line_that_is_not_json_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: bytes, message: str
) -> None:
    assert refusal(tmp_path, capsys, [session(), line]).endswith(message)


def test_a_last_line_still_being_written_is_left_out_and_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A live session appends records as requests end: a summary read meanwhile can find the last one
    # half written (no line end yet). It is left out, said on stderr; the rest is summarized.
    path = write(tmp_path, [session(), request(1, (10, 10, 20)), request(2, (10, 10, 20))])
    whole = text(request(3, (10, 10, 20)))
    path.write_bytes(path.read_bytes() + whole[: len(whole) // 2])
    assert cli_main(["trace", "summarize", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == f"kafila trace: {path}: line 4 is cut short (still being written?); left out\n"
    assert "Table IV from 2 request records" in captured.out
    path.write_bytes(path.read_bytes() + whole[len(whole) // 2 :])  # whole now, still no line end: read
    assert cli_main(["trace", "summarize", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and "Table IV from 3 request records" in captured.out


def test_a_request_without_stages_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The head writes a stage per member of the ring (at least itself): a request without one is not
    # a request this file's ring served, and a table without it would not say so. Refused, named.
    d = request(2, (10, 10, 20)).to_json()
    d["stages"] = []
    err = refusal(tmp_path, capsys, [request(1, (10, 10, 20)), d])
    assert err.endswith(
        "trace line 2: request record field stages: empty; a request passes through at least one stage"
    )
    with pytest.raises(ValueError, match=r"^request 2 of session s1 has no stages$"):
        summarize([request(1, (10, 10, 20)), replace(request(2, (10, 10, 20)), stages=())])


@pytest.mark.parametrize("n", [2, 3])
def test_requests_through_other_stages_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], n: int
) -> None:
    reqs = [request(i, (10, 10, 20)) for i in range(1, n + 1)]
    reqs[-1] = replace(reqs[-1], stages=reqs[-1].stages[:2])  # the last lacks member c's stage
    err = refusal(tmp_path, capsys, list(reqs))
    assert err.endswith(
        f"trace line {n}: request {n} of session s1 has stages a, b; request 1 on line 1 has a, b, c"
    )
    # with two, the cold first is dropped: stage c must not vanish from what is left
    with pytest.raises(
        ValueError, match=f"^request {n} of session s1 has stages a, b; request 1 has a, b, c$"
    ):
        summarize(reqs)


def test_a_member_twice_in_one_request_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    d = request(1, (10, 10, 20)).to_json()
    d["stages"][2]["member"] = "a"
    err = refusal(tmp_path, capsys, [d])
    assert err.endswith("trace line 1: request record field stages[2].member: 'a' again (also stages[0])")


def test_stage_records_of_a_member_at_other_blocks_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    moved = replace(stage(2, "b", 9.0), blocks=(3, 7))
    err = refusal(tmp_path, capsys, [stage(1, "b", 8.0), stage(1, "c", 8.0), moved])
    assert err.endswith(
        "trace line 3: stage record of member b in session s1 (request 2) has stage 1, blocks 3-7; "
        "its record of request 1 on line 1 has stage 1, blocks 3-6"
    )
    with pytest.raises(ValueError, match=r"^stage record of member b in session s1 \(request 2\)"):
        summarize_stages([stage(1, "b", 8.0), moved])


def mutate(d: dict[str, Any], path: str, value: Any) -> dict[str, Any]:
    """`d` with the field at `path` ("stages.1.steps", "-" deletes) set to `value`."""
    *outer, last = path.split(".")
    at: Any = d
    for key in outer:
        at = at[int(key)] if isinstance(at, list) else at[key]
    if value == "-":
        del at[last]
    elif isinstance(at, list):
        at[int(last)] = value
    else:
        at[last] = value
    return d


def line_of(kind: str) -> dict[str, Any]:
    records = {"request": request(1, (10, 10, 20)), "stage": stage(1, "b", 9.0), "session": session()}
    return json.loads(json.dumps(records[kind].to_json()))  # as read from a file: lists, not tuples


@pytest.mark.parametrize(
    ("kind", "path", "value", "message"),
    [
        (
            "request",
            "completion_tokens",
            "11",
            'completion_tokens: expected an integer >= 0, got string "11"',
        ),
        ("stage", "decode_steps", "9", 'decode_steps: expected an integer >= 0, got string "9"'),
        ("request", "request_id", 1.5, "request_id: expected an integer, got number 1.5"),
        ("request", "stages.1.steps", 9.5, "stages[1].steps: expected an integer >= 0, got number 9.5"),
        ("request", "stages.0.head", 1, "stages[0].head: expected true or false, got number 1"),
        ("request", "hops.0.bytes", "100", 'hops[0].bytes: expected an integer >= 0, got string "100"'),
        ("request", "hops.1.messages", -1, "hops[1].messages: expected an integer >= 0, got number -1"),
        ("request", "member", 7, "member: expected a string, got number 7"),
        ("request", "queue_s", "0.5", 'queue_s: expected a finite number >= 0, got string "0.5"'),
        ("request", "stages.2.blocks", 5, "stages[2].blocks: expected an array, got number 5"),
        ("request", "extra", 1, "extra: unknown"),
        ("stage", "hop_out.rtt_ms", "25", 'hop_out.rtt_ms: expected a finite number >= 0, got string "25"'),
        ("stage", "hop_out.dst", "-", "hop_out.dst: missing"),
        ("stage", "prefill_ms.1", "6", 'prefill_ms[1]: expected a finite number >= 0, got string "6"'),
        ("stage", "prefill_ms", None, "prefill_ms: expected an array, got null"),
        ("stage", "blocks.0", "3", 'blocks[0]: expected an integer >= 0, got string "3"'),
        ("stage", "blocks", [6, 3], "blocks: first block 6 is after the last 3"),
        ("stage", "decode_ms", True, "decode_ms: expected a finite number >= 0, got true"),
        ("session", "order.1", 2, "order[1]: expected a string, got number 2"),
        (
            "session",
            "predicted_stage_ms.a",
            "10",
            'predicted_stage_ms.a: expected a finite number >= 0, got string "10"',
        ),
        ("session", "blocks.c", [6], "blocks.c: expected [first, last) as 2 integers, got array [6]"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(kind: str, path: str, value: Any, message: str) -> None:
    bad = json.dumps(mutate(line_of(kind), path, value))
    with pytest.raises(ValueError) as caught:
        list(read_lines([json.dumps(session().to_json()), bad]))
    assert str(caught.value) == f"trace line 2: {kind} record field {message}"


@pytest.mark.parametrize(
    ("kind", "path", "value", "shown"),
    [
        ("request", "stages.0.measured_ms", math.nan, "NaN"),
        ("request", "stages.0.measured_ms", math.inf, "Infinity"),
        ("request", "stages.0.measured_ms", -5, "-5"),
        ("request", "stages.1.predicted_ms", -math.inf, "-Infinity"),
        ("request", "decode_s", math.nan, "NaN"),
        ("request", "transit_ms", math.inf, "Infinity"),
        ("stage", "decode_ms", math.nan, "NaN"),
        ("stage", "wait_ms", -0.5, "-0.5"),
        ("stage", "hop_in.predicted_rtt_ms", math.inf, "Infinity"),
        ("session", "predicted_bottleneck_ms", math.nan, "NaN"),
    ],
)
def test_a_time_that_is_not_finite_or_is_negative_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, path: str, value: float, shown: str
) -> None:
    err = refusal(tmp_path, capsys, [session(), mutate(line_of(kind), path, value)])
    field = path.replace(".0.", "[0].").replace(".1.", "[1].")
    expected = "a finite number" if path == "transit_ms" else "a finite number >= 0"  # a median difference
    assert err.endswith(f"trace line 2: {kind} record field {field}: expected {expected}, got number {shown}")


def test_the_cli_names_a_wrong_type_on_its_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad_request = mutate(line_of("request"), "completion_tokens", "11")
    err = refusal(tmp_path, capsys, [session(), request(1, (10, 10, 20)), bad_request])
    assert err.endswith(
        'trace line 3: request record field completion_tokens: expected an integer >= 0, got string "11"'
    )
    bad_stage = mutate(line_of("stage"), "decode_steps", "9")
    err = refusal(tmp_path, capsys, [stage(1, "b", 8.0), bad_stage], "--json")
    assert err.endswith(
        'trace line 2: stage record field decode_steps: expected an integer >= 0, got string "9"'
    )


def test_undefined_figures_are_null_in_strict_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines: list[Line] = [session(), request(1, (0, 0, 0)), request(2, (0, 0, 0)), stage(1, "b", 0.0)]
    path = write(tmp_path, lines)
    assert cli_main(["trace", "summarize", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out, parse_constant=reject_constant)
    [t] = d["table_iv"]
    assert (t["bottleneck_ms"], t["bottleneck_member"], t["imbalance"], t["utilisation"]) == (
        0.0,
        None,
        None,
        None,
    )
    assert t["prediction_error"] is None and t["tokens_per_s"] == pytest.approx(10.0)
    assert d["stages"][0]["prediction_error"] is None
    assert cli_main(["trace", "summarize", str(path)]) == 0
    row = capsys.readouterr().out.splitlines()[2].split()
    assert row[3:6] == ["-", "0.00", "-"] and row[-1] == "-"  # imbal, bneck ms, util ... bottleneck


def test_a_figure_with_a_zero_divisor_is_none() -> None:
    [s] = summarize([request(1, (0, 10, 20), decode_s=0.0)])
    assert (s.imbalance, s.bottleneck_member, s.utilisation) == (None, "c", pytest.approx(0.5))
    assert (s.tokens_per_s, s.tokens_per_s_spread) == (None, None)  # no decode time: no rate, not 0
    [s] = summarize([request(1, (10, 10, 20), decode_s=0.0), request(2, (10, 10, 20), decode_s=2.0)], False)
    assert (s.tokens_per_s, s.tokens_per_s_spread) == (pytest.approx(5.0), 0.0)  # the other's rate alone


def test_a_lone_first_request_is_counted_and_said_to_be(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write(tmp_path, [session(), request(1, (10, 10, 20)), stage(1, "b", 9.0), stage(1, "c", 9.0)])
    assert cli_main(["trace", "summarize", str(path)]) == 0
    out = capsys.readouterr().out
    assert "first request of each dropped as cold, but kept where it is the only one: s1):" in out
    assert "first request of each dropped as cold, but kept where it is the only one: b, c):" in out
    assert cli_main(["trace", "summarize", str(path), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["table_iv"][0]["requests"] == 1 and d["table_iv"][0]["cold_dropped"] is False
    assert [s["cold_dropped"] for s in d["stages"]] == [False, False]
    lines: list[Line] = [session(), request(1, (10, 10, 20)), request(2, (10, 10, 20)), stage(1, "b", 9.0)]
    lines += [stage(2, "b", 9.0), stage(1, "c", 9.0)]
    assert cli_main(["trace", "summarize", str(write(tmp_path, lines))]) == 0
    out = capsys.readouterr().out
    assert "(the head's whole-ring view; first request of each dropped as cold):" in out
    kept_c = "first request of each dropped as cold, but kept where it is the only one: c):"
    assert f"(each member's own measurements; {kept_c}" in out


def test_figures_of_huge_times_do_not_overflow(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    huge = (1.5e308, 1.6e308, 1.7e308)  # finite, so read; their sum is not
    [s] = summarize([request(1, huge)])
    assert s.utilisation == pytest.approx((1.5 + 1.6 + 1.7) / 3 / 1.7)
    lines: list[Line] = [replace(request(i, huge), circuit_ms=1.7e308) for i in (1, 2, 3)]
    path = write(tmp_path, lines)
    assert cli_main(["trace", "summarize", str(path), "--json", "--keep-cold"]) == 0
    [t] = json.loads(capsys.readouterr().out, parse_constant=reject_constant)["table_iv"]
    assert t["circuit_ms"] == 1.7e308 and t["stage_ms"]["c"] == 1.7e308
    path = write(tmp_path, lines[:2])  # the median of two is their mean: beyond a float, so null
    assert cli_main(["trace", "summarize", str(path), "--json", "--keep-cold"]) == 0
    [t] = json.loads(capsys.readouterr().out, parse_constant=reject_constant)["table_iv"]
    assert t["circuit_ms"] is None and t["stage_ms"]["c"] is None and t["bottleneck_ms"] is None


def test_a_missing_or_unreadable_file_is_named_with_its_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing, folder = tmp_path / "gone.jsonl", tmp_path
    for path, reason in ((missing, "No such file or directory"), (folder, "Is a directory")):
        assert cli_main(["trace", "summarize", str(path)]) == 1
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == f"kafila trace: {path}: {reason}\n"
