"""Several users: aggregate decode tokens/s with four concurrent users over one user.

A three-member session of the default model (member processes on this machine, declared
concurrency 4). First `--rounds` single requests, then `--rounds` bursts of four simultaneous
requests (different prompts, so nothing is shared), all to the API of a member that is not the
head. Aggregate rate = tokens generated / wall time of the burst; one user's rate = tokens / wall
time of one request (both from the client's side, so queueing and forwarding are counted). With
one request in flight only one stage computes at a time; four requests keep every stage busy
(each stage batches the decode steps waiting for it). Target: 4 users / 1 user >= 3.5x
(the paper: 4.0x on a LAN). On 2 shared cores three members cannot all compute at once: the
ceiling here is what the cores allow, which the printed load shows.

    python3 benchmarks/users.py [--tokens 48] [--rounds 3] [--users 4]
"""

from __future__ import annotations

import argparse

from _session_common import PROMPT, Load, LocalFleet, complete, concurrent, fleet_banner, median, spread

PROMPTS = [
    PROMPT,
    "The history of the printing press begins in",
    "A recipe for a simple tomato soup starts with",
    "In the year 2150, the first city on Mars",
    "The most important rule of mountain climbing is",
    "Every morning the lighthouse keeper would",
]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=48, help="tokens per request (default 48)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of each mode (default 3)")
    p.add_argument("--users", type=int, default=4, help="concurrent users (default 4)")
    args = p.parse_args()
    load = Load()
    with LocalFleet([None, None, None], context=512, concurrency=args.users) as fleet:
        load.watch_fleet(fleet)
        print(fleet_banner(fleet))
        url = fleet.url(fleet.not_head())
        complete(url, args.tokens)  # cold
        one, many = [], []
        for _ in range(args.rounds):
            a = complete(url, args.tokens)
            one.append(a.completion_tokens / a.wall_s)
            answers, wall = concurrent(url, args.users, args.tokens, PROMPTS[: args.users])
            many.append(sum(x.completion_tokens for x in answers) / wall)
        load.sample()
    ratio = median(many) / median(one)
    print(f"\n{args.users} users, {args.tokens} tokens each, {args.rounds} rounds, via a non-head member")
    print(f"one user      {median(one):7.2f} tok/s (±{spread(one):.2f})")
    print(f"{args.users} users       {median(many):7.2f} tok/s aggregate (±{spread(many):.2f})")
    print(f"ratio         {ratio:7.2f}x   (target >= 3.5x)")
    print(load.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
