"""What a batched decode step costs on this CPU: a real stage's step of 1-4 rows against one row.

Several users gain from a shared ring in two ways: their steps fill the pipeline's idle stages,
and the steps that meet at a stage run as one batch, which reads every weight once for all its
rows. This script measures the second on this machine: one stage of the default model (`--blocks`,
default all 30, no head, one thread unless `--threads`), its requests prefilled to `--position`,
decode steps of 1, 2, 3 and 4 rows (one per request, all at that position) alternated round after
round so that the machine's drift falls on every size alike; printed, the median ms per step of
each and its cost relative to one row (c_k).

From c_2 it prints the bound this puts on `benchmarks/users.py` (four users over one) when four
users travel as two lanes of two rows, as the planner keeps them on three even stages: one user
goes around in S + H (S: the stages' compute for one row, H: hops, sampling and hand-offs), a lane
of two in c_2 S + H, and two lanes carry four tokens per round, so the ratio is at most
4 (S + H) / (c_2 S + H), with no collisions between stages and no extra hop cost under load.
S is `--stages-ms` and H `--hops-ms`: users.py prints both for one user (its stages' ms alone,
and the decode step less their sum); the defaults, 48 and 7 ms, are its figures on the project's
2-vCPU machines with shares 1 : 0.5 : 0.25, where the paced stages stretch their compute, c_k
included. The same for one lane of four rows with c_4.

    python3 benchmarks/batch_rows.py [--blocks 30] [--position 64] [--rounds 30] [--threads 1]
                                     [--stages-ms 48] [--hops-ms 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

from _session_common import MODEL

ROWS = (1, 2, 3, 4)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--blocks", type=int, default=30, help="blocks in the stage (default 30: the whole model)")
    p.add_argument("--position", type=int, default=64, help="KV position of every step (default 64)")
    p.add_argument("--rounds", type=int, default=30, help="rounds of the four sizes (default 30)")
    p.add_argument("--threads", type=int, default=1, help="compute threads (default 1, as a paced member)")
    p.add_argument("--stages-ms", type=float, default=48.0, help="S in the bound (default 48 ms)")
    p.add_argument("--hops-ms", type=float, default=7.0, help="H in the bound (default 7 ms)")
    args = p.parse_args()
    if args.blocks < 1 or args.position < 1 or args.rounds < 1 or args.threads < 1:
        p.error("--blocks, --position, --rounds and --threads must be at least 1")

    from kafila.engine.system import THREADS_ENV

    os.environ[THREADS_ENV] = str(args.threads)  # before torch and numba load
    stage, hidden = load_stage(args.blocks, args.position)
    ms = time_steps(stage, hidden, args.position, args.rounds)

    one = statistics.median(ms[1])
    print(f"model {MODEL}, {args.blocks} blocks, {stage.backend}, {args.threads} thread(s)")
    print(f"decode steps at KV position {args.position}, {args.rounds} rounds alternated")
    print(f"{'rows':>5} {'ms per step':>12} {'c_k (over 1 row)':>17} {'ms per row':>11}")
    for n in ROWS:
        m = statistics.median(ms[n])
        print(f"{n:>5} {m:>12.2f} {m / one:>17.3f} {m / n:>11.2f}")
    s, h = args.stages_ms, args.hops_ms
    for lanes, rows in ((2, 2), (1, 4)):
        c = statistics.median(ms[rows]) / one
        bound = 4 * (s + h) / (c * s + h)
        print(
            f"users.py bound, {lanes} lane(s) of {rows} rows: 4 (S + H) / (c_{rows} S + H) = "
            f"4 ({s:.1f} + {h:.1f}) / ({c:.3f} x {s:.1f} + {h:.1f}) = {bound:.2f}  (target 3.5)"
        )
    return 0


def load_stage(blocks: int, position: int) -> tuple[Any, Any]:
    """The stage with four requests prefilled to `position`, and four hidden rows [4, H]."""
    import torch

    from kafila.engine.stage import Entry, Stage
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.registry import resolve

    ckpt = Checkpoint.open(resolve(MODEL))
    layers = ckpt.config.num_hidden_layers
    if blocks > layers:
        raise SystemExit(f"--blocks {blocks}: {MODEL} has {layers}")
    stage = Stage.load(ckpt, range(blocks), False, context=position + 1, concurrency=len(ROWS))
    torch.manual_seed(0)
    for rid in range(len(ROWS)):
        stage.open(rid)
        stage.step(torch.randn(position, ckpt.config.hidden_size) * 0.1, [Entry(rid, 0, position)])
    return stage, torch.randn(len(ROWS), ckpt.config.hidden_size) * 0.1  # [4, H]


def time_steps(stage: Any, hidden: Any, position: int, rounds: int) -> dict[int, list[float]]:
    """ms of each step size, `rounds` times, every step at `position`: a step may start at or
    before a request's cached length, so each one rewrites the same KV position."""
    from kafila.engine.stage import Entry

    ms: dict[int, list[float]] = {n: [] for n in ROWS}
    for r in range(rounds + 1):  # the first round warms up
        for n in ROWS:
            rows = hidden[:n].clone()  # [n, H]
            start = time.perf_counter()
            stage.step(rows, [Entry(rid, position, 1) for rid in range(n)])
            took = (time.perf_counter() - start) * 1e3
            if r:
                ms[n].append(took)
    return ms


if __name__ == "__main__":
    raise SystemExit(main())
