"""`kafila models`: list the models available here (default models, folders in the cache and the
Ollama store's models)."""

from __future__ import annotations

import argparse
import json
import sys


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--json",
        action="store_true",
        help="print one JSON object per model (name, architecture, blocks, size_bytes, path, converted) "
        "instead of a table",
    )
    parser.add_argument(
        "--convert",
        metavar="NAME",
        help="convert this default model now (normally done on first use) and then list",
    )
    parser.add_argument(
        "--quantize",
        metavar="FORMAT",
        choices=["int8", "q4"],
        help="write a packed copy of --model in FORMAT (int8 or q4; docs/weights.md) to --out, then list",
    )
    parser.add_argument(
        "--model",
        default="smollm2-135m",
        help="the model --quantize packs: a default model's name, a Hugging Face folder or a .gguf file",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="the folder --quantize writes (default: the model cache, NAME-FORMAT)",
    )


def main(args: argparse.Namespace) -> int:
    from kafila.models.default import DEFAULT_MODELS, DefaultModelUnavailable, ensure_default
    from kafila.models.registry import available, models_dir

    if args.convert is not None:  # "" too: an empty name is refused, not taken as no --convert
        if args.convert not in DEFAULT_MODELS:
            print(
                f"kafila models: {args.convert!r} is not a default model ({', '.join(DEFAULT_MODELS)})",
                file=sys.stderr,
            )
            return 2
        try:
            ensure_default(args.convert)
        except DefaultModelUnavailable as exc:
            print(f"kafila models: {exc}", file=sys.stderr)
            return 1
    if args.quantize is not None:
        code = _quantize(args)
        if code:
            return code
    entries = available()
    if args.json:
        for e in entries:
            row = {
                "name": e.name,
                "architecture": e.architecture,
                "blocks": e.blocks,
                "size_bytes": e.size_bytes,
                "path": str(e.path),
                "converted": e.converted,
            }
            print(json.dumps(row))
        return 0
    rows = [("NAME", "ARCH", "BLOCKS", "SIZE", "CONVERTED", "PATH")]
    for e in entries:
        converted = "yes" if e.converted else "on first use"
        rows.append((e.name, e.architecture, str(e.blocks), _size(e.size_bytes), converted, str(e.path)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=False)) + "  " + r[-1])
    print(f"\ncache: {models_dir()}  (--model takes a name above, a Hugging Face folder or a .gguf file)")
    return 0


def _quantize(args: argparse.Namespace) -> int:
    from pathlib import Path

    from kafila.models.checkpoint import CheckpointError
    from kafila.models.default import DefaultModelUnavailable
    from kafila.models.quantize import quantize_folder
    from kafila.models.registry import ModelNotFound, models_dir, resolve

    try:
        src = resolve(args.model)
        out = Path(args.out).expanduser() if args.out else models_dir() / f"{src.name}-{args.quantize}"
        written = quantize_folder(src, args.quantize, out)
    except (ValueError, CheckpointError, ModelNotFound, DefaultModelUnavailable, OSError) as exc:
        print(f"kafila models: --quantize: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {written} ({args.quantize})", file=sys.stderr)
    return 0


def _size(n: int) -> str:
    if n <= 0:
        return "?"
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000  # type: ignore[assignment]
    return f"{n} B"
