"""Value of the division: one fleet of three members with CPU shares 1 : 0.5 : 0.25 of a CPU,
served with --division kafila, uniform and memory (memory-proportional), side by side.

Two phases, each with three fleets (one per division, 9 member processes; by default each member
pinned to one CPU and slowed to its share by an emulated pace, kafila.engine.pace; --slow-by quota
uses cgroup v1 cpu quotas) up together, rounds alternating between them so the machine's other
load falls on all three alike:
1. Sessions declared for one request (--concurrency 1): single-user requests. Decode tokens/s
   from the head's trace of each request ((tokens - 1) / decode time). With one request in flight
   only one stage computes at a time, so the rate follows the circuit (every stage and hop), and
   the kafila division is planned for that: the shortest circuit (kafila.planner.load).
2. Sessions declared for --users requests: rounds of that many concurrent requests (client-side
   aggregate tokens/s). With the pipeline full the bottleneck sets the rate, and the kafila
   division evens the stages.
Targets (one user): kafila/uniform >= 1.5, kafila/memory >= 1.2. The bottleneck is the stage with
the largest median measured ms per decode step.

On one machine every member offers the same memory, so memory-proportional equals uniform unless
--memory-gb gives the members different offers (e.g. --memory-gb 2,2,4: a slow member with more
memory, as an old desktop next to a laptop).

    python3 benchmarks/division_value.py [--tokens 48] [--rounds 4] [--users 4] [--memory-gb A,B,C]
"""

from __future__ import annotations

import argparse
import contextlib
from typing import Any

from _session_common import (
    Load,
    LocalFleet,
    add_slow_by,
    bottleneck,
    concurrent,
    interleaved_rounds,
    median,
    spread,
    start_fleets,
)

DIVISIONS = ("kafila", "uniform", "memory")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per request (default 48)")
    p.add_argument("--rounds", type=int, default=4, help="measured requests per division (default 4)")
    p.add_argument("--users", type=int, default=4, help="concurrent users in the throughput rounds (0: none)")
    p.add_argument(
        "--shares", default="1,0.5,0.25", help="CPU shares in cores, comma-separated (default 1,0.5,0.25)"
    )
    p.add_argument(
        "--memory-gb", default=None, help="memory each member offers, comma-separated (default: all alike)"
    )
    add_slow_by(p)
    args = p.parse_args()
    shares = [float(x) for x in args.shares.split(",")]
    member_args = [["--memory-gb", x] for x in args.memory_gb.split(",")] if args.memory_gb else None

    load = Load()
    one = run_fleets(args, shares, member_args, 1, load, users=0)
    many = run_fleets(args, shares, member_args, args.users, load, users=args.users) if args.users else {}
    records, same = one["records"], one["same"]
    print(f"\nmodel smollm2-135m, greedy, {args.tokens} tokens, {args.rounds} rounds", end="")
    print(f"; shares {shares} of a CPU ({args.slow_by})")
    print("one user (sessions declared for concurrency 1):")
    rates = {}
    for d in DIVISIONS:
        recs = records[d]
        rates[d] = median([float(r["tokens_per_s"]) for r in recs])
        spr = spread([float(r["tokens_per_s"]) for r in recs])
        member, ms, measured, predicted = bottleneck(recs)
        blocks = " ".join(f"{s['member']}:{s['blocks'][1] - s['blocks'][0]}" for s in recs[0]["stages"])
        stages = " ".join(f"{m} {measured[m]:.0f}/{predicted[m]:.0f}" for m in measured)
        print(
            f"{d:<8} {blocks:<28} decode {rates[d]:5.2f} tok/s (±{spr:.2f})  bottleneck {member} {ms:.1f} ms"
            f"   stage ms measured/predicted: {stages}"
        )
    ku, km = rates["kafila"] / rates["uniform"], rates["kafila"] / rates["memory"]
    print(f"same tokens in every division: {same}")
    if args.users:
        print(f"{args.users} users (sessions declared for concurrency {args.users}):")
        for d in DIVISIONS:
            recs = many["records"][d]
            blocks = " ".join(f"{s['member']}:{s['blocks'][1] - s['blocks'][0]}" for s in recs[0]["stages"])
            member, ms, _, _ = bottleneck(recs)
            agg = many["aggregate"][d]
            print(
                f"{d:<8} {blocks:<28} {median(agg):5.2f} tok/s aggregate (±{spread(agg):.2f})  "
                f"bottleneck {member} {ms:.1f} ms (one user)"
            )
        agg = many["aggregate"]
        mu = median(agg["kafila"]) / median(agg["uniform"])
        mm = median(agg["kafila"]) / median(agg["memory"])
        print(f"{args.users} users: kafila/uniform {mu:.2f}, kafila/memory {mm:.2f}")
    print(f"kafila/uniform: {ku:.2f}   (target >= 1.5: {'met' if ku >= 1.5 else 'NOT met'})")
    print(f"kafila/memory:  {km:.2f}   (target >= 1.2: {'met' if km >= 1.2 else 'NOT met'})")
    print(load.report())
    return 0


def run_fleets(
    args: argparse.Namespace,
    shares: list[float],
    member_args: list[list[str]] | None,
    concurrency: int,
    load: Load,
    users: int,
) -> dict[str, Any]:
    """Three fleets (one per division) declared for `concurrency`, up together: single-user rounds
    (head's trace records), then `users`-user rounds (client-side aggregate tokens/s) if any."""
    specs = {
        d: LocalFleet(
            shares,
            division=d,
            context=512,
            concurrency=concurrency,
            require_shares=True,
            member_args=member_args,
            slow_by=args.slow_by,
        )
        for d in DIVISIONS
    }
    aggregate: dict[str, list[float]] = {d: [] for d in DIVISIONS}
    with contextlib.ExitStack() as stack:
        fleets = start_fleets(stack, specs, load)
        records, same = interleaved_rounds(fleets, args.tokens, 1 if users else args.rounds)
        for _ in range(args.rounds if users else 0):
            for d, fleet in fleets.items():
                answers, wall = concurrent(fleet.url(fleet.head), users, args.tokens)
                aggregate[d].append(sum(a.completion_tokens for a in answers) / wall)
        load.sample()
    return {"records": records, "same": same, "aggregate": aggregate}


if __name__ == "__main__":
    raise SystemExit(main())
