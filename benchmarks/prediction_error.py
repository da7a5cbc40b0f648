"""Prediction error: per stage, |predicted - measured| / measured compute time per decode step,
from the session's own traces.

One fleet (default three members with CPU shares 1 : 0.5 : 0.25 of a CPU, each pinned to one CPU
and slowed by an emulated pace, kafila.engine.pace; --slow-by quota: cgroup quotas; division kafila)
answers a few single-user requests; the head's trace records carry, for every stage, the plan's
predicted ms per decode step and the median measured ms (kafila.obs.trace). The first request is
dropped as cold. Printed: each stage's predicted and measured ms and its error, and the median
over every stage of every request (what `kafila trace summarize` reports). Target: <= 10% (the
paper: 18%).

The plan predicts a decode step at the KV position the probe times (kafila.probe.measure.POSITION,
256): attention reads every cached position, so a step costs more further into a conversation. The
requests' prompt is therefore the benchmarks' story repeated to `--position` minus half of
`--tokens` tokens, so their decode steps run at positions centred on the predicted one.
`--position 0` sends the short story prompt instead (decode at positions 19-67: the predictions
are then for longer contexts than the ones measured).

    python3 benchmarks/prediction_error.py [--tokens 48] [--requests 5] [--shares 1,0.5,0.25]
                                           [--position 256]
"""

from __future__ import annotations

import argparse

from _session_common import (
    MODEL,
    PROMPT,
    Load,
    LocalFleet,
    add_slow_by,
    complete,
    fleet_banner,
    median,
    wait_records,
)

from kafila.obs.trace import format_table, summarize
from kafila.obs.tracefile import from_json
from kafila.probe.measure import POSITION

CONTEXT = 512  # the fleet's declared context, positions


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=48, help="tokens generated per request (default 48)")
    p.add_argument("--requests", type=int, default=5, help="measured requests (default 5, plus one cold)")
    p.add_argument("--shares", default="1,0.5,0.25", help="CPU shares in cores, comma-separated")
    p.add_argument("--division", default="kafila", help="kafila, uniform or memory (default kafila)")
    p.add_argument(
        "--position",
        type=int,
        default=POSITION,
        help=f"KV position the decode steps centre on (default {POSITION}, the probe's; 0: a short prompt)",
    )
    add_slow_by(p)
    args = p.parse_args()
    shares = [float(x) for x in args.shares.split(",")]
    if args.position < 0 or args.position + args.tokens // 2 > CONTEXT:
        p.error(f"--position {args.position} and --tokens {args.tokens} run past the context {CONTEXT}")
    prompt, first = prompt_at(args.position, args.tokens)

    load = Load()
    with LocalFleet(
        shares, context=CONTEXT, division=args.division, require_shares=True, slow_by=args.slow_by
    ) as fleet:
        load.watch_fleet(fleet)
        print(fleet_banner(fleet), flush=True)
        for _ in range(args.requests + 1):
            complete(fleet.url(fleet.head), args.tokens, prompt)
        records = wait_records(fleet, args.requests + 1)
        load.sample()
    measured = records[1:]
    print(
        f"\nmodel smollm2-135m, greedy, {args.tokens} tokens, {len(measured)} requests, "
        f"division {args.division}, decode at KV positions {first}-{first + args.tokens - 2}"
    )
    print(f"{'stage':<8} {'blocks':>7} {'predicted ms':>13} {'measured ms':>12} {'error':>7}")
    errors = []
    for st in measured[0]["stages"]:
        m = st["member"]
        runs = [s for r in measured for s in r["stages"] if s["member"] == m]
        errs = [
            abs(s["predicted_ms"] - s["measured_ms"]) / s["measured_ms"] for s in runs if s["measured_ms"]
        ]
        errors += errs
        meas = median([s["measured_ms"] for s in runs])
        print(
            f"{m:<8} {tuple(st['blocks'])!s:>7} {st['predicted_ms']:>13.1f} {meas:>12.1f} "
            f"{median(errs):>7.0%}"
        )
    err = median(errors)
    print(f"median |predicted - measured| / measured over stages x requests: {err:.1%}")
    print(f"(target <= 10%: {'met' if err <= 0.10 else 'NOT met'})")
    print("kafila trace summarize of the same records:")
    print(format_table(summarize([from_json(r) for r in records])))
    print(load.report())
    return 0


def prompt_at(position: int, tokens: int) -> tuple[str, int]:
    """(prompt, KV position of the first decode step): the story prompt, or, for a position above
    what it reaches, the story repeated and cut to `position - tokens // 2` tokens."""
    from kafila.engine.tokenizer import Tokenizer
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.registry import resolve

    tok = Tokenizer.from_checkpoint(Checkpoint.open(resolve(MODEL)))
    length = len(tok.encode(PROMPT, add_special_tokens=True))  # as the head encodes a prompt
    want = position - tokens // 2
    if want <= length:
        return PROMPT, length
    special = length - len(tok.encode(PROMPT, add_special_tokens=False))
    story = tok.encode(" ".join([PROMPT + "."] * (want // length + 2)), add_special_tokens=False)
    prompt = tok.decode(story[: want - special])
    return prompt, len(tok.encode(prompt, add_special_tokens=True))


if __name__ == "__main__":
    raise SystemExit(main())
