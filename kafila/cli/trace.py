"""`kafila trace summarize FILE`: the paper's Table IV columns from a session's trace lines.

A head's file holds request records (the whole ring's view: Table IV) and its own stage records;
any other member's file holds its stage records only (its stage and its hops). Each table says how
many records of which kind it summarised.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any


def configure(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="trace_command", metavar="ACTION", required=True)
    s = sub.add_parser(
        "summarize",
        help="print bottleneck, imbalance, utilisation, tokens/s, prediction error (head files) and "
        "each member's stage: compute per decode step and prefill chunk, bytes per hop, round trip",
    )
    s.add_argument(
        "file",
        type=Path,
        help="JSON lines written by a member (kafila host/join --trace FILE): the head's or any member's",
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


def main(args: argparse.Namespace) -> int:
    from kafila.obs.trace import (
        FINISHED,
        RequestRecord,
        StageRecord,
        format_stage_table,
        format_table,
        summarize,
        summarize_stages,
    )
    from kafila.obs.tracefile import read_lines

    warm, cut = not args.keep_cold, list[int]()
    try:
        with args.file.open("rb") as f:  # bytes: a line that is not UTF-8 is named by its number
            records = list(read_lines(f, cut))
        table, stages = summarize(records, drop_cold=warm), summarize_stages(records, drop_cold=warm)
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        print(f"kafila trace: {args.file}: {why}", file=sys.stderr)
        return 1
    for n in cut:  # the session may still be writing it
        print(
            f"kafila trace: {args.file}: line {n} is cut short (still being written?); left out",
            file=sys.stderr,
        )
    if not table and not stages:
        print(
            f"kafila trace: {args.file} holds no finished request with more than one token", file=sys.stderr
        )
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
        print(f"no request records: {args.file} is not the head's trace (Table IV needs the head's file)")
    if stages:
        members = ", ".join(dict.fromkeys(s.member for s in stages))
        cold = cold_note(args.keep_cold, list(dict.fromkeys(s.member for s in stages if not s.cold_dropped)))
        print(f"\nstages from {n_stage} stage records of {members} (each member's own measurements; {cold}):")
        print(format_stage_table(stages))
    return 0
