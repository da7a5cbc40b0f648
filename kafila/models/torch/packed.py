"""A packed weight matrix (kafila.models.quant's formats) as torch tensors, and its product.

On the CPU with numba, products of up to `KERNEL_ROWS` rows run quant_cpu's kernel (each packed
byte read once per call for every row, decoded in registers); on CUDA, q4 products run torch's
weight-only int4 matmul (`_weight_int4pack_mm`, the weights repacked once into its layout); the
rest (larger CPU products, int8 on CUDA: torch's `_weight_int8pack_mm` takes one scale per output
row, not Q8_0's per group of 32) dequantize `TILE_ROWS` output rows at a time into the compute
dtype and multiply them with torch's matmul, so no more than a tile is ever held wide.

Shapes: N rows, out/in features, groups = in / 32.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from kafila.models import quant
from kafila.models.manifest import GROUP, LAYOUTS, Q6K_BYTES, SUPER, entries_format, matrix_shape

Tensor = torch.Tensor

# Rows a product may have and still take quant_cpu's kernel (bits independent of the other rows);
# past it the dequantized tiles and torch's matmul take it. The same as llama.FUSED_PREFILL_ROWS, so
# every step the scheduler forms (`LlamaModel.batch_rows`) stays on the kernel.
KERNEL_ROWS = 128
TILE_ROWS = 1024  # output rows dequantized at once on the torch path
INT4_INNER_K_TILES = 2  # torch's int4 layout parameter (2, 4 or 8): `in` must divide by 16 times it


@functools.cache
def kernels_available() -> bool:
    """Whether numba is installed (it comes with the `torch` extra); without it the torch ops run."""
    return importlib.util.find_spec("numba") is not None


@dataclass
class PackedLinear:
    """y = x W^T + b for W [out, in] packed: `data` int8 [out, in] or uint8 [out, in/2], `scales`
    (and for q4 and q5 `mins`) float16 [out, groups], for q5 `high` uint8 [out, in/8]; the K-quants:
    `data` uint8 [out, in/256 * bytes], `scales` (and for q4k and q5k `mins`) float16 [out, in/256]."""

    fmt: str
    data: Tensor
    scales: Tensor
    mins: Tensor | None = None
    bias: Tensor | None = None  # [out], compute dtype
    high: Tensor | None = None  # q5's fifth bits, uint8 [out, in/8]
    # the CPU kernel rounds x to int8 groups for this matrix whatever its format (quant_cpu.INT_DOT;
    # the head: LlamaModel); else as `decode_cpu.block_step` does (quant_cpu.prepare)
    round_x: bool = False
    _int4: tuple[str, Tensor, Tensor] | None = field(default=None, repr=False, compare=False)

    @classmethod
    def from_packed(cls, p: quant.Packed, device: torch.device) -> PackedLinear:
        def tensor(a: np.ndarray | None) -> Tensor | None:
            return None if a is None else torch.from_numpy(a).to(device)

        data, scales = torch.from_numpy(p.data).to(device), torch.from_numpy(p.scales).to(device)
        return cls(p.fmt, data, scales, tensor(p.mins), high=tensor(p.high))

    @classmethod
    def of_entries(
        cls, data: Tensor, scales: Tensor, mins: Tensor | None, high: Tensor | None = None
    ) -> PackedLinear:
        """A checkpoint's stored entries, in the format they are (manifest.entries_format)."""
        kind = "U8" if data.dtype == torch.uint8 else "I8"
        fmt = entries_format(kind, data.shape[-1], scales.shape[-1], mins is not None, high is not None)
        return cls(fmt, data, scales, mins, high=high)

    @classmethod
    def stack(cls, parts: list[PackedLinear]) -> PackedLinear | StackedLinear:
        """Parts' rows stacked (q, k, v into one wqkv): packed rows are independent. Parts of one
        format become one matrix; a GGUF's fused product of several (Q4_K q and k beside a Q6_K
        v) a StackedLinear of each run of one format, in order."""
        runs: list[list[PackedLinear]] = []
        for p in parts:
            if runs and runs[-1][0].fmt == p.fmt:
                runs[-1].append(p)
            else:
                runs.append([p])
        if len(runs) > 1:
            return StackedLinear([cls.stack(run) for run in runs])  # type: ignore[misc]
        if len(parts) == 1:
            return parts[0]

        def cat(ts: list[Tensor | None]) -> Tensor | None:
            return None if ts[0] is None else torch.cat([t for t in ts if t is not None])

        return cls(
            parts[0].fmt,
            torch.cat([p.data for p in parts]),
            torch.cat([p.scales for p in parts]),
            cat([p.mins for p in parts]),
            high=cat([p.high for p in parts]),
        )

    @property
    def shape(self) -> tuple[int, int]:
        return matrix_shape(self.fmt, tuple(self.data.shape))

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scales, self.mins, self.high)
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """numpy views for quant_cpu: (data, scale bits), (data, scale bits, min bits), or for q5
        (data, scale bits, min bits, high); a K-quant's (q6k, q4k, q5k) data as [out, in/256,
        bytes] (its dimensions tell the kernels from int8's and q4's)."""

        def bits(t: Tensor) -> np.ndarray:
            return t.view(torch.int16).numpy().view(np.uint16)

        data = self.data.numpy()
        if LAYOUTS[self.fmt].per == SUPER:
            data = data.reshape(data.shape[0], -1, LAYOUTS[self.fmt].data_bytes)
        parts = [data, bits(self.scales)]
        if self.mins is not None:
            parts.append(bits(self.mins))
        if self.high is not None:
            parts.append(self.high.numpy())
        return tuple(parts)

    def dequantized(self, rows: Tensor | slice, dtype: torch.dtype) -> Tensor:
        """Rows `rows` of W in `dtype` ([R, in]), computed in float32 as quant.dequantize does."""
        data, scales = self.data[rows], self.scales[rows].float()  # [R, in or in/2], [R, groups]
        r = data.shape[0]
        if self.fmt == "q6k":
            return _q6k_rows(data, scales).to(dtype)
        if self.fmt in ("q4k", "q5k"):
            assert self.mins is not None, "a K-quant matrix has minimums"
            return _k_rows(data, scales, self.mins[rows].float(), self.fmt).to(dtype)
        if self.fmt in ("q4", "q5"):
            b = data.view(r, -1, GROUP // 2)  # [R, groups, 16]
            q = torch.cat([b & 15, b >> 4], dim=2).float()  # [R, groups, 32]
            if self.high is not None:  # q5: bit j % 8 of byte j / 8 is entry j's fifth
                at = torch.arange(8, dtype=torch.uint8, device=data.device)
                h = (self.high[rows][..., None] >> at) & 1  # [R, in/8, 8]
                q += 16 * h.view(r, -1, GROUP).float()
        else:
            q = data.view(r, -1, GROUP).float()
        w = q * scales[..., None]
        if self.mins is not None:
            w += self.mins[rows].float()[..., None]
        return w.view(r, -1).to(dtype)

    def int4pack(self, device_type: str) -> tuple[Tensor, Tensor]:
        """This q4 matrix in torch's weight-only int4 layout (made once per device type):
        (the packed levels from `_convert_weight_to_int4pack` on CUDA, `..._for_cpu` on the CPU;
        scales_and_zeros [groups, out, 2]). torch dequantizes (q - 8) scale + zero, so a Q4_1
        group's (d, m) becomes (d, m + 8 d): the same weights."""
        if self._int4 is None or self._int4[0] != device_type:
            r = self.data.shape[0]
            b = self.data.view(r, -1, GROUP // 2)  # [out, groups, 16]
            q = torch.cat([b & 15, b >> 4], dim=2).reshape(r, -1).to(torch.int32)  # [out, in] levels
            d, m = self.scales.float(), self.mins.float() if self.mins is not None else self.scales.float()
            zeros = torch.stack([d, m + 8 * d], dim=2).transpose(0, 1).contiguous()  # [groups, out, 2]
            if device_type == "cuda":  # two levels a byte, the even element in the high nibble
                pairs = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)  # [out, in/2]
                w = torch.ops.aten._convert_weight_to_int4pack(pairs, INT4_INNER_K_TILES)
                zeros = zeros.to(torch.bfloat16)
            else:
                w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES)
            self._int4 = (device_type, w, zeros)
        return self._int4[1], self._int4[2]

    def int4_product(self, x: Tensor) -> Tensor:
        """y [N, out] = x [N, in] W^T by torch's weight-only int4 matmul (CUDA: bfloat16 inputs and
        outputs, as its kernel takes them; the CPU variant in x's dtype), in x's dtype."""
        w, zeros = self.int4pack(x.device.type)
        if x.device.type == "cuda":
            y = torch.ops.aten._weight_int4pack_mm(x.bfloat16().contiguous(), w, GROUP, zeros)
        else:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), w, GROUP, zeros.to(x.dtype))
        return y.to(x.dtype)

    def _int4_takes(self, x: Tensor) -> bool:
        """torch's int4 matmul takes q4 products on CUDA where its shapes allow (out a multiple of
        8, in of 16 x INT4_INNER_K_TILES)."""
        out, k = self.shape
        return (
            self.fmt == "q4"
            and x.device.type == "cuda"
            and out % 8 == 0
            and k % (16 * INT4_INNER_K_TILES) == 0
        )

    def __call__(self, x: Tensor) -> Tensor:  # [N, in] -> [N, out]
        if self._int4_takes(x):
            y = self.int4_product(x)
        elif self._kernel_takes(x):
            from kafila.models.torch import quant_cpu  # numba loads only where its kernels run

            y = torch.empty((x.shape[0], self.shape[0]), dtype=torch.float32)  # [N, out]
            kernel = quant_cpu.rounded_product if self.round_x and quant_cpu.INT_DOT else quant_cpu.product
            kernel(x.float().contiguous().numpy(), self.arrays(), y.numpy())
            y = y.to(x.dtype)
        else:
            out = self.shape[0]
            y = torch.cat(
                [
                    F.linear(x, self.dequantized(slice(a, min(a + TILE_ROWS, out)), x.dtype))
                    for a in range(0, out, TILE_ROWS)
                ],
                dim=1,
            )
        return y if self.bias is None else y.add_(self.bias)

    def _kernel_takes(self, x: Tensor) -> bool:
        return x.device.type == "cpu" and x.shape[0] <= KERNEL_ROWS and kernels_available()

    def embedding(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids` [N] of W as an embedding table would give them ([N, in] in `dtype`)."""
        return self.dequantized(ids, dtype)


def _q6k_rows(data: Tensor, d: Tensor) -> Tensor:
    """q6k rows as float32 [R, in] from `data` uint8 [R, n * 208] and `d` float32 [R, n]: d * sc *
    (q - 32), as quant.dequantize computes them (kafila.models.quant has the layout)."""
    r = data.shape[0]
    blocks = data.view(r, -1, Q6K_BYTES)  # [R, n, 208]
    n = blocks.shape[1]
    nib = torch.tensor([0, 4], dtype=torch.uint8, device=data.device).view(1, 1, 1, 2, 1)
    ql = (blocks[..., :128].reshape(r, n, 2, 1, 64) >> nib) & 15  # [R, n, 2, 2, 64]
    two = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=data.device).view(1, 1, 1, 4, 1)
    qh = (blocks[..., 128:192].reshape(r, n, 2, 1, 32) >> two) & 3  # [R, n, 2, 4, 32]
    q = (ql.reshape(r, n, 8, 32) | (qh.reshape(r, n, 8, 32) << 4)).float() - 32  # [R, n, 8, 32]
    sc = blocks[..., 192:].contiguous().view(torch.int8).float()  # [R, n, 16]
    scale = d[..., None] * sc  # [R, n, 16]: exact
    return (scale[..., None] * q.reshape(r, n, 16, 16)).reshape(r, n * 256)


def _k_rows(data: Tensor, d: Tensor, dmin: Tensor, fmt: str) -> Tensor:
    """q4k/q5k rows as float32 [R, in] from `data` uint8 [R, n * bytes], `d` and `dmin` float32
    [R, n]: d sc q - dmin m per sub-block of 32, as quant.dequantize computes them."""
    r = data.shape[0]
    blocks = data.view(r, -1, LAYOUTS[fmt].data_bytes)  # [R, n, bytes]
    n = blocks.shape[1]
    s, m, low = (blocks[..., a : a + 4] for a in (0, 4, 8))  # [R, n, 4] each
    sc = torch.cat([s & 63, (low & 15) | ((s >> 2) & 48)], dim=-1).float()  # [R, n, 8]
    mn = torch.cat([m & 63, (low >> 4) | ((m >> 2) & 48)], dim=-1).float()
    nib = torch.tensor([0, 4], dtype=torch.uint8, device=data.device).view(1, 1, 1, 2, 1)
    q = (blocks[..., -128:].reshape(r, n, 4, 1, 32) >> nib) & 15  # [R, n, 4, 2, 32]
    q = q.reshape(r, n, 8, 32)
    if fmt == "q5k":  # bit s of byte j: entry 32 s + j's fifth
        at = torch.arange(8, dtype=torch.uint8, device=data.device).view(1, 1, 8, 1)
        q = q | (((blocks[..., None, 12:44] >> at) & 1) << 4)
    scale, minimum = d[..., None] * sc, dmin[..., None] * mn  # [R, n, 8]: exact
    return (scale[..., None] * q.float() - minimum[..., None]).reshape(r, n * 256)


@dataclass
class StackedLinear:
    """y = x W^T + b for W the rows of `parts` (packed matrices of different formats) stacked in
    order: a fused product whose matrices a GGUF holds in types of different formats, each kept in
    its own. Each part runs its own product (on the CPU kernel each is its own tasks of one call,
    decode_cpu and quant_cpu taking the parts' tuples); the outputs are concatenated."""

    parts: list[PackedLinear]
    bias: Tensor | None = None  # [out], compute dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def arrays(self) -> tuple[tuple[np.ndarray, ...], ...]:
        """Each part's arrays (quant_cpu takes a tuple of packed tuples as one stacked weight)."""
        return tuple(p.arrays() for p in self.parts)

    def __call__(self, x: Tensor) -> Tensor:  # [N, in] -> [N, out]
        y = torch.cat([p(x) for p in self.parts], dim=1)
        return y if self.bias is None else y.add_(self.bias)
