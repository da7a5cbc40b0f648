"""Engine speed and memory against transformers `generate`, side by side in one run.

For each dtype: prefill and decode tokens/s of kafila's Stage (all blocks + head, greedy) and of
transformers' `generate` (greedy, KV cache) on the same model, prompt and token count, alternating
runs so both see the same machine load; the decode ratio; the fraction of the memory-bandwidth
bound reached (bytes read per decoded token, from the manifest, over the bandwidth measured here
with a streaming torch `sum` over a buffer far larger than the last-level cache); and, in a fresh
subprocess per dtype, peak memory of the engine against its weights + KV cache.

    python3 benchmarks/engine.py                       # default model, fp32 and bf16
    python3 benchmarks/engine.py --dtypes fp32 --repeats 5 --new-tokens 128
    python3 benchmarks/engine.py --dtypes fp32 --quant q4 int8   # packed weights, with llama.cpp

With `--quant int8|q4` the engine runs packed weights (the default model in q4: its GGUF's own
blocks), transformers the float model in the same dtype (it has no such format here), and
llama.cpp's `llama-bench` (when built: `--llama-bench`, default ~/.cache/kafila/llama.cpp/...,
by benchmarks/llama_build.py, which checks that it starts on this CPU) the same numbers: the
default GGUF (Q4_1 blocks, Q8_0 embedding) for q4, and
that file requantized to Q8_0 by `llama-quantize` for int8, with the same threads, prompt and token
count; the decode ratio to llama.cpp and both systems' fraction of the bandwidth bound are printed.

The figures are medians over `--repeats` runs with the spread (min-max) beside them; on a shared
machine the spread is the honest part.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from llama_build import start_failure

from kafila.engine import DTYPES as SAFETENSORS_DTYPES
from kafila.engine.backend import configure_openmp

if TYPE_CHECKING:
    from kafila.engine.stage import Stage

configure_openmp()  # as the engine sets it, for both systems
import torch  # noqa: E402  (after configure_openmp: OpenMP reads its settings when torch loads it)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def measure_bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Streaming read bandwidth (bytes/s, best of `repeats`) of torch `sum` over `mib` MiB."""
    torch.set_num_threads(threads)
    buf = torch.ones(mib * 1024 * 1024 // 4, dtype=torch.float32)
    buf.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def kafila_run(stage: Stage, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    from kafila.engine.generate import Timings, generate
    from kafila.engine.sampler import SamplingParams

    t = Timings()
    tokens = list(generate(stage, prompt, SamplingParams(max_tokens=new_tokens), timings=t))
    assert len(tokens) == new_tokens, f"generated {len(tokens)} of {new_tokens} tokens"
    return t.prefill_tps, t.decode_tps


def hf_run(model: Any, prompt: list[int], new_tokens: int) -> tuple[float, float]:
    """Prefill tok/s from a 1-token generate; decode tok/s from the extra time of the rest."""
    ids = torch.tensor([prompt])
    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kw)
        t2 = time.perf_counter()
    assert out.shape[1] == len(prompt) + new_tokens
    prefill_s = t1 - t0
    return len(prompt) / prefill_s, (new_tokens - 1) / max((t2 - t1) - prefill_s, 1e-9)


Runs = list[tuple[float, float]]  # (prefill tok/s, decode tok/s) per repeat


def med(runs: Runs, i: int) -> float:
    """The median of column `i` (0 prefill, 1 decode) over the runs."""
    return statistics.median(r[i] for r in runs)


def spread(runs: Runs, i: int) -> str:
    """Column `i`'s range over the runs, as printed beside its median."""
    return f"{min(r[i] for r in runs):.1f}-{max(r[i] for r in runs):.1f}"


def prompt_ids(n: int, vocab: int) -> list[int]:
    """The benchmark's prompt: `n` fixed token ids spread over the vocabulary (below `vocab`)."""
    return [(i * 7919) % min(40000, vocab - 100) + 100 for i in range(n)]


def speed(
    args: argparse.Namespace, path: Path, dtype: str, bandwidth: float, quant: str = "none"
) -> dict[str, float]:
    import transformers

    from kafila.engine.stage import Stage
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.registry import resolve

    ckpt = Checkpoint.open(resolve(args.model, progress=False, quant=quant))
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend="torch", dtype=dtype, context=args.context, quant=quant
    )
    threads = {"torch": torch.get_num_threads(), "numba": _numba_threads()}
    if set(threads.values()) - {None, args.threads}:
        raise SystemExit(f"threads after loading the stage: {threads}, not --threads {args.threads}")
    hf: Any = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype])
    hf.eval()  # inference mode: no dropout
    prompt = prompt_ids(args.prompt_tokens, ckpt.config.vocab_size)
    ours, theirs, llama = [], [], []
    gguf = llama_gguf(args, quant) if quant != "none" and llama_starts(args) else None
    kafila_run(stage, prompt, 4), hf_run(hf, prompt, 4)  # warm-up
    for _ in range(args.repeats):  # alternated, so that all systems see the same load
        ours.append(kafila_run(stage, prompt, args.new_tokens))
        theirs.append(hf_run(hf, prompt, args.new_tokens))
        if gguf is not None:
            llama.append(llama_bench(args, gguf))
    m = ckpt.manifest(SAFETENSORS_DTYPES[dtype], quant)
    per_token = sum(m.block_bytes) + m.head_read_bytes
    label = dtype if quant == "none" else f"{quant} weights, {dtype} compute"
    row = summarize(label, ours, theirs, per_token, bandwidth)
    if quant != "none":
        row |= llama_cpp(args, quant, gguf, llama, row, bandwidth / per_token)
    return row


