"""`kafila trace summarize FILE`: the paper's Table IV columns from a session's trace lines.

A head's file holds request records (the whole ring's view: Table IV) and its own stage records;
any other member's file holds its stage records only (its stage and its hops). Each table says how
many records of which kind it summarised.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path


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


def main(args: argparse.Namespace) -> int:
    from kafila.obs.trace import (
        RequestRecord,
        StageRecord,
        format_stage_table,
        format_table,
        read_lines,
        summarize,
        summarize_stages,
    )

    try:
        with args.file.open() as f:
            records = list(read_lines(f))
    except (OSError, ValueError) as exc:
        print(f"kafila trace: {args.file}: {exc}", file=sys.stderr)
        return 1
    warm = not args.keep_cold
    table, stages = summarize(records, drop_cold=warm), summarize_stages(records, drop_cold=warm)
    if not table and not stages:
        print(
            f"kafila trace: {args.file} holds no finished request with more than one token", file=sys.stderr
        )
        return 1
    if args.json:
        print(json.dumps({"table_iv": [asdict(s) for s in table], "stages": [asdict(s) for s in stages]}))
        return 0
    n_req = sum(isinstance(r, RequestRecord) for r in records)
    n_stage = sum(isinstance(r, StageRecord) for r in records)
    cold = "first request of each dropped as cold" if warm else "cold requests kept"
    if table:
        print(f"Table IV from {n_req} request records (the head's whole-ring view; {cold}):")
        print(format_table(table))
    else:
        print(f"no request records: {args.file} is not the head's trace (Table IV needs the head's file)")
    if stages:
        members = ", ".join(dict.fromkeys(s.member for s in stages))
        print(f"\nstages from {n_stage} stage records of {members} (each member's own measurements; {cold}):")
        print(format_stage_table(stages))
    return 0
