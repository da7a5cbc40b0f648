"""`kafila probe`: measure this device with the backend it will infer with."""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

from kafila.cli.argtypes import non_negative_int, positive_int
from kafila.cli.host import add_threads_flag
from kafila.cli.plan import non_empty
from kafila.engine import DTYPE_CHOICES

if TYPE_CHECKING:
    from kafila.models.config import ModelConfig


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "torch", "mlx"],
        help="auto (MLX on Apple Silicon, else torch), torch or mlx",
    )
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="auto (bf16 on a GPU, fp32 on a CPU), fp32, bf16 or fp16",
    )
    parser.add_argument(
        "--repeats", type=positive_int, help="repetitions per figure (default 5; 3 under a CPU quota)"
    )
    parser.add_argument(
        "--model",
        type=non_empty,
        help="also time one decode step of one block of this model (preset or Hugging Face folder), "
        "random weights allocated here, and the same block's op chain at tiny shapes (its dispatch cost)",
    )
    parser.add_argument(
        "--position",
        type=non_negative_int,
        help="with --model: the KV position of the timed decode steps, below the model's trained "
        "positions (default 256, the position the planner's costs are a step's at)",
    )
    parser.add_argument(
        "--name", type=non_empty, default="this-device", help="device name in the --json DeviceReport"
    )
    parser.add_argument("--json", action="store_true", help="print the probe report and DeviceReport as JSON")
    add_threads_flag(parser)


def main(args: argparse.Namespace) -> int:
    from kafila.engine.backend import BackendError
    from kafila.models.presets import resolve_config
    from kafila.probe.measure import probe

    try:
        config = None if args.model is None else resolve_config(args.model)
        position = check_position(args.position, args.model, config)
        report = probe(args.backend, args.dtype, args.repeats, config, args.model, position)
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
    if report.stage_fixed:
        rows.append(("stage step, per-step part", report.stage_fixed, 1e3, "ms"))
    if report.wake:
        rows.append((f"wake-up (tau {(report.wake_tau_s or 0) * 1e3:.1f} ms)", report.wake, 1e3, "ms"))
    print(f"backend {report.backend}, threads {report.threads}, cpu quota {report.cpu_quota or 'none'}")
    print(f"memory for weights: {report.memory_bytes / 1e9:.1f} GB")
    for label, fig, scale, unit in rows:
        print(f"{label:<28} {fig.median * scale:>10.3f} {unit:<8} +-{fig.spread * 100:.0f}% (n={fig.n})")
    print(f"probe took {report.wall_s:.1f} s")
    return 0


def check_position(position: int | None, model: str | None, config: ModelConfig | None) -> int:
    """The KV position to time the model's block at: --position, below the model's trained
    positions (a larger one would allocate its KV cache for nothing), or the default."""
    from kafila.probe.measure import POSITION

    if position is None:
        return POSITION
    if config is None:
        raise ValueError("--position sets where --model's block is timed; without --model nothing uses it")
    limit = config.max_position_embeddings
    if position >= limit:
        raise ValueError(
            f"--position {position} is beyond the {limit} positions {model} was trained for "
            f"(at most {limit - 1})"
        )
    return position
