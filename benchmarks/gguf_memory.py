"""The memory a GGUF file is served in: its bytes on disk against the bytes Kafila holds for it.

    python3 benchmarks/gguf_memory.py FILE.gguf [--context 256] [--runs 3]

Converts FILE (kafila.models.gguf_convert, into the model cache) and prints, as JSON: the file's
bytes by ggml type, the converted checkpoint's bytes by served format (the planner prices these:
kafila.models.manifest), their ratio to the file's, and, per run in a fresh process, the resident
bytes a one-stage model of every block and the head adds when loaded (`Stage.load`, torch backend,
the file's packed formats) with its KV for `--context` positions: the second of two loads in one
process (the first pays for imports and compiled kernels), the median and range over runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from collections import Counter
from pathlib import Path

_CHILD = """
import json, resource, sys
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint

def rss():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmRSS:"))

def load():
    ckpt = Checkpoint.open(sys.argv[1])
    blocks, context = range(ckpt.n_blocks), int(sys.argv[2])
    return Stage.load(ckpt, blocks, True, backend="torch", dtype="fp32", context=context)

first = load()  # imports, kernels compiled, caches made: the second load adds the model alone
before = rss()
second = load()
print(json.dumps({"loaded_bytes": rss() - before}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("file", type=Path)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    from kafila.models import gguf_types as types
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.default import GGUFFile
    from kafila.models.gguf_convert import ensure_gguf

    gf = GGUFFile.open(args.file)
    by_type: Counter[str] = Counter()
    for t in gf.tensors:
        by_type[types.type_name(t.ggml_type)] += t.nbytes
    folder = ensure_gguf(args.file, progress=False)
    ckpt = Checkpoint.open(folder, complete=True)
    by_dtype: Counter[str] = Counter()
    for info in ckpt.tensors.values():
        by_dtype[info.dtype] += info.nbytes
    file_bytes, served = args.file.stat().st_size, sum(by_dtype.values())
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    loaded = []
    for _ in range(args.runs):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(folder), str(args.context)],
            check=True, capture_output=True, text=True, env=env,
        )  # fmt: skip
        loaded.append(json.loads(out.stdout.strip().splitlines()[-1])["loaded_bytes"])
    kv = ckpt.manifest().kv_bytes(args.context, 1, ckpt.n_blocks)
    report = {
        "file": str(args.file),
        "file_bytes": file_bytes,
        "tensor_bytes_by_type": dict(by_type),
        "served_bytes": served,
        "served_bytes_by_dtype": dict(by_dtype),
        "served_over_file": round(served / file_bytes, 3),
        "kv_bytes": kv,
        "loaded_bytes_median": statistics.median(loaded),
        "loaded_bytes_range": [min(loaded), max(loaded)],
        "loaded_over_file": round(statistics.median(loaded) / file_bytes, 3),
        "load_average": os.getloadavg(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
