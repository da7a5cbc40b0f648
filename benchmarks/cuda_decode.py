"""Decode steps on one NVIDIA card: eager (torch's kernels one by one) against captured CUDA graphs.

Writes a checkpoint of random bf16 weights in Qwen3-8B's shapes (the preset, kafila.models.presets;
no model hub) to --dir (default: a temporary folder; an existing one is reused), loads one stage of
its first --blocks blocks (default all 36) and times that stage's decode step for 1, 4, 16 and 64
rows (one per request, each at --position) through both paths, alternated round after round: ms
per step and per block, tokens/s (rows / step), and the fraction of the HBM bound (the weight and
KV-cache bytes a step reads, over the bandwidth this run measures as the probe does). Target: one
row at 60% of the bound or more.

Then one user's greedy decode (head included) in one process holding every block, against a ring
of two processes on the same card (the head and the first half, then the second half), each
stage captured, alternated: tokens/s and their ratio (target >= 0.9). The ring's link is a local
pipe carrying the wire bytes (to_bytes / from_bytes), not QUIC: what is measured is two processes
sharing one card; benchmarks/pipeline_overhead.py measures the network's part.

On a CPU (`--device cpu`) the graph path is unavailable and the static step runs uncaptured in its
place ("static"); `--small` takes a tiny Qwen3 config, so that both run in seconds anywhere.

    python3 benchmarks/cuda_decode.py [--rows 1 4 16 64] [--blocks 36] [--rounds 5] [--steps 20]
        [--position 256] [--ring-tokens 48] [--no-ring] [--dir FOLDER] [--json FILE]
    python3 benchmarks/cuda_decode.py --device cpu --small
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

SMALL = {  # a Qwen3 of tiny widths: the same code paths in seconds
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 512,
    "vocab_size": 1024,
}
# The ring's prompt and context: every decode step after the prompt attends within one keys window
# (static_decode.keys_bucket: 513..1024 positions), so no graph is recorded inside a timed round.
PREFILL, RING_CONTEXT = 520, 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--small", action="store_true", help="a tiny Qwen3 config instead of Qwen3-8B's")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 64], help="rows per decode step")
    p.add_argument("--blocks", type=int, help="blocks of the timed stage (default: all)")
    p.add_argument("--position", type=int, default=256, help="KV position of the timed steps (default 256)")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each path timed once per round (default 5)")
    p.add_argument("--steps", type=int, default=20, help="decode steps timed per path per round (default 20)")
    p.add_argument("--ring-tokens", type=int, default=48, help="tokens per ring round (default 48)")
    p.add_argument("--no-ring", action="store_true", help="skip the two-process ring")
    p.add_argument("--dir", type=Path, help="checkpoint folder (made when missing; default temporary)")
    p.add_argument("--json", type=Path, help="also write the figures here")
    args = p.parse_args()
    from kafila.obs.log import configure_logging

    configure_logging(level="warning")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here: run with --device cpu (and --small) to check the script", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="kafila-cuda-decode-") as tmp:
        folder = args.dir or Path(tmp)
        made = make_checkpoint(folder, SMALL if args.small else None, args.device)
        print(f"checkpoint {folder}: {made}")
        figures: dict[str, Any] = {"device": _device_name(args.device), "dtype": args.dtype}
        figures["steps"] = time_steps(folder, args)
        if not args.no_ring:
            _release(args.device)  # the stages above: their graphs and weights
            figures["ring"] = time_ring(folder, args)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    return 0


# -- the checkpoint ---------------------------------------------------------------------------------


def make_checkpoint(folder: Path, small: dict[str, int] | None, device: str) -> str:
    """Random bf16 weights in Qwen3-8B's shapes (or `small`'s), one safetensors file per block;
    norms are ones. Generated on `device` (fast on a card), written as Hugging Face lays them out.
    A folder that already holds such a checkpoint is kept."""
    import torch
    from safetensors.torch import save_file

    from kafila.models.config import ModelConfig
    from kafila.models.manifest import block_index, specs_from_config
    from kafila.models.presets import PRESETS

    raw = PRESETS["qwen3-8b"] | (small or {})
    if (folder / "config.json").exists() and json.loads((folder / "config.json").read_text()) == raw:
        return "reused"
    folder.mkdir(parents=True, exist_ok=True)
    config = ModelConfig.from_dict(raw)
    gen = torch.Generator(device).manual_seed(0)
    files: dict[str | None, list[Any]] = {}
    for spec in specs_from_config(config, "BF16"):
        files.setdefault(_shard(block_index(spec.name)), []).append(spec)
    began, weight_map = time.perf_counter(), {}
    for i, (shard, specs) in enumerate(files.items()):
        tensors = {s.name: _random(s.name, s.shape, gen, device) for s in specs}
        save_file(tensors, str(folder / str(shard)))
        weight_map.update({s.name: shard for s in specs})
        print(f"\r  writing {i + 1}/{len(files)} files", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (folder / "config.json").write_text(json.dumps(raw))
    return f"written in {time.perf_counter() - began:.1f} s"


def _shard(block: int | None) -> str:
    return "head.safetensors" if block is None else f"block-{block:03d}.safetensors"


def _random(name: str, shape: tuple[int, ...], gen: Any, device: str) -> Any:
    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    t = torch.randn(shape, generator=gen, device=device, dtype=torch.float32).mul_(0.02)
    return t.to(torch.bfloat16).cpu()


# -- decode steps of one stage ----------------------------------------------------------------------


def time_steps(folder: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each --rows count through the eager and the captured (or static) path, alternated."""
    import torch

    from kafila.engine.captured import EagerDecode, decode_path
    from kafila.engine.stage import Stage
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.span import Span

    ckpt = Checkpoint.open(folder)
    blocks = range(args.blocks or ckpt.n_blocks)
    be = _backend(args.device, args.dtype)
    slots, context = max(args.rows), args.position + 1
    fast_mode = "graph" if args.device == "cuda" else "static"
    stage = Stage.load(ckpt, blocks, False, be, args.dtype, context, slots, decode="eager")  # the model alone
    paths = {
        "eager": EagerDecode(stage.model, slots),
        fast_mode: decode_path(stage.model, be, slots, fast_mode),
    }
    bandwidth = stream_bandwidth(be, args.small)
    kv_token = 2 * ckpt.config.num_key_value_heads * ckpt.config.head_dim * _element(args.dtype)
    width, gb = ckpt.config.hidden_size, stage.bytes_loaded / 1e9
    print(f"{args.device} ({_device_name(args.device)}), {len(blocks)} blocks of {width} wide, {gb:.2f} GB,")
    print(f"bandwidth {bandwidth / 1e9:.0f} GB/s (streamed here, as the probe does)")
    heads = ("path", "rows", "ms/step", "ms/block", "tokens/s", "bound ms", "of bound")
    print(" ".join(f"{h:>{w}}" for h, w in zip(heads, (6, 5, 8, 9, 9, 9, 9), strict=True)))
    out = []
    for rows in args.rows:
        x = torch.randn(rows, ckpt.config.hidden_size).to(be.device, be.torch_dtype)  # [rows, H]
        spans = [Span(slot=i, start=args.position, length=1) for i in range(rows)]
        times = _alternated(paths, x, spans, args.rounds, args.steps, be.device)
        bound = (stage.bytes_loaded + rows * context * kv_token * len(blocks)) / bandwidth
        for name in paths:
            step = statistics.median(times[name])
            row = {
                "path": name,
                "rows": rows,
                "ms_step": step * 1e3,
                "ms_block": step * 1e3 / len(blocks),
                "tokens_s": rows / step,
                "bound_ms": bound * 1e3,
                "of_bound": bound / step,
            }
            out.append(row)
            print(
                f"{name:>6} {rows:>5} {row['ms_step']:>8.3f} {row['ms_block']:>9.4f} {row['tokens_s']:>9.0f} "
                f"{row['bound_ms']:>9.3f} {row['of_bound']:>8.0%}"
            )
        eager, fast = (statistics.median(times[n]) for n in paths)
        ran = paths[fast_mode].name  # "eager" where a capture raised (logged as decode_capture_failed)
        print(
            f"{'':>6} {rows:>5} {fast_mode} {eager / fast:.2f}x eager"
            + ("" if ran == fast_mode else f" (ran {ran}!)")
        )
        out[-1]["ran"] = ran
    return out


