"""Perplexity of a GGUF file as Kafila serves it against llama.cpp's `llama-perplexity` on the same
file and text, with llama.cpp's protocol on both sides.

    python3 benchmarks/perplexity.py --gguf FILE [--text FILE] [--context 64] [--threads N]

The protocol (llama.cpp's tools/perplexity, its default, no stride): the text tokenized once with
the vocabulary's special tokens (a BOS first where the file says add_bos), cut into chunks of
`--context` tokens (whole chunks only; at least two); in each chunk the first token is replaced by
BOS where the vocabulary adds one, every position is computed, and the negative log-likelihood of
each token of the chunk's second half is counted (the token after position p, for p from
context/2 to context - 2). Perplexity is exp of their mean. Kafila computes each chunk as one
prefill (one forward over the chunk, the logits of every position: a prefill that long computes
with its weights' values dequantized in tiles); `--rows 32` also feeds each chunk as decode-sized
steps, through the packed products that round their input. It reads the text with its own
tokenizer, built from the file's metadata (the same ids as llama.cpp's is part of what is
compared; Kafila's token count is printed).

`--exact` also scores the file's exact values in each program (Kafila: a float32 model of
gguf.quants' values; llama.cpp: the file requantized to F32 by llama-quantize), which tells a
difference in the values served from one in the products' rounding.

Target: Kafila's perplexity within 1% of llama.cpp's. llama-perplexity is built by
`python3 benchmarks/llama_build.py` (`--llama-perplexity` to name another); without it, Kafila's
figure is printed alone.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
from llama_build import BIN

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "tests" / "data" / "perplexity.txt"
LLAMA_PERPLEXITY = BIN / "llama-perplexity"
FINAL = re.compile(r"Final estimate: PPL = ([\d.]+) \+/- ([\d.]+)")


def chunk_nll(logits: np.ndarray, ids: list[int], first: int) -> list[float]:
    """The negative log-likelihoods llama.cpp counts in one chunk: the token at p + 1 under the
    logits [n_ctx, V] of position p, for p in [first, n_ctx - 2]."""
    out = []
    for p in range(first, len(ids) - 1):
        row = logits[p].astype(np.float64)  # [V]
        top = float(row.max())
        log_z = top + math.log(float(np.exp(row - top).sum()))
        out.append(log_z - float(row[ids[p + 1]]))
    return out


def kafila_perplexity(
    file: Path, text: str, n_ctx: int, rows: int | None = None, folder: Path | None = None
) -> tuple[float, int]:
    """(perplexity, tokens in the text) of `file` served as `--model FILE` serves it, each chunk
    one prefill, or `rows` positions at a time (as few as a decode step's: the packed products
    that round their input, which a long prefill's dequantized tiles do not); or of the model in
    `folder` (the file's exact values as float32: `--exact`)."""
    from kafila.engine.stage import Stage
    from kafila.engine.tokenizer import Tokenizer
    from kafila.models.checkpoint import Checkpoint
    from kafila.models.registry import resolve

    ckpt = Checkpoint.open(folder or resolve(str(file)))
    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, backend="torch", dtype="fp32", context=n_ctx)
    tok = Tokenizer.from_checkpoint(ckpt)
    tokens = tok.encode(text, add_special_tokens=True)
    bos_id = tok.backend.token_to_id(tok.bos_token) if tok.bos_token else None
    bos = bos_id if tokens and tokens[0] == bos_id else None  # the vocabulary adds one
    n_chunk = len(tokens) // n_ctx
    if n_chunk < 2:
        raise SystemExit(f"the text tokenizes to {len(tokens)} tokens: fewer than 2 chunks of {n_ctx}")
    nll: list[float] = []
    for i in range(n_chunk):
        ids = tokens[i * n_ctx : (i + 1) * n_ctx]
        fed = [bos, *ids[1:]] if bos is not None else ids
        step = rows or n_ctx
        stage.open("ppl")
        parts = []
        for a in range(0, n_ctx, step):
            [h] = stage.forward([("ppl", a, stage.embed(fed[a : a + step]))])
            parts.append(np.asarray(stage.logits(h)))  # [step, V]
        stage.close("ppl")
        logits = np.concatenate(parts)  # [n_ctx, V]
        nll += chunk_nll(logits, ids, n_ctx // 2)
    return math.exp(sum(nll) / len(nll)), len(tokens)


def llama_perplexity(
    binary: Path, file: Path, text_file: Path, n_ctx: int, threads: int
) -> tuple[float, float]:
    """llama-perplexity's final estimate and its error on the same file and text."""
    argv = [str(binary), "-m", str(file), "-f", str(text_file), "-c", str(n_ctx), "-b", str(n_ctx)]
    argv += ["-t", str(threads), "--no-warmup"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, check=False)
    found = FINAL.search(done.stdout + done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"llama-perplexity exited {done.returncode}: {(done.stdout + done.stderr)[-1500:]}")
    return float(found.group(1)), float(found.group(2))


def llama_on_f32(args: argparse.Namespace) -> tuple[float, float]:
    """llama-perplexity on the file requantized to F32 by llama-quantize (the file's values, exact)."""
    import tempfile

    quantize = args.llama_perplexity.parent / "llama-quantize"
    with tempfile.TemporaryDirectory(prefix="llama-f32-") as tmp:
        f32 = Path(tmp) / "f32.gguf"
        done = subprocess.run([str(quantize), "--allow-requantize", str(args.gguf), str(f32), "F32", "1"],
                              capture_output=True, text=True, timeout=1800, check=False)  # fmt: skip
        if done.returncode != 0:
            raise SystemExit(f"llama-quantize to F32 exited {done.returncode}: {done.stderr[-1500:]}")
        return llama_perplexity(args.llama_perplexity, f32, args.text, args.context, args.threads)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, type=Path, help="the GGUF file both programs read")
    p.add_argument("--text", type=Path, default=TEXT, help=f"the text (default {TEXT.relative_to(ROOT)})")
    p.add_argument("--context", type=int, default=64, help="tokens per chunk (llama-perplexity -c)")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="llama.cpp's threads")
    p.add_argument("--llama-perplexity", type=Path, default=LLAMA_PERPLEXITY)
    p.add_argument(
        "--rows",
        type=int,
        help="also Kafila with each chunk fed this many positions at a time (32: the packed products a "
        "decode step takes, which round their input, where one prefill's dequantized tiles do not)",
    )
    p.add_argument(
        "--exact",
        action="store_true",
        help="also Kafila on the file's exact values (every tensor dequantized by gguf.quants into a "
        "float32 model, float products), and llama.cpp on the file requantized to F32: what the "
        "file's values score without either program's rounding",
    )
    args = p.parse_args()
    if not args.gguf.is_file():
        raise SystemExit(f"--gguf {args.gguf}: no such file")
    if args.context < 4 or args.context % 2:
        raise SystemExit(f"--context {args.context}: an even number of tokens, at least 4")
    from kafila.obs.log import configure_logging

    configure_logging(level="warning")
    ours, n_tokens = kafila_perplexity(args.gguf, args.text.read_text(), args.context)
    print(f"{args.gguf.name} on {args.text.name} ({n_tokens} tokens, chunks of {args.context})")
    print(f"  kafila     perplexity {ours:.4f} (each chunk one prefill)")
    if args.rows:
        stepped, _ = kafila_perplexity(args.gguf, args.text.read_text(), args.context, args.rows)
        print(f"  kafila     perplexity {stepped:.4f} ({args.rows} positions at a time)")
    if args.exact:
        import tempfile

        from kafila.models.gguf_convert import float_folder

        with tempfile.TemporaryDirectory(prefix="kafila-exact-") as tmp:
            exact_model = float_folder(args.gguf, Path(tmp))
            exact, _ = kafila_perplexity(args.gguf, args.text.read_text(), args.context, folder=exact_model)
        print(f"  kafila     perplexity {exact:.4f} (the file's exact values as float32, float products)")
    if not args.llama_perplexity.is_file():
        print(f"  llama.cpp  not run ({args.llama_perplexity} is missing: python3 benchmarks/llama_build.py)")
        return 0
    theirs, err = llama_perplexity(args.llama_perplexity, args.gguf, args.text, args.context, args.threads)
    ratio = ours / theirs
    print(f"  llama.cpp  perplexity {theirs:.4f} +/- {err:.4f}")
    if args.exact:
        widened, _ = llama_on_f32(args)
        print(f"  llama.cpp  perplexity {widened:.4f} (the file requantized to F32 by llama-quantize: "
              "its exact values, float products)")  # fmt: skip
        print(f"  kafila / llama.cpp on the exact values {exact / widened:.4f}; each served against its "
              f"own exact run: kafila {ours / exact:.4f}, llama.cpp {theirs / widened:.4f}")  # fmt: skip
    print(f"  kafila / llama.cpp {ratio:.4f} (target within 1%: {'yes' if abs(ratio - 1) <= 0.01 else 'no'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
