"""A slow member: the same fleet with and without one member limited to 25% of a CPU.

Fleet A: every member a whole CPU (share 1.0). Fleet B: the same but the last member 0.25. By
default every member is pinned to one CPU and slowed to its share by an emulated pace
(kafila.engine.pace); --slow-by quota puts each in a cgroup v1 cpu group instead. Both fleets stay
up side by side and rounds alternate between them; single-user decode tokens/s from the head's
trace ((tokens - 1) / decode time), division kafila in both. With one request in flight only one
stage computes at a time.

Ideal: if the division gives every member work in proportion to its speed c_i (all stages take the
same time), a decode step costs m stages x W / sum(c) for W the work of one token, so the
single-user rate is proportional to sum(c): ideal_B = rate_A x sum(c_B) / sum(c_A) (the fleet's
remaining capacity; 2.25/3 = 0.75 for three members, 1.25/2 = 0.625 for two). Target: rate_B >=
95% of ideal_B (llama.cpp's RPC split reaches 78%).

    python3 benchmarks/slow_member.py [--members 3] [--tokens 48] [--rounds 4]
"""

from __future__ import annotations

import argparse
import contextlib

from _session_common import (
    Load,
    LocalFleet,
    add_slow_by,
    bottleneck,
    interleaved_rounds,
    median,
    spread,
    start_fleets,
)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--members", type=int, default=3, help="members per fleet, 2 or 3 (default 3)")
    p.add_argument(
        "--slow", type=float, default=0.25, help="the slow member's share of a core (default 0.25)"
    )
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per request (default 48)")
    p.add_argument("--rounds", type=int, default=4, help="measured requests per fleet (default 4)")
    add_slow_by(p)
    args = p.parse_args()
    full = [1.0] * args.members
    slow = [1.0] * (args.members - 1) + [args.slow]

    load = Load()
    specs = {
        "unthrottled": LocalFleet(full, context=512, require_shares=True, slow_by=args.slow_by),
        "one slow": LocalFleet(slow, context=512, require_shares=True, slow_by=args.slow_by),
    }
    with contextlib.ExitStack() as stack:
        fleets = start_fleets(stack, specs, load)
        records, same = interleaved_rounds(fleets, args.tokens, args.rounds)
        load.sample()
    rates = {k: [float(r["tokens_per_s"]) for r in v] for k, v in records.items()}
    a, b = median(rates["unthrottled"]), median(rates["one slow"])
    capacity = sum(slow) / sum(full)
    ideal = a * capacity
    print(f"\nmodel smollm2-135m, greedy, {args.tokens} tokens, {args.rounds} rounds, division kafila")
    for label, shares in (("unthrottled", full), ("one slow", slow)):
        recs = records[label]
        blocks = " ".join(f"{s['member']}:{s['blocks'][1] - s['blocks'][0]}" for s in recs[0]["stages"])
        member, ms, measured, _ = bottleneck(recs)
        print(
            f"{label:<12} shares {shares}  {blocks:<26} decode {median(rates[label]):5.2f} tok/s "
            f"(±{spread(rates[label]):.2f})  bottleneck {member} {ms:.0f} ms; stages "
            + " ".join(f"{m} {v:.0f}" for m, v in measured.items())
        )
    print(f"same tokens: {same}")
    print(f"remaining capacity sum(c_B)/sum(c_A) = {sum(slow):.2f}/{sum(full):.2f} = {capacity:.3f}")
    print(f"ideal = {a:.2f} x {capacity:.3f} = {ideal:.2f} tok/s; measured {b:.2f} tok/s")
    print(f"measured/ideal: {b / ideal:.1%}   (target >= 95%: {'met' if b / ideal >= 0.95 else 'NOT met'})")
    print(load.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