LLAMA_CACHE = Path.home() / ".cache" / "kafila" / "llama.cpp"
LLAMA_BIN = LLAMA_CACHE / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp" / "build" / "bin"


def llama_gguf(args: argparse.Namespace, quant: str) -> Path | None:
    """The GGUF llama.cpp runs for `quant`: the default model's own file for q4, and that file
    requantized to Q8_0 (made once, cached) for int8; None where it cannot be had."""
    from kafila.models.default import DEFAULT_MODELS, locate_gguf

    if args.model not in DEFAULT_MODELS:
        return None
    source = locate_gguf(DEFAULT_MODELS[args.model])
    if quant == "q4":
        return source
    q8 = LLAMA_CACHE / f"{args.model}.Q8_0.gguf"
    tool = Path(args.llama_bench).parent / "llama-quantize"
    if not q8.is_file() and tool.is_file():
        subprocess.run(
            [str(tool), "--allow-requantize", str(source), str(q8), "Q8_0"], capture_output=True, check=True
        )
    return q8 if q8.is_file() else None


def llama_starts(args: argparse.Namespace) -> bool:
    """Whether --llama-bench is there and starts on this CPU (a native build can die of SIGILL
    where a guest lists features it cannot run; benchmarks/llama_build.py builds one that starts)."""
    if not Path(args.llama_bench).is_file():
        return False
    why = start_failure([args.llama_bench, "--help"])
    if why is not None:
        print(f"  llama.cpp: not run ({why}; `python3 benchmarks/llama_build.py` builds one that starts)")
    return why is None


def llama_bench(args: argparse.Namespace, gguf: Path) -> tuple[float, float]:
    """One llama-bench run on `gguf`: (prefill tok/s of --prompt-tokens, decode tok/s of
    --new-tokens) with --threads threads."""
    cmd = [args.llama_bench, "-m", str(gguf), "-t", str(args.threads), "-p", str(args.prompt_tokens)]
    cmd += ["-n", str(args.new_tokens), "-r", "1", "-o", "json"]
    runs = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    prefill = next(r["avg_ts"] for r in runs if r["n_prompt"] > 0)
    return prefill, next(r["avg_ts"] for r in runs if r["n_gen"] > 0)


def llama_cpp(
    args: argparse.Namespace, quant: str, gguf: Path | None, runs: Runs, ours: dict[str, float], bound: float
) -> dict[str, float]:
    """llama.cpp's medians over the runs alternated with ours (`llama_bench` on `llama_gguf`'s
    file: the same numbers), our ratio to them, its fraction of the bandwidth bound."""
    if gguf is None or not runs:
        print(
            f"  llama.cpp: not run ({args.llama_bench} or its {quant} GGUF is missing; "
            "docs/engine.md says how to build it)"
        )
        return {}
    prefill, decode = med(runs, 0), med(runs, 1)
    row = {"llama_prefill": prefill, "llama_decode": decode, "llama_ratio": ours["kafila_decode"] / decode}
    print(
        f"  {'llama.cpp':12}{prefill:>10.1f} {'':13}{decode:>10.1f} ({spread(runs, 1):>11})  ({gguf.name}, "
        f"{args.threads} threads)\n"
        f"  kafila/llama.cpp decode {row['llama_ratio']:.2f}x (target >= 1.0), prefill "
        f"{ours['kafila_prefill'] / prefill:.2f}x; llama.cpp at {decode / bound:.0%} of the bandwidth bound"
    )
    return row


