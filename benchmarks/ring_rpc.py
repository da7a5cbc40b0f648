"""A three-member Kafila ring in q4 against llama.cpp's RPC split of the same file, on loopback.

Kafila: three `kafila host`/`join` processes (kafila.demo.fleet.LocalFleet, `--quant q4`: the
default model's own GGUF Q4_1 blocks) serve greedy requests; decode tokens/s of each request is
the head's trace record's. llama.cpp: three `ggml-rpc-server` processes on 127.0.0.1 and
`llama-bench --rpc` with every layer on them (`-ngl 99`: its layer split across the three), the
same GGUF, prompt length and token count. Rounds alternate the two, so both see the same machine
load; medians with the spread, and the ratio (target: the ring at least as fast).

llama.cpp must be built with RPC (`-DGGML_RPC=ON`, a build folder of its own beside the plain one:
docs/benchmarks.md says how); `--llama-bin` names its bin folder.

    python3 benchmarks/ring_rpc.py [--tokens 64] [--rounds 5] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path

from _session_common import Load, LocalFleet, complete, median, spread, wait_records
from llama_build import start_failure

from kafila.demo.fleet import free_port
from kafila.engine.system import THREADS_ENV

RPC_BIN = Path.home() / ".cache/kafila/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build-rpc/bin"


def llama_rpc_run(bench: Path, gguf: Path, ports: list[int], threads: int, prompt: int, tokens: int) -> float:
    """Decode tok/s of one llama-bench run with every layer split over the RPC servers at `ports`."""
    rpc = ",".join(f"127.0.0.1:{p}" for p in ports)
    cmd = [str(bench), "-m", str(gguf), "--rpc", rpc, "-ngl", "99", "-t", str(threads)]
    cmd += ["-p", "0", "-n", str(tokens), "-r", "1", "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=600).stdout
    return float(json.loads(out)[0]["avg_ts"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=64, help="tokens generated per request (default 64)")
    p.add_argument("--rounds", type=int, default=5, help="measured rounds of each side (default 5)")
    p.add_argument("--members", type=int, default=3, help="members / RPC servers (default 3)")
    p.add_argument(
        "--threads", type=int, default=os.cpu_count() or 1, help="compute threads of every process"
    )
    p.add_argument("--llama-bin", type=Path, default=RPC_BIN, help="llama.cpp bin folder built with GGML_RPC")
    args = p.parse_args()
    os.environ[THREADS_ENV] = str(args.threads)  # before the members start (they inherit it)
    from kafila.models.default import DEFAULT_MODELS, locate_gguf

    gguf = locate_gguf(DEFAULT_MODELS["smollm2-135m"])
    server, bench = args.llama_bin / "ggml-rpc-server", args.llama_bin / "llama-bench"
    if not (server.is_file() and bench.is_file()):
        raise SystemExit(
            f"{args.llama_bin}: no ggml-rpc-server and llama-bench "
            "(`python3 benchmarks/llama_build.py --rpc` builds them)"
        )
    why = start_failure([str(bench), "--help"])
    if why is not None:
        raise SystemExit(f"{why}: `python3 benchmarks/llama_build.py --rpc` builds one that starts here")
    load = Load()
    ports = [free_port() for _ in range(args.members)]
    servers = [
        subprocess.Popen(
            [str(server), "-H", "127.0.0.1", "-p", str(port), "-t", str(args.threads)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for port in ports
    ]
    try:
        time.sleep(1.0)  # the servers listen
        with LocalFleet([None] * args.members, context=512, dtype="fp32", quant="q4") as fleet:
            load.watch_fleet(fleet)
            head = fleet.url(fleet.head)
            complete(head, args.tokens)  # warm-up of both sides
            llama_rpc_run(bench, gguf, ports, args.threads, 0, 8)
            theirs = []
            for _ in range(args.rounds):
                complete(head, args.tokens)
                theirs.append(llama_rpc_run(bench, gguf, ports, args.threads, 0, args.tokens))
            ours = [float(r["tokens_per_s"]) for r in wait_records(fleet, args.rounds + 1)[1:]]
            load.sample()
    finally:
        for s in servers:
            s.terminate()
        for s in servers:
            s.wait(timeout=10)

    def line(rates: list[float]) -> str:
        return f"{median(rates):6.2f} tok/s (±{spread(rates):.2f}) {[round(x, 1) for x in rates]}"

    n = args.members
    print(
        f"\nsmollm2-135m q4 ({gguf.name}), {n} members, {args.threads} thread(s) each, {args.tokens} tokens"
    )
    print(f"kafila {n}-member ring decode: {line(ours)}")
    print(f"llama.cpp RPC split ({n} ggml-rpc-server): {line(theirs)}")
    ratio = median(ours) / median(theirs)
    print(f"kafila ring / llama.cpp RPC: {ratio:.2f} (target >= 1.0: {'met' if ratio >= 1 else 'NOT met'})")
    print(load.report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
