"""Probe accuracy: predicted vs measured per-block decode time on members with unequal CPU shares.

Each member is a child process in its own cgroup v1 `cpu` group (cfs_quota_us of 200%, 100%, 50%
and 25% of one core by default; root needed). It runs `kafila.probe.measure.probe()` with the model's
shapes (bandwidth, matvec bandwidth, overhead, synthetic block), then loads every block of the real
model with the engine (kafila.engine.stage.Stage, torch, fp32), prefills a prompt and times decode
steps. Per member:
    measured per-block time  = median decode step time / blocks
    bandwidth model          = block bytes / streamed bandwidth        (the paper's cost model)
    matvec bandwidth model   = block bytes / matvec bandwidth
    synthetic-block model    = the probe's timed decode step of one random-weight block
    dispatch + bandwidth     = the probe's block dispatch (one decode step of the same architecture's
                               block at tiny shapes, engine code) + block bytes / streamed bandwidth
and the median relative error of each model over the member rounds (the paper: 18% for its cost
model). Each round runs every member once, one after another (a fresh process each), so load drift
from other processes on this machine hits every member and model alike; the load average is printed
per member. Probe and engine run with the same torch thread count, `usable_cpus()`.

    sudo python3 benchmarks/probe_accuracy.py [--shares 2,1,0.5,0.25] [--model PATH] [--steps N]
                                              [--rounds R]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

CPU_ROOT = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 100_000


def member(args: argparse.Namespace) -> None:
    """Child: join the cgroup first (threads created later inherit it), then probe and run."""
    if args.cgroup:
        (Path(args.cgroup) / "cgroup.procs").write_text(str(os.getpid()))
    from kafila.models.checkpoint import Checkpoint
    from kafila.probe.measure import probe

    ckpt = Checkpoint.open(args.model)
    n_blocks = ckpt.config.num_hidden_layers
    load = os.getloadavg()[0]
    report = probe("torch", "fp32", model=ckpt.config, model_name=str(args.model), position=args.prompt)
    step_s, spread, threads = engine_step_s(ckpt, args.prompt, args.steps)
    block_bytes = sum(ckpt.manifest("F32").block_bytes) / n_blocks
    out = {"probe": report.to_dict(), "measured_block_s": step_s / n_blocks, "measured_spread": spread}
    print(
        json.dumps({**out, "block_bytes": block_bytes, "engine_threads": threads, "load": load}), flush=True
    )
    if args.cgroup:  # leave the quota: torch's teardown at a quarter core takes seconds
        (Path(args.cgroup).parent / "cgroup.procs").write_text(str(os.getpid()))


def engine_step_s(ckpt: object, prompt: int, steps: int) -> tuple[float, float, int]:
    """Median seconds of one decode step through every block of the model (no head), with the
    engine's Stage, its spread (half-range / median) and the torch threads it ran with; each timed
    sample spans several steps so it covers CFS periods. The engine does not size torch's thread
    pool itself, so it is set here as the probe sets it (`usable_cpus()`)."""
    import torch

    from kafila.engine.stage import Entry, Stage
    from kafila.engine.system import usable_cpus

    torch.set_num_threads(usable_cpus())
    n = ckpt.config.num_hidden_layers  # type: ignore[attr-defined]
    stage = Stage.load(
        ckpt, range(0, n), head=False, backend="torch", dtype="fp32", context=prompt + 4 * steps + 8
    )
    hidden = ckpt.config.hidden_size  # type: ignore[attr-defined]
    stage.open("r")
    stage.step(torch.randn(prompt, hidden), [Entry("r", 0, prompt)])  # prefill
    pos, samples = prompt, []
    x = torch.randn(1, hidden)
    for _ in range(4):
        t0 = time.perf_counter()
        for _ in range(steps):
            stage.step(x, [Entry("r", pos, 1)])
            pos += 1
        samples.append((time.perf_counter() - t0) / steps)
    med = statistics.median(samples)
    return med, (max(samples) - min(samples)) / 2 / med, torch.get_num_threads()


def make_group(share: float) -> Path:
    group = CPU_ROOT / f"kafila-probe-{int(share * 100)}"
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (group / "cpu.cfs_quota_us").write_text(str(int(share * PERIOD_US)))
    return group


def run_member(share: float, model: Path, steps: int, prompt: int) -> dict[str, Any]:
    group = make_group(share)
    cmd = [sys.executable, __file__, "--member", "--cgroup", str(group), "--model", str(model)]
    cmd += ["--steps", str(steps), "--prompt", str(prompt)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()
    return json.loads(out.strip().splitlines()[-1])


def rel_err(pred: float, meas: float) -> float:
    return abs(pred - meas) / meas


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--cgroup", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help="HF folder (default: the converted smollm2-135m)")
    ap.add_argument("--shares", default="2,1,0.5,0.25", help="CPU quota per member, in cores")
    ap.add_argument("--steps", type=int, default=6, help="decode steps per timed sample")
    ap.add_argument("--prompt", type=int, default=256, help="positions prefilled before decoding")
    ap.add_argument("--rounds", type=int, default=3, help="rounds; each runs every member once, in turn")
    args = ap.parse_args()
    if args.model is None:
        from kafila.models.default import ensure_default

        args.model = ensure_default("smollm2-135m", progress=False)
    if args.member:
        member(args)
        return
    if os.geteuid() != 0 or not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        sys.exit("probe_accuracy needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    shares = [float(s) for s in args.shares.split(",")]
    errors: dict[str, list[float]] = {k: [] for k in MODELS}
    per_share: dict[float, dict[str, list[float]]] = {s: {k: [] for k in (*MODELS, "meas")} for s in shares}
    print(f"model {args.model}; torch fp32; decode at position {args.prompt}; load {os.getloadavg()}")
    print(
        f"{'rnd':>3} {'share':>5} {'thr':>3} {'load':>4} {'meas ms/blk':>12} {'bw GB/s':>7} {'bw':>6} "
        f"{'err':>4} {'mv':>6} {'err':>4} {'synth':>6} {'err':>4} {'disp':>5} {'d+bw':>6} {'err':>4} "
        f"{'ovh us':>6}"
    )
    for rnd in range(args.rounds):  # members alternate within each round, so load drift hits all
        for share in shares:
            r = run_member(share, args.model, args.steps, args.prompt)
            p, meas, nbytes = r["probe"], float(r["measured_block_s"]), float(r["block_bytes"])
            preds = predictions(p, nbytes)
            for k, v in preds.items():
                errors[k].append(rel_err(v, meas))
                per_share[share][k].append(v)
            per_share[share]["meas"].append(meas)
            e = {k: f"{errors[k][-1] * 100:>3.0f}%" for k in MODELS}
            print(
                f"{rnd:>3} {share:>5.2f} {r['engine_threads']:>3} {r['load']:>4.1f} "
                f"{meas * 1e3:>6.2f}+-{r['measured_spread'] * 100:>3.0f}% "
                f"{p['bandwidth']['median'] / 1e9:>7.2f} {preds['bandwidth'] * 1e3:>6.2f} {e['bandwidth']} "
                f"{preds['matvec'] * 1e3:>6.2f} {e['matvec']} "
                f"{preds['synthetic'] * 1e3:>6.2f} {e['synthetic']} "
                f"{p['block_dispatch']['median'] * 1e3:>5.2f} "
                f"{preds['dispatch'] * 1e3:>6.2f} {e['dispatch']} "
                f"{p['overhead']['median'] * 1e6:>6.0f}"
            )
    print(f"\nper member, median over {args.rounds} rounds (ms per block; spread = half-range/median):")
    member_errs: dict[str, list[float]] = {k: [] for k in MODELS}
    for share, vals in per_share.items():
        meas = statistics.median(vals["meas"])
        cells = []
        for k, runs in vals.items():
            err = "" if k == "meas" else f" ({rel_err(statistics.median(runs), meas) * 100:.0f}%)"
            if k != "meas":
                member_errs[k].append(rel_err(statistics.median(runs), meas))
            cells.append(f"{k} {fig(runs)}{err}")
        print(f"  share {share:.2f}: " + "  ".join(cells))
    print(
        "\nmedian relative error of the per-block prediction over member rounds (paper: 18%); "
        f"load {os.getloadavg()}"
    )
    for k, errs in errors.items():
        q = statistics.quantiles(errs, n=4) if len(errs) > 1 else [errs[0]] * 3
        print(
            f"  {k:<10} {statistics.median(errs) * 100:5.1f}%  "
            f"(quartiles {q[0] * 100:.1f}-{q[2] * 100:.1f}%, worst {max(errs) * 100:.1f}%); "
            f"of member medians {statistics.median(member_errs[k]) * 100:.1f}%  {MODELS[k]}"
        )


MODELS = {
    "bandwidth": "block bytes / streamed bandwidth (the paper's model)",
    "matvec": "block bytes / matvec bandwidth",
    "synthetic": "one random-weight block of the model's shapes, timed",
    "dispatch": "block dispatch (the block's op chain at tiny shapes, timed) + block bytes / bandwidth",
}


def predictions(p: dict[str, Any], nbytes: float) -> dict[str, float]:
    bw, mv = p["bandwidth"]["median"], p["matvec_bandwidth"]["median"]
    return {
        "bandwidth": nbytes / bw,
        "matvec": nbytes / mv,
        "synthetic": p["block"]["median"],
        "dispatch": p["block_dispatch"]["median"] + nbytes / bw,
    }


def fig(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med * 1e3:.2f}+-{(max(values) - min(values)) / 2 / med * 100:.0f}%"


if __name__ == "__main__":
    main()
