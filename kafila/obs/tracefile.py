"""Reading trace files: JSON lines back into records (kafila.obs.trace), every field checked.

`from_json` checks each field's type, counts as integers >= 0 and times as finite numbers >= 0;
`read_lines` also checks that the lines of one session describe one ring (the same members'
stages in every request, each member at one stage). What it cannot read raises ValueError naming
the line and the field, so `kafila trace summarize` answers a damaged file in one line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import fields
from typing import Any

from kafila.obs.trace import (
    HopTrace,
    Record,
    ReplanRecord,
    RequestRecord,
    SessionRecord,
    StageRecord,
    StageTrace,
    ring_mismatch,
    stage_mismatch,
)

_MISSING: Any = object()
_JSON_KINDS = ((int | float, "number"), (str, "string"), (list | tuple, "array"), (dict, "object"))


def _describe(v: Any) -> str:
    """A value as the reader saw it: its JSON type and its text, shortened."""
    if v is None or isinstance(v, bool):
        return json.dumps(v)  # null, true, false
    kind = next((name for types, name in _JSON_KINDS if isinstance(v, types)), type(v).__name__)
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    return f"{kind} {text if len(text) <= 40 else text[:37] + '...'}"


def _integer(v: Any, name: str, lowest: int | None = 0) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or (lowest is not None and v < lowest):
        what = "an integer" if lowest is None else f"an integer >= {lowest}"
        raise ValueError(f"field {name}: expected {what}, got {_describe(v)}")
    return v


def _number(v: Any, name: str, signed: bool = False) -> float:
    """A finite number (>= 0 unless `signed`): times, never NaN, infinite or negative."""
    try:
        x = float(v) if isinstance(v, int | float) and not isinstance(v, bool) else math.nan
    except OverflowError:  # an integer too large for a float
        x = math.nan
    if not math.isfinite(x) or (x < 0 and not signed):
        what = "a finite number" if signed else "a finite number >= 0"
        raise ValueError(f"field {name}: expected {what}, got {_describe(v)}")
    return x


def _text(v: Any, name: str) -> str:
    if not isinstance(v, str):
        raise ValueError(f"field {name}: expected a string, got {_describe(v)}")
    return v


def _flag(v: Any, name: str) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"field {name}: expected true or false, got {_describe(v)}")
    return v


def _array(v: Any, name: str) -> list[Any] | tuple[Any, ...]:
    if not isinstance(v, list | tuple):
        raise ValueError(f"field {name}: expected an array, got {_describe(v)}")
    return v


def _object(v: Any, name: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise ValueError(f"field {name}: expected an object, got {_describe(v)}")
    return v


def _blocks(v: Any, name: str) -> tuple[int, int]:
    pair = _array(v, name)
    if len(pair) != 2:
        raise ValueError(f"field {name}: expected [first, last) as 2 integers, got {_describe(v)}")
    first, last = _integer(pair[0], f"{name}[0]"), _integer(pair[1], f"{name}[1]")
    if first > last:
        raise ValueError(f"field {name}: first block {first} is after the last {last}")
    return first, last


class _Fields:
    """Typed reads of one JSON object's fields; every error names the field's path in its record."""

    def __init__(self, value: Any, path: str = "") -> None:
        self.d = _object(value, path)
        self.path = path

    def name(self, key: str) -> str:
        return f"{self.path}.{key}" if self.path else key

    def only(self, known: Iterable[str]) -> None:
        allowed = set(known)
        for key in self.d:
            if key not in allowed:
                raise ValueError(f"field {self.name(str(key))}: unknown")

    def raw(self, key: str, default: Any = _MISSING) -> Any:
        if key in self.d:
            return self.d[key]
        if default is _MISSING:
            raise ValueError(f"field {self.name(key)}: missing")
        return default

    def integer(self, key: str, default: Any = _MISSING, lowest: int | None = 0) -> int:
        return _integer(self.raw(key, default), self.name(key), lowest)

    def number(self, key: str, default: Any = _MISSING, signed: bool = False) -> float:
        return _number(self.raw(key, default), self.name(key), signed)

    def optional_number(self, key: str) -> float | None:
        v = self.raw(key, None)
        return None if v is None else _number(v, self.name(key))

    def text(self, key: str, default: Any = _MISSING) -> str:
        return _text(self.raw(key, default), self.name(key))

    def flag(self, key: str) -> bool:
        return _flag(self.raw(key), self.name(key))

    def array(self, key: str, default: Any = _MISSING) -> list[Any] | tuple[Any, ...]:
        return _array(self.raw(key, default), self.name(key))

    def blocks(self, key: str) -> tuple[int, int]:
        return _blocks(self.raw(key), self.name(key))

    def mapping(self, key: str, default: Any = _MISSING) -> dict[str, Any]:
        return _object(self.raw(key, default), self.name(key))


def _names(cls: type) -> set[str]:
    return {f.name for f in fields(cls)}


def _hop_trace(f: _Fields) -> HopTrace:
    f.only(_names(HopTrace))
    return HopTrace(
        src=f.text("src"),
        dst=f.text("dst"),
        path=f.text("path"),
        bytes=f.integer("bytes"),
        messages=f.integer("messages"),
        rtt_ms=f.optional_number("rtt_ms"),
        predicted_rtt_ms=f.optional_number("predicted_rtt_ms"),
    )


def _optional_hop(f: _Fields, key: str) -> HopTrace | None:
    v = f.raw(key, None)
    return None if v is None else _hop_trace(_Fields(v, f.name(key)))


def _stage_trace(f: _Fields) -> StageTrace:
    f.only(_names(StageTrace))
    return StageTrace(
        member=f.text("member"),
        index=f.integer("index"),
        blocks=f.blocks("blocks"),
        head=f.flag("head"),
        predicted_ms=f.number("predicted_ms"),
        measured_ms=f.number("measured_ms"),
        steps=f.integer("steps", 0),
        bytes_out=f.integer("bytes_out", 0),
        prefill_ms=f.number("prefill_ms", 0.0),
        prefill_chunks=f.integer("prefill_chunks", 0),
    )


def _request_record(f: _Fields) -> RequestRecord:
    f.only(_names(RequestRecord) | {"ttft_s", "tokens_per_s"})  # the derived two are recomputed
    stages = tuple(_stage_trace(_Fields(s, f"stages[{i}]")) for i, s in enumerate(f.array("stages")))
    if not stages:
        raise ValueError("field stages: empty; a request passes through at least one stage")
    seen: dict[str, int] = {}
    for i, s in enumerate(stages):
        if s.member in seen:
            raise ValueError(f"field stages[{i}].member: {s.member!r} again (also stages[{seen[s.member]}])")
        seen[s.member] = i
    return RequestRecord(
        session=f.text("session"),
        request_id=f.integer("request_id", lowest=None),
        member=f.text("member"),
        division=f.text("division"),
        prompt_tokens=f.integer("prompt_tokens"),
        completion_tokens=f.integer("completion_tokens"),
        queue_s=f.number("queue_s"),
        prefill_s=f.number("prefill_s"),
        decode_s=f.number("decode_s"),
        circuit_ms=f.number("circuit_ms"),
        stages=stages,
        hops=tuple(_hop_trace(_Fields(h, f"hops[{i}]")) for i, h in enumerate(f.array("hops", ()))),
        finish=f.text("finish", "stop"),
        transit_ms=f.number("transit_ms", 0.0, signed=True),  # a median of circuit less compute
        epoch=f.integer("epoch", 1, lowest=1),  # absent in records written before epochs were kept
    )


def _session_record(f: _Fields) -> SessionRecord:
    f.only(_names(SessionRecord))
    return SessionRecord(
        session=f.text("session"),
        model=f.text("model"),
        division=f.text("division"),
        order=tuple(_text(m, f"order[{i}]") for i, m in enumerate(f.array("order"))),
        head=f.text("head"),
        blocks={str(k): _blocks(v, f"blocks.{k}") for k, v in f.mapping("blocks").items()},
        predicted_stage_ms={
            str(k): _number(v, f"predicted_stage_ms.{k}") for k, v in f.mapping("predicted_stage_ms").items()
        },
        predicted_bottleneck_ms=f.number("predicted_bottleneck_ms"),
        predicted_circuit_ms=f.number("predicted_circuit_ms"),
        edges={str(k): _text(v, f"edges.{k}") for k, v in f.mapping("edges", {}).items()},
        epoch=f.integer("epoch", 1, lowest=1),
    )


def _replan_record(f: _Fields) -> ReplanRecord:
    f.only(_names(ReplanRecord))
    return ReplanRecord(
        session=f.text("session"),
        epoch=f.integer("epoch", lowest=1),
        cause=f.text("cause"),
        old_blocks={str(k): _blocks(v, f"old_blocks.{k}") for k, v in f.mapping("old_blocks").items()},
        new_blocks={str(k): _blocks(v, f"new_blocks.{k}") for k, v in f.mapping("new_blocks").items()},
        bytes_fetched=f.integer("bytes_fetched"),
        bytes_minimum=f.integer("bytes_minimum"),
        ready_s=f.number("ready_s"),
        carried=None if f.raw("carried", None) is None else f.integer("carried"),
        first_token_s=f.optional_number("first_token_s"),
    )


def _stage_record(f: _Fields) -> StageRecord:
    f.only(_names(StageRecord))
    return StageRecord(
        session=f.text("session"),
        member=f.text("member"),
        index=f.integer("index"),
        blocks=f.blocks("blocks"),
        head=f.flag("head"),
        request_id=f.integer("request_id", lowest=None),
        predicted_ms=f.number("predicted_ms"),
        decode_ms=f.number("decode_ms"),
        decode_steps=f.integer("decode_steps"),
        prefill_ms=tuple(_number(x, f"prefill_ms[{i}]") for i, x in enumerate(f.array("prefill_ms"))),
        hop_in=_optional_hop(f, "hop_in"),
        hop_out=_optional_hop(f, "hop_out"),
        wait_ms=f.number("wait_ms", 0.0),
        epoch=f.integer("epoch", 1, lowest=1),
    )


_READERS: dict[str, Callable[[_Fields], Record]] = {
    "session": _session_record,
    "request": _request_record,
    "stage": _stage_record,
    "replan": _replan_record,
}


def from_json(d: Any) -> Record:
    """Inverse of `to_json` (derived fields are dropped). Every field is checked: its type, times
    finite and not negative, counts non-negative integers; ValueError names the first bad field."""
    if not isinstance(d, dict):
        raise ValueError(f"expected a JSON object, got {_describe(d)}")
    kind = d.get("type")
    if not isinstance(kind, str) or kind not in _READERS:
        expected = "'session', 'request', 'stage' or 'replan'"
        if "type" not in d:
            raise ValueError(f"field type: missing; expected {expected}")
        raise ValueError(f"field type: expected {expected}, got {_describe(kind)}")
    try:
        return _READERS[kind](_Fields(d))
    except ValueError as exc:
        raise ValueError(f"{kind} record {exc}") from exc


def _cut_short(line: str | bytes) -> bool:
    """Whether an unterminated line is not (yet) a whole JSON value."""
    try:
        json.loads(line)
    except (ValueError, RecursionError):  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        return True
    return False


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not JSON: {exc.msg} at column {exc.colno}") from exc
    except RecursionError as exc:
        raise ValueError("not JSON this reader can hold: nested too deeply") from exc


def read_lines(lines: Iterable[str | bytes], cut: list[int] | None = None) -> Iterator[Record]:
    """The records of JSON lines (blank lines skipped). A line that is not UTF-8, not JSON, not a
    record (see `from_json`), or not the ring an earlier line of its session described (another set
    of stages, a member at another stage) raises ValueError naming its line number. With `cut` given,
    a last line that has no line end and is not JSON (a record still being written, or a writer
    stopped mid-line) is left out and its number appended to `cut`."""
    rings: dict[str, tuple[int, RequestRecord]] = {}
    stages: dict[tuple[str, str], tuple[int, StageRecord]] = {}
    for n, line in enumerate(lines, 1):
        ended = line.endswith(b"\n") if isinstance(line, bytes) else line.endswith("\n")
        if cut is not None and not ended and _cut_short(line):
            cut.append(n)
            return
        try:
            try:
                text = line.decode() if isinstance(line, bytes) else line
            except UnicodeDecodeError as exc:
                bad = line[exc.start] if isinstance(line, bytes) else 0
                raise ValueError(f"not UTF-8 text: byte 0x{bad:02x} at column {exc.start + 1}") from exc
            if not text.strip():
                continue
            record = from_json(_loads(text.rstrip("\r\n")))  # columns as on its line
            problem = None
            if isinstance(record, RequestRecord):
                n0, first = rings.setdefault(record.session, (n, record))
                problem = ring_mismatch(first, record, f" on line {n0}")
            elif isinstance(record, StageRecord):
                m0, own = stages.setdefault((record.session, record.member), (n, record))
                problem = stage_mismatch(own, record, f" on line {m0}")
            if problem is not None:
                raise ValueError(problem)
        except ValueError as exc:
            raise ValueError(f"trace line {n}: {exc}") from exc
        yield record
