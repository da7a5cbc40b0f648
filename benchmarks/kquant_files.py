"""Real-shape GGUF files whose matrices are K-quants, for `benchmarks/engine.py --gguf` and
`benchmarks/perplexity.py --gguf` against llama.cpp on the same file.

    python3 benchmarks/kquant_files.py [--types Q4_K_M,Q8_0] [--layers 28]

Writes a Qwen3 of Qwen3-0.6B's widths (tests/qwen3_real.py's QWEN3_06B: hidden 1024, 16 query and 8
KV heads of 128, MLP 3072, the 151,936-token vocabulary; the head untied, as in Qwen3-4B and up)
with `--layers` blocks (28, as Qwen3-0.6B) and the real Qwen3 tokenizer's metadata, its weights
drawn seeded (tests/gguf_files.py: std 2/sqrt(fan_in) in the blocks) and stored as F16, then has
llama.cpp's `llama-quantize` (benchmarks/llama_build.py builds it) make each type of `--types`
from it. Every row is a multiple of 256, so llama-quantize puts the K-quants themselves in a
Q4_K_M file (Q4_K, with Q6_K for the head and half the v and down matrices), not the 32-wide
fallbacks it takes for the default model's 576-wide rows. Files are made once, into
~/.cache/kafila/llama.cpp/kquant/, and their paths printed, one per line.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from llama_build import BIN, CACHE
from realsize import tokenizer_dir

from tests.gguf_files import Shape, qwen3_tokenizer_meta, write_gguf

MATRICES = (
    "token_embd",
    "output",
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
)


def shape(layers: int) -> Shape:
    """Qwen3-0.6B's widths (tests/qwen3_real.py's QWEN3_06B) with `layers` blocks."""
    return Shape(
        arch="qwen3", hidden=1024, layers=layers, heads=16, kv_heads=8, head_dim=128, ffn=3072, context=40960
    )


def f16_file(folder: Path, layers: int) -> Path:
    path = folder / f"qwen3-0.6b-shape-{layers}L.F16.gguf"
    if not path.is_file():
        print(f"writing {path} (F16, {layers} blocks)", file=sys.stderr, flush=True)
        part = path.with_suffix(".part")
        meta = qwen3_tokenizer_meta(tokenizer_dir())
        write_gguf(part, shape(layers), meta, dict.fromkeys(MATRICES, "F16"), tied=False)
        part.rename(path)
    return path


def quantized(source: Path, kind: str, quantize: Path) -> Path:
    path = source.with_name(source.name.replace(".F16.", f".{kind}."))
    if not path.is_file():
        if not quantize.is_file():
            sys.exit(f"{quantize} is not built: run python3 benchmarks/llama_build.py first")
        print(f"llama-quantize {source.name} -> {kind}", file=sys.stderr, flush=True)
        part = path.with_suffix(".part")
        subprocess.run([str(quantize), str(source), str(part), kind], check=True, capture_output=True)
        part.rename(path)
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--types", default="Q4_K_M,Q8_0", help="llama-quantize types, comma-separated")
    p.add_argument("--layers", type=int, default=28, help="transformer blocks (Qwen3-0.6B has 28)")
    p.add_argument("--llama-quantize", type=Path, default=BIN / "llama-quantize")
    args = p.parse_args()
    folder = CACHE / "kquant"
    folder.mkdir(parents=True, exist_ok=True)
    source = f16_file(folder, args.layers)
    for kind in args.types.split(","):
        print(quantized(source, kind, args.llama_quantize))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
