"""Pipeline overhead: a three-member ring on loopback against single-process generation.

Three `kafila join`/`kafila host` processes (no CPU limits: each may use the whole machine, like
the single process) form a session of the default model; the single-process side is
kafila.engine.generate (what `kafila run` runs) in this process, same model, dtype and prompt.
Rounds alternate single process / ring (each round's ratio is printed too: the host's speed drifts
between rounds, which the medians of each side mix); decode tokens/s is (tokens - 1) / time from the first
token to the last: for the ring from the head's trace record of the request, for the single
process from generate()'s timings. With one request in flight only one stage computes at a time,
so the ring has the same hardware as the single process and the ratio is the ring's cost:
hidden states over QUIC, the head's scheduling, three event loops. Target: ratio >= 0.85.

--threads N caps the compute threads of both sides (kafila's --threads). On a VM, a vCPU that
has idled for tens of ms takes ~1.3 ms to run again (docs/benchmarks.md): the single process
never idles, while a ring member does between its turns, so with two threads every stage pays
that wake-up on its first parallel kernel. With --threads 1 both sides compute on one CPU at a time
and the ratio is the ring's own cost.

    python3 benchmarks/pipeline_overhead.py [--tokens 64] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import os

from _session_common import (
    Load,
    LocalFleet,
    SingleProcess,
    complete,
    fleet_banner,
    median,
    spread,
    wait_records,
)

from kafila.engine.system import THREADS_ENV


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds of each side (default 5)")
    p.add_argument("--members", type=int, default=3, help="members in the ring (default 3)")
    p.add_argument("--dtype", default="auto", help="dtype for both sides (default auto: fp32 on a CPU)")
    p.add_argument("--threads", type=int, help="compute threads of both sides (default: every CPU)")
    args = p.parse_args()
    if args.threads:  # before torch and numba load, here and in the members (they inherit it)
        os.environ[THREADS_ENV] = str(args.threads)

    load = Load()
    single = SingleProcess(dtype=args.dtype, context=512)
    with LocalFleet([None] * args.members, context=512, dtype=args.dtype) as fleet:
        load.watch_fleet(fleet)
        print(fleet_banner(fleet))
        head = fleet.url(fleet.head)
        want, _ = single.run(args.tokens)  # warm-up of both sides (first requests are cold)
        first = complete(head, args.tokens)
        same = first.text == single.text(want)
        ring_rates, single_rates, client_rates = [], [], []
        for _ in range(args.rounds):
            _, rate = single.run(args.tokens)
            single_rates.append(rate)
            answer = complete(head, args.tokens)
            client_rates.append(answer.completion_tokens / answer.wall_s)
            same = same and answer.text == first.text
        records = wait_records(fleet, args.rounds + 1)[1:]
        ring_rates = [float(r["tokens_per_s"]) for r in records]
        load.sample()
        circuit = median([float(r["circuit_ms"]) for r in records])
    ratio = median(ring_rates) / median(single_rates)
    threads = f"{args.threads} thread(s)" if args.threads else "every CPU"
    print(f"\nmodel smollm2-135m, dtype {args.dtype}, greedy, {args.tokens} tokens", end="")
    print(f", {args.rounds} rounds, {threads}")
    print(f"single process decode: {median(single_rates):6.2f} tok/s (±{spread(single_rates):.2f})")
    print(
        f"{args.members}-member ring decode: {median(ring_rates):6.2f} tok/s (±{spread(ring_rates):.2f}), "
        f"circuit {circuit:.1f} ms; client-side incl. prefill+HTTP {median(client_rates):.2f} tok/s"
    )
    print(f"same tokens as single process: {same}")
    pairs = [r / s for r, s in zip(ring_rates, single_rates, strict=True)]  # the host drifts between rounds
    print("round by round (each ring request over the single-process run just before it): ", end="")
    print(", ".join(f"{x:.3f}" for x in pairs) + f"; median {median(pairs):.3f}")
    print(f"ratio ring/single: {ratio:.3f}   (target >= 0.85: {'met' if ratio >= 0.85 else 'NOT met'})")
    print(load.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
