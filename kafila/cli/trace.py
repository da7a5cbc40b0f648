"""`kafila trace summarize SOURCE`: the paper's Table IV columns from a session's trace lines.

SOURCE is a trace file, `-` (standard input: `ssh host cat trace.jsonl | kafila trace summarize -`),
or a member's `/traces` document (`http://127.0.0.1:8080/traces`, or the member's API URL).
A head's file holds request records (the whole ring's view: Table IV) and its own stage records;
any other member's file holds its stage records only (its stage and its hops). Each table says how
many records of which kind it summarised.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

URL_SCHEMES = ("http://", "https://")


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    s = sub.add_parser(
        "summarize",
        help="print bottleneck, imbalance, utilisation, tokens/s, prediction error (head files) and "
        "each member's stage: compute per decode step and prefill chunk, bytes per hop, round trip",
    )
    s.add_argument(
        "file",
        metavar="SOURCE",
        help="JSON lines written by a member (kafila host/join --trace FILE): the head's or any member's; "
        "'-' reads them from standard input; an http(s) URL reads a member's /traces document (its recent "
        "records: http://HOST:PORT/traces, or the API's base URL)",
    )
    s.add_argument(
        "--json",
        action="store_true",
        help='print {"table_iv": [...], "stages": [...]} as JSON instead of the tables',
    )
    s.add_argument(
        "--keep-cold",
        action="store_true",
        help="count each session's (and stage's) first request too (by default it is dropped as cold, "
        "as in the paper)",
    )


def strict(value: Any) -> Any:
    """`value` with every non-finite float as None, so that it prints as strict JSON: the summaries
    hold None where a figure is undefined, and inf only where finite times sum beyond a float."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [strict(v) for v in value]
    return value


def cold_note(keep_cold: bool, kept: list[str]) -> str:
    """What a table's title says of cold requests: `kept` names those whose only request is counted."""
    if keep_cold:
        return "cold requests kept"
    note = "first request of each dropped as cold"
    return f"{note}, but kept where it is the only one: {', '.join(kept)}" if kept else note


def traces_url(source: str) -> str:
    """A member's /traces URL from SOURCE (its API's base URL gets /traces)."""
    base, _, query = source.partition("?")
    if base.rstrip("/").endswith("/traces"):
        return source
    return base.rstrip("/") + "/traces" + (f"?{query}" if query else "")


def fetch_traces(url: str) -> list[bytes]:
    """The records of a member's /traces document, as JSON lines; ValueError naming what was wrong."""
    import httpx

    try:
        response = httpx.get(url, timeout=30, follow_redirects=True)
    except httpx.HTTPError as exc:
        raise ValueError(f"cannot read it: {exc}") from exc
    if response.status_code != 200:
        raise ValueError(f"HTTP {response.status_code}: {response.text[:200].strip()}")
    try:
        doc = response.json()
    except ValueError:
        raise ValueError("not a /traces document (not JSON)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("traces"), list):
        raise ValueError('not a /traces document (no "traces" list)')
    return [json.dumps(record).encode() + b"\n" for record in doc["traces"]]


def read_source(source: str, cut: list[int]) -> list[Any]:
    """The records of SOURCE: a file, '-' (standard input) or a /traces URL."""
    from kafila.obs.tracefile import read_lines

    if source == "-":
        return list(read_lines(sys.stdin.buffer, cut))
    if source.startswith(URL_SCHEMES):
        return list(read_lines(fetch_traces(traces_url(source)), cut))
    with Path(source).open("rb") as f:  # bytes: a line that is not UTF-8 is named by its number
        return list(read_lines(f, cut))


def main(args: argparse.Namespace) -> int:
    """Prints the tables; ends quietly when its output is closed (`kafila trace summarize F | head`)."""
    try:
        return _main(args)
    except BrokenPipeError:
        # the reader left: send what is left of stdout nowhere, so closing it at exit raises nothing
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 0


def _main(args: argparse.Namespace) -> int:
    from kafila.obs.trace import (
        FINISHED,
        RequestRecord,
        StageRecord,
        format_stage_table,
        format_table,
        summarize,
        summarize_stages,
    )

    warm, cut = not args.keep_cold, list[int]()
    source = "standard input" if args.file == "-" else args.file
    try:
        records = read_source(args.file, cut)
        table, stages = summarize(records, drop_cold=warm), summarize_stages(records, drop_cold=warm)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"kafila trace: {source}: {why}", file=sys.stderr)
        return 1
    for n in cut:  # the session may still be writing it
        print(
            f"kafila trace: {source}: line {n} is cut short (still being written?); left out",
            file=sys.stderr,
        )
    if not table and not stages:
        print(f"kafila trace: {source} holds no finished request with more than one token", file=sys.stderr)
        return 1
    if args.json:
        out = {"table_iv": [asdict(s) for s in table], "stages": [asdict(s) for s in stages]}
        print(json.dumps(strict(out), allow_nan=False))
        return 0
    n_req = sum(isinstance(r, RequestRecord) for r in records)
    ended = sum(isinstance(r, RequestRecord) and r.finish not in FINISHED for r in records)
    n_stage = sum(isinstance(r, StageRecord) for r in records)
    if table:
        cold = cold_note(args.keep_cold, [s.session for s in table if not s.cold_dropped])
        left = f"{ended} cancelled or failed not counted; " if ended else ""
        print(f"Table IV from {n_req} request records (the head's whole-ring view; {left}{cold}):")
        print(format_table(table))
    else:
        print(f"no request records: {source} is not the head's trace (Table IV needs the head's file)")
    if stages:
        members = ", ".join(dict.fromkeys(s.member for s in stages))
        cold = cold_note(args.keep_cold, list(dict.fromkeys(s.member for s in stages if not s.cold_dropped)))
        print(f"\nstages from {n_stage} stage records of {members} (each member's own measurements; {cold}):")
        print(format_stage_table(stages))
    return 0
