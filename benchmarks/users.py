"""Several users: aggregate tokens/s with four concurrent users over one user, same session.

One fleet (default three members with CPU shares 1 : 0.5 : 0.25 of a CPU, each pinned to one CPU
and slowed by an emulated pace, kafila.engine.pace: 1.75 of the machine's 2 CPUs, so every stage
can compute at once without oversubscribing it), declared concurrency 4.
Rounds alternate one request alone and four at once (the same prompt, greedy), each sent to a
member that is not the head (forwarded over the ring, as most users would reach it). Aggregate
tokens/s = completion tokens of the round / wall time from the first send to the last answer
(client side: prefill, queueing and HTTP included, for one user and four alike). One request
leaves all but one stage idle at any moment; four fill the pipeline and share batched decode
steps. Target: four-user aggregate / one-user >= 3.5 (the paper: 4.0x on its LAN). It also
prints each stage's ms per decode step as predicted, measured alone and measured under load (from
the head's trace records): on one machine the stages that compute at once slow each other. And
the time to each request's first token (queue + prefill at the head) alone and under load: the
four prompts prefill through the same stages, so the last of them waits for the others. And the
decode part alone: the median time between a request's tokens after its first, alone and with
four users, as a ratio of tokens per second (prefill, queueing and HTTP left out).
Stages that stream their weights at once share this machine's memory bus, which separate
machines would not (benchmarks/contention.py measures by how much). Smaller shares with the same
ratios, e.g. --shares 0.25,0.125,0.0625, make such collisions rarer at the price of a slower run
(docs/benchmarks.md, "The local fleet").
benchmarks/batch_rows.py measures what a step of two or four rows costs over one on this CPU
and the bound that alone puts on this ratio (docs/benchmarks.md, "What bounds the figures").

With --hop-marks every member writes hop marks (kafila.obs.hopmarks) and the script ends with
where a decode step's time went, alone against beside the other users: compute, hand-offs, event
loops, QUIC, per kind and segment by segment (benchmarks/hop_costs.py's segments). The marks cost
a little time themselves.

    python3 benchmarks/users.py [--tokens 48] [--rounds 3] [--shares 1,0.5,0.25] [--dtype auto] [--hop-marks]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path
from typing import Any

from _session_common import (
    Load,
    LocalFleet,
    add_slow_by,
    concurrent,
    fleet_banner,
    median,
    request_records,
    spread,
    wait_records,
)
from hop_costs import by_load, read_marks, report_by_load, ring_order

from kafila.engine import DTYPE_CHOICES
from kafila.obs.hopmarks import ENV as HOP_MARKS


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per request (default 48)")
    p.add_argument("--rounds", type=int, default=3, help="measured rounds of each (default 3)")
    p.add_argument("--users", type=int, default=4, help="concurrent users (default 4)")
    p.add_argument("--shares", default="1,0.5,0.25", help="CPU shares in cores, comma-separated")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="the session's dtype (default auto)",
    )
    p.add_argument("--hop-marks", action="store_true", help="also print where a decode step's time goes")
    add_slow_by(p)
    args = p.parse_args()
    shares = [float(x) for x in args.shares.split(",")]
    marks = Path(tempfile.mkdtemp(prefix="kafila-hop-marks-")) if args.hop_marks else None
    if marks is not None:
        os.environ[HOP_MARKS] = str(marks)  # read by the members when they start

    load = Load()
    with LocalFleet(
        shares,
        context=512,
        concurrency=args.users,
        dtype=args.dtype,
        require_shares=True,
        slow_by=args.slow_by,
    ) as fleet:
        load.watch_fleet(fleet)
        print(fleet_banner(fleet), flush=True)
        url = fleet.url(fleet.not_head())
        concurrent(url, 1, args.tokens)  # warm-up
        concurrent(url, args.users, args.tokens)
        one, many, same = [], [], True
        alone: list[dict[str, Any]] = []
        loaded: list[dict[str, Any]] = []
        for _ in range(args.rounds):
            n0 = len(request_records(fleet))
            answers, wall = concurrent(url, 1, args.tokens)
            one.append(answers[0].completion_tokens / wall)
            alone += wait_records(fleet, n0 + 1)[n0:]
            group, wall = concurrent(url, args.users, args.tokens)
            many.append(sum(a.completion_tokens for a in group) / wall)
            loaded += wait_records(fleet, n0 + 1 + args.users)[n0 + 1 :]
            same = same and all(a.text == answers[0].text for a in group)
        load.sample()
    ratio = median(many) / median(one)
    print(
        f"\nmodel smollm2-135m, dtype {args.dtype}, greedy, {args.tokens} tokens per request, "
        f"{args.rounds} rounds, via {url}"
    )
    print(f"1 user:  {median(one):5.2f} tok/s (±{spread(one):.2f})")
    print(f"{args.users} users: {median(many):5.2f} tok/s aggregate (±{spread(many):.2f})")
    print(f"each concurrent answer identical to the single user's: {same}")
    print(
        f"stage ms per decode step, predicted / alone / with {args.users} users (stages slowing each other):"
    )
    for member, (pred, ms1, msn) in stage_table(alone, loaded).items():
        print(f"  {member:<8} {pred:6.1f} / {ms1:6.1f} / {msn:6.1f}")
    first1, firstn = first_token_s(alone), first_token_s(loaded)
    print(
        f"first token s (head's trace: queue + prefill): alone {median(first1):.2f}, with {args.users} "
        f"users median {median(firstn):.2f}, latest {max(firstn):.2f}"
    )
    step1, stepn = decode_step_ms(alone), decode_step_ms(loaded)
    print(
        f"decode only: a request's token every {step1:.1f} ms alone, every {stepn:.1f} ms with {args.users} "
        f"users: {args.users * step1 / stepn:.2f}x the tokens per second (prefill and HTTP left out)"
    )
    print(
        f"ratio {args.users} users / 1 user: {ratio:.3f}   "
        f"(target >= 3.5: {'met' if ratio >= 3.5 else 'NOT met'})"
    )
    print(load.report())
    if marks is not None:  # the members wrote their last marks when they stopped
        print(f"hop marks in {marks}")
        report_by_load(by_load(ring_order(read_marks(marks), len(shares))))
    return 0


def stage_table(alone: list[dict[str, Any]], loaded: list[dict[str, Any]]) -> dict[str, tuple[float, ...]]:
    """Per member: (predicted, median measured alone, median measured under load) ms per step."""

    def ms(records: list[dict[str, Any]], key: str) -> dict[str, float]:
        by: dict[str, list[float]] = {}
        for r in records:
            for s in r["stages"]:
                by.setdefault(s["member"], []).append(float(s[key]))
        return {m: median(v) for m, v in by.items()}

    pred, ms1, msn = ms(alone, "predicted_ms"), ms(alone, "measured_ms"), ms(loaded, "measured_ms")
    return {m: (pred[m], ms1[m], msn.get(m, float("nan"))) for m in pred}


def decode_step_ms(records: list[dict[str, Any]]) -> float:
    """Median ms between a request's tokens after its first (the head's trace)."""
    steps = [(float(r["decode_s"]), int(r["completion_tokens"]) - 1) for r in records]
    return median([s * 1e3 / n for s, n in steps if n > 0])


def first_token_s(records: list[dict[str, Any]]) -> list[float]:
    """Seconds from reaching the head to the first token, per request (the head's trace)."""
    return [float(r["queue_s"]) + float(r["prefill_s"]) for r in records]


if __name__ == "__main__":
    raise SystemExit(main())