def summarize(dtype: str, ours: Runs, theirs: Runs, per_token: int, bandwidth: float) -> dict[str, float]:
    bound = bandwidth / per_token
    row = {
        "kafila_prefill": med(ours, 0),
        "kafila_decode": med(ours, 1),
        "hf_prefill": med(theirs, 0),
        "hf_decode": med(theirs, 1),
        "bound_decode": bound,
        "bytes_per_token": per_token,
    }
    row["decode_ratio"] = row["kafila_decode"] / row["hf_decode"]
    row["prefill_ratio"] = row["kafila_prefill"] / row["hf_prefill"]
    row["bound_fraction"] = row["kafila_decode"] / bound
    print(f"\n[{dtype}] bytes read per decoded token {per_token / 1e6:.1f} MB -> bound {bound:.1f} tok/s")
    print(f"  {'':12}{'prefill tok/s':>24}{'decode tok/s':>24}")
    for name, runs in (("kafila", ours), ("transformers", theirs)):
        cells = [f"{med(runs, i):>10.1f} ({spread(runs, i):>11})" for i in (0, 1)]
        print(f"  {name:12}{cells[0]}{cells[1]}")
    print(
        f"  decode ratio {row['decode_ratio']:.2f}x (target >= 2), "
        f"prefill ratio {row['prefill_ratio']:.2f}x, "
        f"decode at {row['bound_fraction']:.0%} of the bandwidth bound (target >= 65%)"
    )
    return row


def gguf_speed(args: argparse.Namespace, file: Path, bandwidth: float) -> dict[str, float]:
    """--gguf FILE: Kafila serving the file (converted once into the cache: each tensor in its own
    type where Kafila computes it packed, widened to floats where it does not, which the conversion
    says on the console) against llama-bench on the same file, same threads, alternated."""
    from kafila.engine.stage import Stage
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.registry import resolve

    ckpt = Checkpoint.open(resolve(str(file)))
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend="torch", dtype="fp32", context=args.context, quant="auto"
    )
    quant = str(getattr(stage.model, "quant", "none"))
    prompt = prompt_ids(args.prompt_tokens, ckpt.config.vocab_size)
    gguf = file if llama_starts(args) else None
    ours, llama = [], []
    kafila_run(stage, prompt, 4)  # warm-up
    for _ in range(args.repeats):  # alternated, so that both see the same load
        ours.append(kafila_run(stage, prompt, args.new_tokens))
        if gguf is not None:
            llama.append(llama_bench(args, gguf))
    m = ckpt.manifest(SAFETENSORS_DTYPES["fp32"], quant)
    per_token = sum(m.block_bytes) + m.head_read_bytes
    bound = bandwidth / per_token
    row = {"kafila_prefill": med(ours, 0), "kafila_decode": med(ours, 1)}
    print(
        f"\n[{file.name}: served as {quant} weights, fp32 compute] bytes read per decoded token "
        f"{per_token / 1e6:.1f} MB -> bound {bound:.1f} tok/s\n"
        f"  {'':12}{'prefill tok/s':>24}{'decode tok/s':>24}\n"
        f"  {'kafila':12}{row['kafila_prefill']:>10.1f} ({spread(ours, 0):>11}){row['kafila_decode']:>10.1f} "
        f"({spread(ours, 1):>11})  decode at {row['kafila_decode'] / bound:.0%} of the bandwidth bound"
    )
    return row | llama_cpp(args, quant, gguf, llama, row, bound)


def memory_child(
    path: str, dtype: str, context: int, prompt_tokens: int, new_tokens: int, quant: str = "none"
) -> dict[str, int]:
    """Runs in a fresh process: peak RSS growth while loading and generating vs weights + KV.
    The baseline is taken after the libraries are loaded: torch, and on the CPU numba with the
    compiled kernels (about 130 MiB, the same for every model size). (VmHWM, not ru_maxrss:
    ru_maxrss survives exec, so it would carry the parent's peak.)"""
    from kafila.engine.backend import resolve
    from kafila.engine.stage import Stage
    from kafila.models.checkpoint import Checkpoint

    ckpt = Checkpoint.open(path)
    backend = resolve("torch", dtype)  # imports torch before the baseline
    if backend.device == "cpu":  # and loads the compiled CPU kernels: library code, like torch's own
        from kafila.models.torch import decode_cpu

        decode_cpu.warm_up()
        if quant != "none":
            from kafila.models.torch import quant_cpu

            quant_cpu.warm_up()
    base = _proc_status_bytes("VmRSS")
    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, backend=backend, context=context, quant=quant)
    kafila_run(stage, list(range(100, 100 + prompt_tokens)), new_tokens)
    peak = _proc_status_bytes("VmHWM")
    m = ckpt.manifest({"fp32": "F32", "bf16": "BF16", "fp16": "F16"}[dtype], quant)
    return {"peak_growth": peak - base, "weights": m.total_bytes, "kv": stage.kv_bytes}


