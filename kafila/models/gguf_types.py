"""ggml tensor types in a GGUF file and the formats Kafila serves each in (pure numpy, no files).

A GGUF mixes types per tensor. Each tensor is served in its own numbers:

- F32, F16, BF16: float entries as stored.
- Q8_0 -> int8 (kafila.models.quant: the same int8 values and float16 scales, bytes copied).
- Q4_1 -> q4 (the 16 nibble bytes and the (d, m) pair of each block copied).
- Q4_0 -> q4 with min = -8 d (float16, exact: a power-of-two multiple of d), or int8 with the
  values q - 8 where the matrix is fused with int8 ones (q, k, v; gate, up).
- Q5_0 -> int8 with the values q - 16 (-16..15) and the block's d as the scale.

Each of these dequantizes to the values gguf.quants gives (w = d (q - 8) is computed here as
d q + (-8 d): the same float32 number; only a zero's sign may differ). The other types Kafila reads
(Q5_1, Q2_K..Q6_K) have no packed format here yet: they are widened to F32 with gguf.quants (the
same values, 4 bytes each), and the converter says so on the console (`WIDENED`).
"""

from __future__ import annotations

import numpy as np

from kafila.models.manifest import GROUP
from kafila.models.quant import Packed, from_ggml

F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 10, 11, 12, 13, 14
BF16 = 30

NAMES = {
    F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
    Q8_0: "Q8_0", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K",
}  # fmt: skip
FLOATS = {F32: "F32", F16: "F16", BF16: "BF16"}  # ggml type -> safetensors dtype, kept as stored
# packed formats a type is served in with its values unchanged, the preferred one first
PACKED: dict[int, tuple[str, ...]] = {Q8_0: ("int8",), Q4_1: ("q4",), Q4_0: ("q4", "int8"), Q5_0: ("int8",)}
WIDENED = (Q5_1, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K)  # read, served as F32 (no packed format yet)
BLOCK_BYTES = {Q4_0: 18, Q4_1: 20, Q5_0: 22, Q8_0: 34}  # bytes per block of 32 of the repacked types


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


def repack(raw: np.ndarray, ggml_type: int, shape: tuple[int, int], fmt: str) -> Packed:
    """The blocks (uint8 [out, blocks * block bytes]) of a matrix [out, in] of `ggml_type` in packed
    format `fmt` (one of PACKED[ggml_type]), values unchanged."""
    if fmt not in PACKED.get(ggml_type, ()):
        raise ValueError(f"{type_name(ggml_type)} is not served as {fmt}")
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
    # Q5_0: d, 4 bytes of high bits (bit j of element j), 16 nibble bytes as Q4_0
    high = np.ascontiguousarray(blocks[..., 2:6]).view("<u4")  # [out, groups, 1]
    bits = ((high >> np.arange(GROUP, dtype=np.uint32)) & 1).astype(np.uint8)  # [out, groups, 32]
    nibbles = blocks[..., 6:]
    low = np.concatenate([nibbles & 15, nibbles >> 4], axis=2)  # [out, groups, 32]
    levels = (low | (bits << 4)).astype(np.int8) - np.int8(16)
    return Packed("int8", levels.reshape(out, cols), d)


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


def group_format(types: list[int]) -> str | None:
    """The one packed format every matrix of a fused product (q, k, v; gate, up) of these types is
    served in with its values unchanged, or None (then the group is widened to F32 together: a
    fused product holds one format)."""
    options = [PACKED.get(t, ()) for t in types]
    if not all(options):
        return None
    common = [f for f in options[0] if all(f in o for o in options)]
    return common[0] if common else None
