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
and the median relative error of each model over the members (the paper: 18% for its cost model).
Members run one after another; other processes on this machine add noise, so say so with figures.

    sudo python3 benchmarks/probe_accuracy.py [--shares 2,1,0.5,0.25] [--model PATH] [--steps N]
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
    rounds = []
    for _ in range(args.rounds):  # probe and engine alternate, so load drift hits both alike
        report = probe("torch", "fp32", model=ckpt.config, model_name=str(args.model), position=args.prompt)
        step_s, _ = engine_step_s(ckpt, args.prompt, args.steps)
        rounds.append({"probe": report.to_dict(), "measured_block_s": step_s / n_blocks})
    block_bytes = sum(ckpt.manifest("F32").block_bytes) / n_blocks
    print(json.dumps({"rounds": rounds, "block_bytes": block_bytes, "n_blocks": n_blocks}))


def engine_step_s(ckpt: object, prompt: int, steps: int) -> tuple[float, int]:
    """Median seconds of one decode step through every block of the model (no head), with the
    engine's Stage; each timed sample spans several steps so it covers CFS periods."""
    import torch

    from kafila.engine.stage import Entry, Stage

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
    return statistics.median(samples), n


def make_group(share: float) -> Path:
    group = CPU_ROOT / f"kafila-probe-{int(share * 100)}"
    group.mkdir(exist_ok=True)
    (group / "cpu.cfs_period_us").write_text(str(PERIOD_US))
    (group / "cpu.cfs_quota_us").write_text(str(int(share * PERIOD_US)))
    return group


def run_member(share: float, model: Path, steps: int, prompt: int, rounds: int) -> dict[str, Any]:
    group = make_group(share)
    cmd = [sys.executable, __file__, "--member", "--cgroup", str(group), "--model", str(model)]
    cmd += ["--steps", str(steps), "--prompt", str(prompt), "--rounds", str(rounds)]
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
    ap.add_argument("--rounds", type=int, default=2, help="probe + engine rounds per member")
    args = ap.parse_args()
    if args.model is None:
        from kafila.models.default import ensure_default

        args.model = ensure_default("smollm2-135m", progress=False)
    if args.member:
        member(args)
        return
    if os.geteuid() != 0 or not (CPU_ROOT / "cpu.cfs_quota_us").exists():
        sys.exit("probe_accuracy needs root and the cgroup v1 cpu controller at /sys/fs/cgroup/cpu")
    errors: dict[str, list[float]] = {"bandwidth": [], "matvec": [], "synthetic": []}
    print(f"model {args.model}; torch fp32; decode at position {args.prompt}")
    print(
        f"{'share':>6} {'meas ms/blk':>11} {'bw GB/s':>8} {'bw pred':>8} {'err':>5} "
        f"{'mv GB/s':>8} {'mv pred':>8} {'err':>5} {'synth':>8} {'err':>5} {'ovh us':>7}"
    )
    for share in [float(s) for s in args.shares.split(",")]:
        r = run_member(share, args.model, args.steps, args.prompt, args.rounds)
        nbytes = float(r["block_bytes"])
        for rnd in r["rounds"]:
            p, meas = rnd["probe"], float(rnd["measured_block_s"])
            bw, mv, synth = p["bandwidth"]["median"], p["matvec_bandwidth"]["median"], p["block"]["median"]
            preds = {"bandwidth": nbytes / bw, "matvec": nbytes / mv, "synthetic": synth}
            for k, v in preds.items():
                errors[k].append(rel_err(v, meas))
            print(
                f"{share:>6.2f} {meas * 1e3:>11.2f} {bw / 1e9:>8.2f} {preds['bandwidth'] * 1e3:>8.2f} "
                f"{errors['bandwidth'][-1] * 100:>4.0f}% {mv / 1e9:>8.2f} {preds['matvec'] * 1e3:>8.2f} "
                f"{errors['matvec'][-1] * 100:>4.0f}% {synth * 1e3:>8.2f} "
                f"{errors['synthetic'][-1] * 100:>4.0f}% "
                f"{p['overhead']['median'] * 1e6:>7.0f}"
            )
    print("\nmedian relative error of the per-block prediction over member rounds (paper: 18%):")
    for k, errs in errors.items():
        print(f"  {k:<10} {statistics.median(errs) * 100:5.1f}%  (worst {max(errs) * 100:.1f}%)")


if __name__ == "__main__":
    main()