def _proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def memory(args: argparse.Namespace, path: Path, dtype: str, quant: str = "none") -> dict[str, int]:
    here = str(Path(__file__).resolve().parent)  # benchmarks/, as when this script runs (llama_build)
    call = f"memory_child({str(path)!r}, {dtype!r}, {args.context}, {args.prompt_tokens}, 16, {quant!r})"
    code = f"import json, sys; sys.path.insert(0, {here!r}); from engine import memory_child; "
    code += f"print(json.dumps({call}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise SystemExit(f"the memory subprocess failed (exit {out.returncode}): {out.stderr[-1500:]}")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    need = r["weights"] + r["kv"]
    print(
        f"  memory: peak growth {r['peak_growth'] / 2**20:.0f} MiB vs weights {r['weights'] / 2**20:.0f} MiB "
        f"+ KV {r['kv'] / 2**20:.0f} MiB = {r['peak_growth'] / need:.2f}x (target <= 1.3x)"
    )
    return r


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m", help="default model name or a Hugging Face folder")
    p.add_argument(
        "--dtypes", nargs="+", default=["fp32", "bf16"], choices=sorted(DTYPES), help="dtypes to run"
    )
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt length in tokens")
    p.add_argument(
        "--new-tokens", type=int, default=64, help="tokens generated per run (greedy, no EOS stop)"
    )
    p.add_argument("--repeats", type=int, default=3, help="runs per system per dtype (median reported)")
    p.add_argument("--context", type=int, default=2048, help="engine KV-cache context (counted in memory)")
    p.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="threads for every system: the benchmark is pinned to that many CPUs, and kafila, "
        "transformers (torch) and llama-bench (-t) each run that many",
    )
    p.add_argument(
        "--quant",
        nargs="+",
        default=["none"],
        choices=["none", "int8", "q4"],
        help="weight formats to run (int8, q4: packed weights, side by side with llama.cpp)",
    )
    p.add_argument(
        "--gguf",
        metavar="FILE",
        help="a GGUF file: Kafila serving it (as `--model FILE` does) against llama-bench on the same file "
        "(no transformers run, no --dtypes or --quant)",
    )
    p.add_argument("--llama-bench", default=str(LLAMA_BIN / "llama-bench"), help="llama.cpp's llama-bench")
    args = p.parse_args()
    cpus = pin(args.threads)
    from kafila.models.registry import resolve
    from kafila.obs.log import configure_logging

    configure_logging(level="warning")
    path = Path(args.gguf) if args.gguf else resolve(args.model)
    bandwidth = measure_bandwidth(args.threads)
    print(
        f"model {path}  threads {args.threads}, pinned to CPUs {cpus}  "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']} "
        f"GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}  "
        f"streaming read bandwidth {bandwidth / 1e9:.1f} GB/s (torch sum)"
    )
    if args.gguf:
        gguf_speed(args, path, bandwidth)
        return 0
    for quant in args.quant:
        for dtype in args.dtypes:
            speed(args, path, dtype, bandwidth, quant)
            memory(args, path if quant == "none" else resolve(args.model, quant=quant), dtype, quant)
    return 0


def _numba_threads() -> int | None:
    """The numba kernels' pool size, where they loaded (None: not used by this run)."""
    if "numba" not in sys.modules:
        return None
    import numba

    return int(numba.get_num_threads())


def pin(threads: int) -> list[int]:
    """Pin this process (and so its children: llama-bench, the memory subprocess) to its first
    `threads` CPUs, and size kafila's pools (torch, the numba kernels: KAFILA_THREADS, read when a
    stage loads; loading resets them to every usable CPU otherwise) and transformers' torch to
    `threads`: every compared system runs on the same CPUs with the same threads."""
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= threads <= len(allowed):
        raise SystemExit(f"--threads {threads}: this process may use {len(allowed)} CPUs ({allowed})")
    os.sched_setaffinity(0, allowed[:threads])
    os.environ["KAFILA_THREADS"] = str(threads)
    torch.set_num_threads(threads)
    return allowed[:threads]


if __name__ == "__main__":
    raise SystemExit(main())