def _alternated(
    paths: dict[str, Any], x: Any, spans: list[Any], rounds: int, steps: int, device: str
) -> dict[str, list[float]]:
    """Per path, seconds of each timed step: three warm-up steps (the graph path records its
    bucket there), then `rounds` rounds of `steps` steps of each path in turn, each waited for (a
    ring stage sends its output at once)."""
    times: dict[str, list[float]] = {name: [] for name in paths}
    for path in paths.values():
        for _ in range(3):
            _sync(path.forward(x, spans), device)
    for _ in range(rounds):
        for name, path in paths.items():
            for _ in range(steps):
                began = time.perf_counter()
                _sync(path.forward(x, spans), device)
                times[name].append(time.perf_counter() - began)
    return times


def _sync(value: Any, device: str) -> Any:
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return value


def stream_bandwidth(be: Any, small: bool) -> float:
    """Bytes/s of a reduction over a buffer, as the probe measures `bandwidth` (kafila.probe.measure)."""
    from kafila.probe.measure import seconds_per_call
    from kafila.probe.ops import Ops
    from kafila.probe.stats import rates

    ops = Ops(be)
    buf = ops.make_buffer((64 << 20) if small else (1 << 30) if be.device == "cuda" else (256 << 20))
    return statistics.median(rates(seconds_per_call(ops.make_stream(buf), 5, 0.04), ops.nbytes(buf)))


