"""Writing a converted GGUF's `model.safetensors`: its index (kafila.models.gguf_inplace), which
stands for the file and makes its bytes from the GGUF when they are read, or the file itself.

Both make every tensor once, whole, from the GGUF by its `Recipe` (the index to hash it, the copy
to write it), measuring what requantizing changed for the converter's console lines.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from kafila.models import gguf_types as types
from kafila.models.gguf_inplace import INDEX_VERSION, Recipe, entry_bytes
from kafila.models.quantize import Entry, header_text, write_safetensors
from kafila.models.weight_file import SourceChanged, file_stamp, inplace_index


def _raw(file: Path, r: Recipe) -> np.ndarray:
    """A tensor's stored bytes, memory-mapped (the mapping lives as long as the array)."""
    return np.memmap(file, dtype=np.uint8, mode="r", offset=r.start, shape=(r.nbytes,))


def _whole(file: Path, recipes: list[Recipe]) -> Iterator[tuple[Recipe, dict[str, np.ndarray], Any]]:
    """Each recipe's entries made whole, with its requantization error measured, in file order."""
    for r in sorted(recipes, key=lambda r: r.start):
        parts, error = r.make(_raw(file, r), 0, r.n_rows, measure=r.requantized)
        yield r, parts, error


def write_index(
    out: Path, file: Path, recipes: list[Recipe], progress: bool = True, desc: str = "reading"
) -> dict[str, types.Requantized | None]:
    """Write the index of `out` (a safetensors file made from GGUF `file` by `recipes`): every
    tensor made once to hash it. Returns each recipe's requantization error (None if kept)."""
    from tqdm import tqdm

    st = os.stat(file)
    text, placed = header_text([s for r in recipes for s in r.specs()])
    base = 8 + len(text.encode())
    spans = {spec.name: (spec, base + a, base + b) for spec, a, b in placed}
    digests: dict[str, str] = {}
    errors: dict[str, types.Requantized | None] = {}
    total = sum(b - a for _, a, b in placed)
    bar = tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, disable=not progress)
    with bar:
        for r, parts, error in _whole(file, recipes):
            errors[r.name] = error
            for spec in r.specs():
                data = entry_bytes(spec, parts[spec.name], r.n_rows)
                digests[spec.name] = hashlib.sha256(data).hexdigest()
                bar.update(len(data))
    if file_stamp(os.stat(file)) != file_stamp(st):
        raise SourceChanged(f"{file} changed while it was converted: convert it again")
    which = {s.name: i for i, r in enumerate(recipes) for s in r.specs()}
    index = {
        "version": INDEX_VERSION,
        "gguf": str(file),
        "stamp": file_stamp(st),
        "header": text,
        "recipes": [r.to_json() for r in recipes],
        "tensors": [[n, a, b, digests[n], which[n]] for n, (_, a, b) in sorted(spans.items())],
    }
    inplace_index(out).write_text(json.dumps(index, separators=(",", ":")) + "\n", encoding="utf-8")
    return errors


def write_copy(
    out: Path, file: Path, recipes: list[Recipe], progress: bool = True, desc: str = "reading"
) -> dict[str, types.Requantized | None]:
    """Write the safetensors file itself (the copy the index stands for), as write_index's."""
    errors: dict[str, types.Requantized | None] = {}
    pending: dict[str, np.ndarray] = {}

    def getter(r: Recipe, name: str) -> Callable[[], np.ndarray]:
        def get() -> np.ndarray:
            if name not in pending:  # written in name order: a recipe's entries are adjacent
                parts, errors[r.name] = r.make(_raw(file, r), 0, r.n_rows, measure=r.requantized)
                pending.update(parts)
            return pending.pop(name)

        return get

    entries: list[Entry] = [(s, getter(r, s.name)) for r in recipes for s in r.specs()]
    write_safetensors(out, entries, progress, desc=desc)
    return errors
