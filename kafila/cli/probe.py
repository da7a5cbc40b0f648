"""`kafila probe`: measure this device with the backend it will infer with."""

from __future__ import annotations

import argparse
import json
import sys

from kafila.cli.host import add_threads_flag


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend", default="auto", help="auto (MLX on Apple Silicon, else torch), torch or mlx"
    )
    parser.add_argument(
        "--dtype", default="auto", help="auto (bf16 on a GPU, fp32 on a CPU), fp32, bf16 or fp16"
    )
    parser.add_argument("--repeats", type=int, help="repetitions per figure (default 5; 3 under a CPU quota)")
    parser.add_argument(
        "--model",
        help="also time one decode step of one block of this model (preset or Hugging Face folder), "
        "random weights allocated here, and the same block's op chain at tiny shapes (its dispatch cost)",
    )
    parser.add_argument(
        "--position",
        type=int,
        default=256,
        help="KV positions the synthetic block attends over (default 256)",
    )
    parser.add_argument("--name", default="this-device", help="device name in the --json DeviceReport")
    parser.add_argument("--json", action="store_true", help="print the probe report and DeviceReport as JSON")
    add_threads_flag(parser)


def main(args: argparse.Namespace) -> int:
    from kafila.engine.backend import BackendError
    from kafila.models.presets import resolve_config
    from kafila.probe.measure import probe

    try:
        config = resolve_config(args.model) if args.model else None
        report = probe(args.backend, args.dtype, args.repeats, config, args.model, args.position)
    except (BackendError, ValueError, KeyError, OSError) as exc:
        print(f"kafila probe: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = {"probe": report.to_dict(), "device": report.device_report(args.name).to_dict()}
        print(json.dumps(out, indent=2))
        return 0
    rows = [
        ("bandwidth (stream)", report.bandwidth, 1e-9, "GB/s"),
        ("bandwidth (matvec)", report.matvec_bandwidth, 1e-9, "GB/s"),
        ("dispatch overhead", report.overhead, 1e6, "us"),
        ("matmul throughput", report.flops, 1e-12, "TFLOP/s"),
    ]
    if report.block:
        rows.append((f"block step ({args.model})", report.block, 1e3, "ms"))
    if report.head:
        rows.append((f"head step ({args.model})", report.head, 1e3, "ms"))
    if report.block_dispatch:
        rows.append(("block dispatch (tiny shapes)", report.block_dispatch, 1e3, "ms"))
    print(f"backend {report.backend}, threads {report.threads}, cpu quota {report.cpu_quota or 'none'}")
    print(f"memory for weights: {report.memory_bytes / 1e9:.1f} GB")
    for label, fig, scale, unit in rows:
        print(f"{label:<28} {fig.median * scale:>10.3f} {unit:<8} +-{fig.spread * 100:.0f}% (n={fig.n})")
    print(f"probe took {report.wall_s:.1f} s")
    return 0