def _release(device: str) -> None:
    import gc

    gc.collect()
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()


def _backend(device: str, dtype: str) -> Any:
    from kafila.engine.backend import TorchBackend, resolve

    return resolve("torch", dtype) if device == "cuda" else TorchBackend("torch", "cpu", dtype)


def _element(dtype: str) -> int:
    return {"bf16": 2, "fp32": 4}[dtype]


def _device_name(device: str) -> str:
    import platform

    import torch

    return torch.cuda.get_device_name() if device == "cuda" else platform.processor() or "cpu"


# -- one user: one process against a ring of two -----------------------------------------------------


def time_ring(folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One user's greedy decode, head included: one process with every block against two processes
    (blocks split in half) on the same device, both resident, alternated per round."""
    from kafila.models.checkpoint import Checkpoint

    n = Checkpoint.open(folder).n_blocks
    if 8 + args.rounds * args.ring_tokens > RING_CONTEXT - PREFILL:
        raise SystemExit(f"--rounds x --ring-tokens must stay below {RING_CONTEXT - PREFILL - 8} tokens")
    ctx = mp.get_context("spawn")  # CUDA in a child needs a fresh interpreter
    setups = {"one process": [(0, n)], "ring of two": [(0, n // 2), (n // 2, n)]}
    controls, procs = {}, []
    for name, splits in setups.items():
        links = [ctx.Pipe() for _ in splits]  # member i sends on links[i][0], member i+1 reads links[i][1]
        here, there = ctx.Pipe()
        controls[name] = here
        for i, (a, b) in enumerate(splits):
            peers = (links[i - 1][1], links[i][0]) if len(splits) > 1 else (None, None)
            member_args = (str(folder), a, b, args.device, args.dtype, there if i == 0 else None, *peers)
            procs.append(ctx.Process(target=member, args=member_args, daemon=True))
    for proc in procs:
        proc.start()
    for here in controls.values():
        if here.recv() != "ready":
            raise RuntimeError("a ring member failed to load")
    rates_: dict[str, list[float]] = {name: [] for name in setups}
    for here in controls.values():  # warm-up: the prompt, and the graphs recorded
        here.send(8)
        here.recv()
    for _ in range(args.rounds):
        for name, here in controls.items():
            here.send(args.ring_tokens)
            rates_[name].append(args.ring_tokens / here.recv())
    for here in controls.values():
        here.send(0)
    for proc in procs:
        proc.join(timeout=60)
    one, ring = (statistics.median(rates_[name]) for name in setups)
    print(
        f"one user, head included: one process {one:.1f} tok/s, a ring of two processes on the same "
        f"{args.device} {ring:.1f} tok/s: {ring / one:.2f}x (target >= 0.9)"
    )
    return {"one_process_tok_s": one, "ring_tok_s": ring, "ratio": ring / one}


def member(
    folder: str, a: int, b: int, device: str, dtype: str,
    control: Connection | None, prev: Connection | None, nxt: Connection | None,
) -> None:  # fmt: skip
    """A ring member in its own process: blocks [a, b), the head where `control` is given (it runs
    the user's steps when told how many, and answers their seconds); others forward what arrives."""
    from kafila.engine.stage import Stage
    from kafila.models.checkpoint import Checkpoint
    from kafila.obs.log import configure_logging

    configure_logging(level="warning")
    be = _backend(device, dtype)
    ckpt = Checkpoint.open(folder)
    stage = Stage.load(ckpt, range(a, b), control is not None, backend=be, dtype=dtype, context=RING_CONTEXT)
    stage.open("u")
    if control is None:
        assert prev is not None and nxt is not None
        while (msg := prev.recv()) is not None:
            pos, data, shape = msg
            [h] = stage.forward([("u", pos, stage.from_bytes(data, shape))])
            nxt.send(stage.to_bytes(h))
        return
    control.send("ready")
    pos, token = 0, 1
    while n := control.recv():
        began = time.perf_counter()
        for _ in range(n):
            ids = list(range(1, PREFILL + 1)) if pos == 0 else [token]
            h = stage.embed(ids)
            [h] = stage.forward([("u", pos, h)])
            if nxt is not None and prev is not None:  # around the ring, as wire bytes
                nxt.send((pos, stage.to_bytes(h), tuple(h.shape)))
                h = stage.from_bytes(prev.recv(), tuple(h.shape))
            token, pos = int(stage.logits(h[-1]).argmax()), pos + len(ids)
        control.send(time.perf_counter() - began)
    if nxt is not None:
        nxt.send(None)


if __name__ == "__main__":
    sys.exit(main())
