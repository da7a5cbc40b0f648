"""A packed weight matrix (int8, q4; kafila.models.quant) as torch tensors, and its product.

On the CPU with numba, products of up to `KERNEL_ROWS` rows run quant_cpu's kernel (each packed
byte read once per call for every row, decoded in registers); larger products, and every product
on other devices (CUDA), dequantize `TILE_ROWS` output rows at a time into the compute dtype and
multiply them with torch's matmul, so no more than a tile is ever held wide.

Shapes: N rows, out/in features, groups = in / 32.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kafila.models import quant
from kafila.models.manifest import GROUP

Tensor = torch.Tensor

# Rows a product may have and still take quant_cpu's kernel (bits independent of the other rows);
# past it the dequantized tiles and torch's matmul take it. The same as llama.FUSED_PREFILL_ROWS, so
# every step the scheduler forms (`LlamaModel.batch_rows`) stays on the kernel.
KERNEL_ROWS = 128
TILE_ROWS = 1024  # output rows dequantized at once on the torch path


@dataclass
class PackedLinear:
    """y = x W^T + b for W [out, in] packed: `data` int8 [out, in] or uint8 [out, in/2], `scales`
    (and for q4 `mins`) float16 [out, groups]."""

    fmt: str
    data: Tensor
    scales: Tensor
    mins: Tensor | None = None
    bias: Tensor | None = None  # [out], compute dtype
    # the CPU kernel rounds x to int8 groups and multiplies integers (quant_cpu.INT_DOT); q4
    # matrices do by default, int8 ones keep x in floats unless set (a q4 session's int8 head)
    round_x: bool | None = None

    @classmethod
    def from_packed(cls, p: quant.Packed, device: torch.device) -> PackedLinear:
        mins = None if p.mins is None else torch.from_numpy(p.mins).to(device)
        return cls(p.fmt, torch.from_numpy(p.data).to(device), torch.from_numpy(p.scales).to(device), mins)

    @classmethod
    def stack(cls, parts: list[PackedLinear]) -> PackedLinear:
        """Parts' rows stacked (q, k, v into one wqkv): packed rows are independent."""
        if len(parts) == 1:
            return parts[0]
        fmts = {p.fmt for p in parts}
        if len(fmts) != 1:
            raise ValueError(f"cannot stack matrices of formats {sorted(fmts)}")
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts if p.mins is not None])
        return cls(
            parts[0].fmt,
            torch.cat([p.data for p in parts]),
            torch.cat([p.scales for p in parts]),
            mins,
        )

    @property
    def shape(self) -> tuple[int, int]:
        return quant.matrix_shape(self.fmt, tuple(self.data.shape))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.data, self.scales, self.mins) if t is not None)

    def arrays(self) -> tuple[np.ndarray, ...]:
        """numpy views for quant_cpu: (data, scale bits) or (data, scale bits, min bits)."""

        def bits(t: Tensor) -> np.ndarray:
            return t.view(torch.int16).numpy().view(np.uint16)

        parts = [self.data.numpy(), bits(self.scales)]
        if self.mins is not None:
            parts.append(bits(self.mins))
        return tuple(parts)

    def dequantized(self, rows: Tensor | slice, dtype: torch.dtype) -> Tensor:
        """Rows `rows` of W in `dtype` ([R, in]), computed in float32 as quant.dequantize does."""
        data, scales = self.data[rows], self.scales[rows].float()  # [R, in or in/2], [R, groups]
        r = data.shape[0]
        if self.fmt == "q4":
            b = data.view(r, -1, GROUP // 2)  # [R, groups, 16]
            q = torch.cat([b & 15, b >> 4], dim=2).float()  # [R, groups, 32]
        else:
            q = data.view(r, -1, GROUP).float()
        w = q * scales[..., None]
        if self.mins is not None:
            w += self.mins[rows].float()[..., None]
        return w.view(r, -1).to(dtype)

    def __call__(self, x: Tensor) -> Tensor:  # [N, in] -> [N, out]
        if self._kernel_takes(x):
            from kafila.models.torch import quant_cpu  # numba loads only where its kernels run

            y = torch.empty((x.shape[0], self.shape[0]), dtype=torch.float32)  # [N, out]
            rounded = self.fmt == "q4" if self.round_x is None else self.round_x
            kernel = quant_cpu.rounded_product if rounded and quant_cpu.INT_DOT else quant_cpu.float_product
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
        from kafila.models.torch.llama import kernels_available

        return x.device.type == "cpu" and x.shape[0] <= KERNEL_ROWS and kernels_available()

    def embedding(self, ids: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows `ids` [N] of W as an embedding table would give them ([N, in] in `dtype`)."""
        return self.dequantized(ids, dtype)
