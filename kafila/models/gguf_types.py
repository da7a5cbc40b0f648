"""ggml tensor types in a GGUF file and the formats Kafila serves each in (pure numpy, no files).

A GGUF mixes types per tensor. Each tensor is served in its own numbers where the engine's packed
formats (kafila.models.quant: int8, llama.cpp's Q8_0 in another order; q4, its Q4_1) hold them:

- F32, F16, BF16: float entries as stored.
- Q8_0 -> int8 (the same int8 values and float16 scales, bytes copied).
- Q4_1 -> q4 (the 16 nibble bytes and the (d, m) pair of each block copied).
- Q4_0 -> q4 with min = -8 d (float16, exact: a power-of-two multiple of d), or int8 with the
  values q - 8 where the matrix is fused with int8 ones (q, k, v; gate, up).
- Q5_0 -> q5 with min = -16 d (exact, as Q4_0's), its nibbles and high bits copied.
- Q5_1 -> q5 (the 16 nibble bytes, 4 bytes of high bits and (d, m) of each block copied).
- Q4_K -> q4k, Q5_K -> q5k, Q6_K -> q6k: their blocks as stored, the float16 d (and dmin) split
  off into the scales (and mins) entry.

Each kept type dequantizes to the values gguf.quants gives (w = d (q - 8) is computed here as
d q + (-8 d): the same float32 number; only a zero's sign may differ). The other types have no
packed format here of their own: Q3_K and Q2_K (a scale per 16 entries) to q4, each from
gguf.quants' values to the nearest level of its group (an error of at most half the group's
step, plus float16 rounding of the min); the converter measures that error and says it on the
console. A fused product (q, k, v; gate, up) keeps each matrix in its own format (a product of
several formats runs as one stacked product, kafila.models.torch.packed.StackedLinear).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kafila.models.manifest import GROUP, LAYOUTS, SUPER
from kafila.models.quant import Packed, dequantize, from_ggml, quantize

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
BF16 = 30

NAMES = {
    F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
    Q8_0: "Q8_0", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
}  # fmt: skip
FLOATS = {F32: "F32", F16: "F16", BF16: "BF16"}  # ggml type -> safetensors dtype, kept as stored
# packed formats a type is served in, the preferred one first (every quantized type can also be
# requantized to int8)
PACKED: dict[int, tuple[str, ...]] = {
    Q8_0: ("int8",), Q4_1: ("q4",), Q4_0: ("q4", "int8"), Q5_0: ("q5", "int8"), Q4_K: ("q4k", "int8"),
    Q5_1: ("q5", "int8"), Q5_K: ("q5k", "int8"), Q6_K: ("q6k", "int8"), Q3_K: ("q4", "int8"),
    Q2_K: ("q4", "int8"),
}  # fmt: skip
KEPT = {  # values unchanged
    (Q8_0, "int8"), (Q4_1, "q4"), (Q4_0, "q4"), (Q4_0, "int8"), (Q5_0, "int8"), (Q5_0, "q5"),
    (Q5_1, "q5"), (Q4_K, "q4k"), (Q5_K, "q5k"), (Q6_K, "q6k"),
}  # fmt: skip
BLOCK_BYTES = {
    Q4_0: 18,
    Q4_1: 20,
    Q5_0: 22,
    Q5_1: 24,
    Q8_0: 34,
}  # bytes per block of 32 of the repacked types
REQUANT_ROWS = 1024  # rows widened and requantized at once (the float temporaries stay a few MB)


class UnsupportedType(ValueError):
    """A tensor of a ggml type Kafila does not read (named, with the types it reads)."""


def type_name(ggml_type: int) -> str:
    return NAMES.get(ggml_type, f"ggml type {ggml_type}")


def check_readable(ggml_type: int, tensor: str) -> None:
    if ggml_type not in NAMES:
        try:
            import gguf

            name = gguf.GGMLQuantizationType(ggml_type).name
        except (ImportError, ValueError):
            name = f"ggml type {ggml_type}"
        raise UnsupportedType(
            f"GGUF tensor {tensor} is {name}: Kafila reads {', '.join(NAMES.values())} tensors"
        )


@dataclass
class Requantized:
    """What requantizing a tensor changed: the squared errors and values summed, the largest error
    and the largest in steps of its group (at most a half, plus float16 rounding of a min)."""

    count: int = 0
    error_sq: float = 0.0
    value_sq: float = 0.0
    worst: float = 0.0
    worst_steps: float = 0.0

    def add(self, other: Requantized) -> None:
        self.count += other.count
        self.error_sq += other.error_sq
        self.value_sq += other.value_sq
        self.worst = max(self.worst, other.worst)
        self.worst_steps = max(self.worst_steps, other.worst_steps)

    @property
    def relative_rms(self) -> float:
        """The error's RMS over the values' RMS."""
        return float(np.sqrt(self.error_sq / self.value_sq)) if self.value_sq > 0 else 0.0


def how(ggml_type: int, fmt: str) -> str:
    """ "kept" (values unchanged) or "requantized": how a tensor of `ggml_type` is served in packed
    format `fmt`."""
    return "kept" if (ggml_type, fmt) in KEPT else "requantized"


def serve(
    raw: np.ndarray, ggml_type: int, shape: tuple[int, int], fmt: str, measure: bool = True
) -> tuple[Packed, Requantized | None]:
    """A matrix [out, in] of `ggml_type` (its blocks, uint8 [out, row bytes]) in packed format `fmt`,
    and what requantizing it changed (None where its levels are kept, or not `measure`d)."""
    if ggml_type not in PACKED or fmt not in (*PACKED[ggml_type], "int8"):
        raise ValueError(f"{type_name(ggml_type)} is not served as {fmt}")
    if how(ggml_type, fmt) != "requantized":
        return repack(raw, ggml_type, shape, fmt), None
    packed, stats = requantize(raw, ggml_type, shape, fmt, measure)
    return packed, stats if measure else None


def requantize(
    raw: np.ndarray, ggml_type: int, shape: tuple[int, int], fmt: str, measure: bool = True
) -> tuple[Packed, Requantized]:
    """gguf.quants' values of a matrix quantized to `fmt`'s nearest levels, `REQUANT_ROWS` rows at
    a time, with the error measured against those values (with `measure`; else none is counted).
    Each row's levels depend on that row's values alone, so any rows requantize as they do in the
    whole matrix."""
    out, cols = shape
    rows = np.asarray(raw, dtype=np.uint8).reshape(out, -1)
    int8 = fmt == "int8"
    data = np.empty((out, cols if int8 else cols // 2), np.int8 if int8 else np.uint8)
    scales = np.empty((out, cols // GROUP), np.float16)
    mins = None if int8 else np.empty((out, cols // GROUP), np.float16)
    stats = Requantized()
    for a in range(0, out, REQUANT_ROWS):
        w = widen(rows[a : a + REQUANT_ROWS], ggml_type, (min(REQUANT_ROWS, out - a), cols))
        part = quantize(w, fmt)
        b = a + w.shape[0]
        data[a:b], scales[a:b] = part.data, part.scales
        if mins is not None and part.mins is not None:
            mins[a:b] = part.mins
        if measure:
            stats.add(_error(w, part))
    return Packed(fmt, data, scales, mins), stats


def _error(w: np.ndarray, p: Packed) -> Requantized:
    err = (dequantize(p) - w).astype(np.float64)
    out, cols = w.shape
    steps = np.abs(err).reshape(out, cols // GROUP, GROUP).max(axis=2)
    scale = p.scales.astype(np.float64)
    per_step = np.divide(steps, scale, out=np.zeros_like(steps), where=scale > 0)
    return Requantized(
        count=w.size,
        error_sq=float((err**2).sum()),
        value_sq=float((w.astype(np.float64) ** 2).sum()),
        worst=float(np.abs(err).max(initial=0.0)),
        worst_steps=float(per_step.max(initial=0.0)),
    )


def repack(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], fmt: str) -> Packed:
    """The blocks (uint8 [out, blocks * block bytes]) of a matrix [out, in] of `ggml_type` in packed
    format `fmt` where its values are kept (KEPT)."""
    if how(ggml_type, fmt) == "requantized":
        raise ValueError(f"{type_name(ggml_type)} is not served as {fmt} without requantizing")
    if ggml_type in (Q4_K, Q5_K, Q6_K):
        return _super_blocks(raw, ggml_type, shape)
    if ggml_type in (Q8_0, Q4_1):
        return from_ggml(raw, ggml_type, shape)
    out, cols = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(out, cols // GROUP, BLOCK_BYTES[ggml_type])
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(out, -1)  # [out, groups]
    if ggml_type == Q4_0:
        nibbles = blocks[..., 2:]  # [out, groups, 16]: element j low, element 16 + j high
        if fmt == "q4":
            mins = (d * np.float16(-8)).astype(np.float16)
            if not np.isfinite(mins).all():
                raise ValueError(f"a Q4_0 scale in [{out}, {cols}] is too large for an exact q4 minimum")
            return Packed("q4", np.ascontiguousarray(nibbles).reshape(out, cols // 2), d, mins)
        levels = np.concatenate([nibbles & 15, nibbles >> 4], axis=2).astype(np.int8) - np.int8(8)
        return Packed("int8", levels.reshape(out, cols), d)
    # Q5_0: d, 4 bytes of high bits (bit j of element j), 16 nibble bytes as Q4_0; Q5_1: d, m, then the same
    high, nibbles = (
        (blocks[..., 2:6], blocks[..., 6:]) if ggml_type == Q5_0 else (blocks[..., 4:8], blocks[..., 8:])
    )
    if fmt == "q5":
        if ggml_type == Q5_0:
            mins = (d * np.float16(-16)).astype(np.float16)
        else:
            mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(out, -1)
        if not np.isfinite(mins).all():
            kind = type_name(ggml_type)
            raise ValueError(f"a {kind} scale in [{out}, {cols}] is too large for a q5 minimum")
        data = np.ascontiguousarray(nibbles).reshape(out, cols // 2)
        return Packed("q5", data, d, mins, np.ascontiguousarray(high).reshape(out, cols // 8))
    bits = ((np.ascontiguousarray(high).view("<u4") >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(
        np.uint8
    )
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=2)  # [out, groups, 32]
    levels = (low | (bits << 4)).astype(np.int8) - np.int8(16)
    return Packed("int8", levels.reshape(out, cols), d)


def _super_blocks(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> Packed:
    """A Q4_K, Q5_K or Q6_K matrix as q4k, q5k or q6k: each block's bytes as they are, its float16
    d (and dmin) apart: Q6_K's d is its last two bytes, Q4_K's and Q5_K's d and dmin its first four."""
    out, cols = shape
    name = type_name(ggml_type)
    if cols % SUPER:
        raise ValueError(f"a {name} matrix [{out}, {cols}] has rows that are not a multiple of {SUPER}")
    fmt = PACKED[ggml_type][0]
    size = LAYOUTS[fmt].scale_bytes()  # a block: the format's data bytes, d (and dmin)
    blocks = np.asarray(raw, dtype=np.uint8).reshape(out, cols // SUPER, size)

    def halves(a: int) -> np.ndarray:  # the float16 at bytes a, a + 1 of each block: [out, n]
        return np.ascontiguousarray(blocks[..., a : a + 2]).view(np.float16).reshape(out, -1)

    if ggml_type == Q6_K:
        data = np.ascontiguousarray(blocks[..., : size - 2]).reshape(out, -1)  # [out, n * 208]
        return Packed(fmt, data, halves(size - 2))
    data = np.ascontiguousarray(blocks[..., 4:]).reshape(out, -1)  # [out, n * (140 | 172)]
    return Packed(fmt, data, halves(0), halves(2))


def widen(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """A tensor's values as float32 (gguf.quants' dequantization; F32 as stored)."""
    import gguf

    data = np.asarray(raw, dtype=np.uint8)
    if ggml_type == F32:
        return data.view(np.float32).reshape(shape)
    values = gguf.quants.dequantize(data, gguf.GGMLQuantizationType(ggml_type))
    return np.asarray(values, dtype=np.float32).reshape(shape)


def float_entry(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """An F32/F16/BF16 tensor's stored values as numpy (BF16 as its uint16 bits)."""
    kind = {F32: np.float32, F16: np.float16, BF16: np.uint16}[ggml_type]
    return np.asarray(raw, dtype=np.uint8).view(kind).reshape(shape)


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation. Rows of a [n_head * d, hidden] weight are stored per
    head as (d/2, 2) interleaved pairs; Hugging Face's rotate-half wants (2, d/2)."""
    rows = w.shape[0]
    # [n_head, d/2, 2, hidden] -> [n_head, 2, d/2, hidden] -> [rows, hidden]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def group_formats(types: list[int]) -> list[str] | None:
    """The packed formats the matrices of a fused product (q, k, v; gate, up) of these types are
    served in: each its own (PACKED's first; a product of several formats is a stacked one), or
    None where one is a float type (then the group is widened to F32 together)."""
    if not all(t in PACKED for t in types):
        return None
    return [PACKED[t][0] for t in types]
