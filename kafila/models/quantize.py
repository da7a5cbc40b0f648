"""Packed checkpoints on disk: `kafila models --quantize FORMAT` and the default GGUF's own blocks.

A packed folder is an ordinary Hugging Face folder whose matrices are stored as their packed
entries (kafila.models.manifest: `X.weight` I8/U8, `X.scales` F16, for q4 `X.mins` F16), every other
tensor as it was, and config.json's `quantization_config` naming the format. Each entry is a plain
safetensors tensor, so a member fetching blocks by range (kafila.session.weights, Checkpoint.read)
reads exactly its blocks' packed bytes, and the manifest from the headers is exact.
"""

from __future__ import annotations

import json
import shutil
import struct
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kafila.models import quant
from kafila.models.manifest import (
    DTYPE_BYTES,
    GROUP,
    NP_DTYPES,
    QUANT_FORMATS,
    TensorSpec,
    linear_format,
    packed_specs,
)

QUANT_CONFIG = "quantization_config"

Entry = tuple[TensorSpec, Callable[[], np.ndarray]]  # a tensor's header and how to make its bytes


def packed_entries(
    name: str, fmt: str, shape: tuple[int, ...], make: Callable[[], quant.Packed]
) -> list[Entry]:
    """Entries for a matrix whose packed form `make` computes (once, on the first entry's read)."""
    made: dict[str, np.ndarray] = {}

    def part(entry: str) -> Callable[[], np.ndarray]:
        def get() -> np.ndarray:
            if not made:
                made.update(make().entries(name))
            return made.pop(entry)

        return get

    return [(spec, part(spec.name)) for spec in packed_specs(name, fmt, shape)]


def header_text(specs: list[TensorSpec]) -> tuple[str, list[tuple[TensorSpec, int, int]]]:
    """The safetensors header JSON of `specs` in name order (space-padded so the data starts
    8-byte aligned, as safetensors writes it) and each spec's data offsets, in that order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    placed = []
    offset = 0
    for spec in sorted(specs, key=lambda s: s.name):
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes()],
        }
        placed.append((spec, offset, offset + spec.nbytes()))
        offset += spec.nbytes()
    raw = json.dumps(header, separators=(",", ":"))
    return raw + " " * (-len(raw) % 8), placed


def write_safetensors(file: Path, entries: list[Entry], progress: bool = True, desc: str = "writing") -> int:
    """Write `entries` (sorted by name, as safetensors writes them) one at a time: the header from
    their specs, then each one's bytes, checked against its spec. Returns the data bytes."""
    from tqdm import tqdm

    entries = sorted(entries, key=lambda e: e[0].name)
    text, placed = header_text([spec for spec, _ in entries])
    raw = text.encode()
    offset = placed[-1][2] if placed else 0
    bar = tqdm(total=offset, unit="B", unit_scale=True, desc=desc, file=sys.stderr, disable=not progress)
    with open(file, "wb") as f, bar:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for spec, make in entries:
            a = np.ascontiguousarray(make(), dtype=NP_DTYPES[spec.dtype])
            if a.shape != spec.shape or a.nbytes != spec.numel * DTYPE_BYTES[spec.dtype]:
                raise ValueError(
                    f"{spec.name}: made {a.dtype}{list(a.shape)}, header says {spec.dtype}{list(spec.shape)}"
                )
            f.write(a.tobytes())  # one tensor at a time: at most one copy
            bar.update(a.nbytes)
    return offset


def quantize_folder(src: Path, fmt: str, out: Path, progress: bool = True) -> Path:
    """Write a packed copy of the model folder `src` in `fmt` to `out` (a new folder): its matrices
    packed as kafila.models.manifest's policy says (already packed ones kept), other tensors and
    every non-weight file copied. Written to `out` + ".partial" and renamed when whole."""
    from kafila.models.checkpoint import Checkpoint

    if fmt not in QUANT_FORMATS or fmt == "none":
        raise ValueError(f"--quantize takes int8 or q4, not {fmt!r}")
    ckpt = Checkpoint.open(src, complete=True)
    if out.exists():
        raise ValueError(f"{out} already exists: remove it or name another folder")
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    entries: list[Entry] = []
    for name, info in ckpt.tensors.items():
        target = linear_format(name, fmt)
        if target == "none" or len(info.shape) != 2 or not info.dtype.startswith(("F", "BF")):
            entries.append((info.spec, _raw_reader(ckpt, name)))
            continue
        entries += packed_entries(name, target, info.shape, _quantizer(ckpt, name, target))
    write_safetensors(tmp / "model.safetensors", entries, progress, desc=f"quantizing to {fmt}")
    for item in src.iterdir():  # config, tokenizer, generation config, templates: not the weights
        if item.is_file() and not _weights_file(item.name):
            shutil.copy2(item, tmp / item.name)
    config = json.loads((tmp / "config.json").read_text())
    config[QUANT_CONFIG] = {"quant_method": "kafila", "format": fmt, "group_size": GROUP}
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tmp.rename(out)
    return out


def _weights_file(name: str) -> bool:
    """A file of the source's weights: one or sharded safetensors (the hub's
    model-00001-of-00004.safetensors) and their index, which the packed copy replaces."""
    return name.endswith(".safetensors") or name.startswith("model.safetensors")


def _raw_reader(ckpt: Any, name: str) -> Callable[[], np.ndarray]:
    def read() -> np.ndarray:
        info, data = ckpt.read([name])[name]
        return np.frombuffer(data, dtype=NP_DTYPES[info.dtype]).reshape(info.shape)

    return read


def _quantizer(ckpt: Any, name: str, fmt: str) -> Callable[[], quant.Packed]:
    def make() -> quant.Packed:
        info, data = ckpt.read([name])[name]
        # bf16 as its bits, widened chunk by chunk inside quantize: no whole float32 copy
        w = np.frombuffer(data, dtype=NP_DTYPES[info.dtype]).reshape(info.shape)
        return quant.quantize(w if info.dtype in ("BF16", "F32") else w.astype(np.float32), fmt)

    return make
