"""The packed weight formats in numpy: quantize, dequantize, repack llama.cpp blocks (no widening).

Formats (kafila.models.manifest: `packed_bytes`, the policy of which matrix takes which):

- int8: `data` int8 [out, in], `scales` float16 [out, in/32]; w = scale * q, q in [-127, 127]
  (llama.cpp's Q8_0, the same numbers in another order).
- q4: `data` uint8 [out, in/2], `scales` and `mins` float16 [out, in/32]; w = scale * q + min,
  q in [0, 15]. In group g of a row, byte j (0-15) holds element 32 g + j in its low nibble and
  element 32 g + 16 + j in its high nibble: llama.cpp's Q4_1 block, whose 16 bytes are copied.
- q6k (a GGUF's Q6_K, as stored): `data` uint8 [out, in/256 * 208], `scales` float16 [out, in/256]
  (the super-block's d); w = d * sc * (q - 32), q in [0, 63], sc int8 per 16 inputs. In each
  super-block's 208 bytes: ql[128] (low 4 bits), qh[64] (high 2 bits), sc[16]; group g of 32
  (g < 8) takes its low bits from ql[64 (g // 4) + 32 (g % 2) + j] (the high nibble for g % 4 >= 2)
  and its high bits from bits 2 (g % 4) of qh[32 (g // 4) + j], j < 32; inputs 32 g .. 32 g + 15
  have scale sc[2 g], the next 16 sc[2 g + 1]: llama.cpp's layout (`dequantize_row_q6_K`).
- q5 (a GGUF's Q5_0, Q5_1): q4's `data`, `scales` and `mins` and `high` uint8 [out, in/8], the
  fifth bit of each level (group g's 4 bytes at 4 g: bit j % 8 of byte j / 8 is entry j's, as
  Q5_1's `qh`); w = scale * (q + 16 h) + min, levels in [0, 31].
- q4k (a GGUF's Q4_K, as stored): `data` uint8 [out, in/256 * 140], `scales` and `mins` float16
  [out, in/256] (the super-block's d and dmin); w = d * sc[s] * q - dmin * m[s] for q in [0, 15]
  in sub-block s (0-7) of 32 inputs, sc and m 6-bit. In each super-block's 140 bytes: the 12 bytes
  of sc and m (`scale_min_k4`), then 4 chunks of 32: byte j of chunk c holds entry 64 c + j (of
  sub-block 2 c) in its low nibble and entry 64 c + 32 + j (sub-block 2 c + 1) in its high one:
  llama.cpp's layout (`dequantize_row_q4_K`).
- q5k (a GGUF's Q5_K, as stored): q4k with 172 bytes a super-block, 32 bytes of fifth bits after
  the 12 (bit s of byte j is entry 32 s + j's), then the 128 of nibbles; levels in [0, 31].

Packed rows are independent, so a fused matrix (q, k, v rows) is its parts' rows stacked, and a row
permutation (llama.cpp's q/k order) permutes the packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kafila.models.manifest import (
    GROUP,
    HIGH,
    LAYOUTS,
    MINS,
    PACKED_DTYPES,
    Q6K_BYTES,
    SCALES,
    SUPER,
    entries_format,
    matrix_shape,
    packed_bytes,
)

# ggml block types Kafila repacks: type id -> (our format, bytes per block of 32)
GGML_Q8_0, GGML_Q4_1 = 8, 3
_GGML_BLOCKS = {GGML_Q8_0: ("int8", 34), GGML_Q4_1: ("q4", 20)}


@dataclass(frozen=True)
class Packed:
    """A matrix [out, in] in a packed format (numpy arrays, see the module docstring)."""

    fmt: str  # "int8" | "q4" | "q5" | "q6k" | "q4k" | "q5k"
    data: np.ndarray  # int8 [out, in] | uint8 [out, in/2] | uint8 [out, in/256 * bytes]
    scales: np.ndarray  # float16 [out, in/32] (K-quants: [out, in/256])
    mins: np.ndarray | None = None  # float16 like scales (q4, q5, q4k, q5k)
    high: np.ndarray | None = None  # uint8 [out, in/8] (q5)

    @property
    def shape(self) -> tuple[int, int]:
        return matrix_shape(self.fmt, self.data.shape)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.data, self.scales, self.mins, self.high) if a is not None)

    def entries(self, name: str) -> dict[str, np.ndarray]:
        """Safetensors entries for a matrix named `name` (ending in "weight")."""
        base = name.removesuffix("weight")
        out = {name: self.data, base + SCALES: self.scales}
        if self.mins is not None:
            out[base + MINS] = self.mins
        if self.high is not None:
            out[base + HIGH] = self.high
        return out

    def rows(self, index: np.ndarray | slice) -> Packed:
        """The packed rows `index` (a permutation, a slice)."""

        def part(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.ascontiguousarray(a[index])

        return Packed(
            self.fmt,
            np.ascontiguousarray(self.data[index]),
            np.ascontiguousarray(self.scales[index]),
            part(self.mins),
            part(self.high),
        )


def stacked(parts: list[Packed]) -> Packed:
    """Packed matrices of one format stacked by rows (packed rows are independent)."""

    def cat(arrays: list[np.ndarray | None]) -> np.ndarray | None:
        return None if arrays[0] is None else np.concatenate([a for a in arrays if a is not None])

    return Packed(
        parts[0].fmt,
        np.concatenate([p.data for p in parts]),
        np.concatenate([p.scales for p in parts]),
        cat([p.mins for p in parts]),
        cat([p.high for p in parts]),
    )


def format_of(
    data: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, high: np.ndarray | None = None
) -> str:
    """The packed format of stored entries: `data`'s dtype, its bytes per scale and which siblings
    are there."""
    kind = "U8" if data.dtype == np.uint8 else "I8"
    return entries_format(kind, data.shape[-1], scales.shape[-1], mins is not None, high is not None)


CHUNK_ROWS = 2048  # rows quantized at once: the float temporaries stay a few MB for any matrix


def quantize(w: np.ndarray, fmt: str) -> Packed:
    """A float matrix [out, in] (in divisible by 32) in format `fmt`, each value to the nearest
    level of its group; `w` may also be bfloat16 held as its uint16 bits (as safetensors and
    torch store it), widened exactly. The scale is rounded to float16 first and the values
    quantized with it, so dequantize(quantize(w)) is within half a (float16) step of w. Done
    `CHUNK_ROWS` rows at a time straight into the packed arrays, so a large matrix (an embedding:
    1.24 GB in bf16 at Qwen3-8B's widths) never has a float32 copy made whole."""
    out, cols = w.shape
    packed_bytes(fmt, out, cols)  # checks the format and the group size
    if out <= CHUNK_ROWS:
        return _quantize_rows(_floats(w), fmt)
    int8 = fmt == "int8"
    data = np.empty((out, cols if int8 else cols // 2), np.int8 if int8 else np.uint8)
    scales = np.empty((out, cols // GROUP), np.float16)
    mins = None if int8 else np.empty((out, cols // GROUP), np.float16)
    for a in range(0, out, CHUNK_ROWS):
        part = _quantize_rows(_floats(w[a : a + CHUNK_ROWS]), fmt)
        b = a + part.data.shape[0]
        data[a:b], scales[a:b] = part.data, part.scales
        if mins is not None and part.mins is not None:
            mins[a:b] = part.mins
    return Packed(fmt, data, scales, mins)


def _floats(w: np.ndarray) -> np.ndarray:
    """`w` as floats: bfloat16 bits (uint16) widened exactly to float32, other arrays as they are."""
    if w.dtype == np.uint16:
        return (w.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return w


def _quantize_rows(w: np.ndarray, fmt: str) -> Packed:
    out, cols = w.shape
    g = w.astype(np.float32).reshape(out, cols // GROUP, GROUP)  # [out, groups, 32]
    if fmt == "int8":
        scale = (np.abs(g).max(axis=2) / 127).astype(np.float16)  # [out, groups]
        s32 = scale.astype(np.float32)[..., None]
        q = np.where(s32 > 0, np.rint(g / np.where(s32 > 0, s32, 1)), 0)
        data = np.clip(q, -127, 127).astype(np.int8).reshape(out, cols)
        return Packed("int8", data, scale)
    lo, hi = g.min(axis=2), g.max(axis=2)  # [out, groups]
    mins = lo.astype(np.float16)
    scale = ((hi - mins.astype(np.float32)) / 15).astype(np.float16)
    s32, m32 = scale.astype(np.float32)[..., None], mins.astype(np.float32)[..., None]
    q = np.where(s32 > 0, np.rint((g - m32) / np.where(s32 > 0, s32, 1)), 0)
    q = np.clip(q, 0, 15).astype(np.uint8)  # [out, groups, 32]
    data = (q[..., :16] | (q[..., 16:] << 4)).reshape(out, cols // 2)
    return Packed("q4", data, scale, mins)


def levels(p: Packed) -> np.ndarray:
    """The quantized integers [out, in] (int8: -127..127, q4 and q4k: 0..15, q5 and q5k: 0..31,
    q6k: q - 32 in -32..31) as int16."""
    if p.fmt == "int8":
        return p.data.astype(np.int16)
    if p.fmt == "q6k":
        return _q6k_levels(p.data).astype(np.int16)
    if p.fmt in ("q4k", "q5k"):
        return _k_levels(p.data, p.fmt).astype(np.int16)
    out, half = p.data.shape
    b = p.data.reshape(out, half // 16, 16)
    q = np.concatenate([b & 15, b >> 4], axis=2).reshape(out, half * 2).astype(np.int16)
    if p.fmt == "q5" and p.high is not None:
        q += 16 * np.unpackbits(p.high, axis=1, bitorder="little").astype(np.int16)
    return q


def dequantize(p: Packed) -> np.ndarray:
    """The float32 matrix [out, in] the packed one stands for (each value scale * q (+ min),
    computed in float32: the reference every kernel is tested against)."""
    out, cols = p.shape
    if p.fmt == "q6k":
        return _q6k_dequantize(p)
    if p.fmt in ("q4k", "q5k"):
        scale, low = k_scales(p)  # [out, in/32] each
        q = levels(p).astype(np.float32).reshape(out, cols // GROUP, GROUP)
        return (scale[..., None] * q - low[..., None]).reshape(out, cols)
    q = levels(p).astype(np.float32).reshape(out, cols // GROUP, GROUP)
    w = q * p.scales.astype(np.float32)[..., None]
    if p.mins is not None:
        w = w + p.mins.astype(np.float32)[..., None]
    return w.reshape(out, cols)


def _q6k_levels(data: np.ndarray) -> np.ndarray:
    """q - 32 (int8 [out, in]) of q6k `data` (see the module docstring for the layout)."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, Q6K_BYTES)  # [out, n, 208]
    n = blocks.shape[1]
    nibble = np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)
    two = np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 1, 4, 1)
    low = ((blocks[..., :128].reshape(out, n, 2, 1, 64) >> nibble) & 15).reshape(out, n, 8, 32)
    high = ((blocks[..., 128:192].reshape(out, n, 2, 1, 32) >> two) & 3).reshape(out, n, 8, 32)
    return ((low | (high << 4)).astype(np.int8) - np.int8(32)).reshape(out, n * SUPER)


def _q6k_dequantize(p: Packed) -> np.ndarray:
    """d * sc * (q - 32) in float32 (d * sc first: exact, an 11-bit by 8-bit product), as gguf.quants."""
    out, cols = p.shape
    sc = p.data.reshape(out, -1, Q6K_BYTES)[..., 192:].view(np.int8).astype(np.float32)  # [out, n, 16]
    scale = p.scales.astype(np.float32)[..., None] * sc  # [out, n, 16]
    q = _q6k_levels(p.data).astype(np.float32).reshape(out, -1, 16, 16)  # [out, n, 16, 16]
    return (scale[..., None] * q).reshape(out, cols)


def scale_min_k4(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums of Q4_K/Q5_K's 12 bytes [..., 12] (uint8 [..., 8] each):
    bytes 0-3 hold scales 0-3 (and the high bits of 4-7), 4-7 minimums 0-3 (and theirs), 8-11 the
    low bits of scales and minimums 4-7 (llama.cpp's `get_scale_min_k4`)."""
    s, m, low = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([s & 63, (low & 15) | ((s >> 2) & 48)], axis=-1)
    mn = np.concatenate([m & 63, (low >> 4) | ((m >> 2) & 48)], axis=-1)
    return sc, mn


def k_scales(p: Packed) -> tuple[np.ndarray, np.ndarray]:
    """A q4k/q5k matrix's per-group scale d * sc and minimum dmin * m (float32 [out, in/32] each,
    exact: an 11-bit by 6-bit product); w = scale * q - minimum."""
    out = p.data.shape[0]
    blocks = p.data.reshape(out, -1, LAYOUTS[p.fmt].data_bytes)  # [out, n, bytes]
    sc, m = scale_min_k4(blocks[..., :12])  # [out, n, 8] each
    assert p.mins is not None, "a K-quant matrix has minimums"
    d, dmin = p.scales.astype(np.float32)[..., None], p.mins.astype(np.float32)[..., None]
    return (d * sc).reshape(out, -1), (dmin * m).reshape(out, -1)


def _k_levels(data: np.ndarray, fmt: str) -> np.ndarray:
    """The levels (uint8 [out, in]) of q4k or q5k `data` (see the module docstring)."""
    out = data.shape[0]
    blocks = data.reshape(out, -1, LAYOUTS[fmt].data_bytes)  # [out, n, bytes]
    n = blocks.shape[1]
    chunks = blocks[..., -128:].reshape(out, n, 4, 1, 32)  # [out, n, 4 chunks, 1, 32]
    q = (chunks >> np.array([0, 4], np.uint8).reshape(1, 1, 1, 2, 1)) & 15  # [out, n, 4, 2, 32]
    q = q.reshape(out, n, 8, 32)  # sub-block 2 c + h
    if fmt == "q5k":
        bits = (blocks[..., None, 12:44] >> np.arange(8, dtype=np.uint8).reshape(1, 1, 8, 1)) & 1
        q = q | (bits << 4)  # [out, n, 8, 32]
    return q.reshape(out, n * SUPER)


def from_ggml(raw: np.ndarray, ggml_type: int, shape: tuple[int, int]) -> Packed:
    """llama.cpp blocks (uint8 [out, blocks * block bytes]) of a Q8_0 or Q4_1 matrix [out, in]
    repacked: the same numbers, bytes copied, nothing widened."""
    if ggml_type not in _GGML_BLOCKS:
        raise ValueError(f"ggml type {ggml_type} is not repacked (Q8_0 = 8 and Q4_1 = 3 are)")
    fmt, size = _GGML_BLOCKS[ggml_type]
    out, cols = shape
    blocks = np.asarray(raw, dtype=np.uint8).reshape(out, cols // GROUP, size)
    scales = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).reshape(out, -1)
    if fmt == "int8":
        values = np.ascontiguousarray(blocks[..., 2:]).view(np.int8).reshape(out, cols)
        return Packed("int8", values, scales)
    mins = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16).reshape(out, -1)
    nibbles = np.ascontiguousarray(blocks[..., 4:]).reshape(out, cols // 2)
    return Packed("q4", nibbles, scales, mins)


def from_entries(
    fmt: str, data: np.ndarray, scales: np.ndarray, mins: np.ndarray | None, high: np.ndarray | None = None
) -> Packed:
    """A Packed from a checkpoint's entries, checked: the names' dtypes and shapes must agree."""
    want = PACKED_DTYPES[fmt]
    kind = {"I8": np.int8, "U8": np.uint8}[want]
    if data.dtype != kind or data.ndim != 2 or scales.dtype != np.float16:
        raise ValueError(
            f"{fmt} matrix: data {data.dtype}{list(data.shape)}, scales {scales.dtype}: not {want} + F16"
        )
    layout = LAYOUTS[fmt]
    if data.shape[1] % layout.data_bytes:
        raise ValueError(
            f"{fmt} matrix: data {list(data.shape)} is not in blocks of {layout.data_bytes} bytes"
        )
    if layout.mins and (mins is None or mins.dtype != np.float16):
        raise ValueError(f"{fmt} matrix: mins {None if mins is None else mins.dtype}, want float16")
    p = Packed(fmt, data, scales, mins, high)
    out, cols = p.shape
    if fmt == "q5" and (high is None or high.dtype != np.uint8 or high.shape != (out, cols // 8)):
        got = None if high is None else f"{high.dtype}{list(high.shape)}"
        raise ValueError(f"q5 matrix [{out}, {cols}]: high {got}, want uint8 [{out}, {cols // 8}]")
    per = layout.per
    if scales.shape != (out, cols // per) or (mins is not None and mins.shape != scales.shape):
        raise ValueError(
            f"{fmt} matrix [{out}, {cols}]: scales {list(scales.shape)}, want [{out}, {cols // per}]"
        )
    return p
