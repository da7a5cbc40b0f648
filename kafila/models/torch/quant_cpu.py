"""Few-row products with packed weights (int8, q4) on the CPU, compiled by numba.

`tile(x, w, y, t)` computes output rows [t * QTILE, (t + 1) * QTILE) of y = x W^T for x [N, in]
float32, reading each packed weight byte once per call for all N rows: four weight rows at a time,
each group of 32 weights is decoded into float32 vectors (scale * q (+ min), in registers) and
multiplied into the first pass's rows' accumulators (`_fused_dot`); later passes, for batches of
more rows, read the decoded rows back from L1. `w` is a tuple of numpy arrays (PackedLinear.arrays):
(data int8 [out, in], scales) for int8 or (data uint8 [out, in/2], scales, mins) for q4, scales
and minimums as float16 bits (uint16), widened exactly as they are read. A float weight (float32
array, or bf16 bits) goes to few_rows.product_tile, so `decode_cpu.block_step` takes any format
through these generic `tiles`/`tile`/`rows_of`/`cols_of`.

Each row accumulates in 16 lanes (lane l: inputs l, l + 16 of every group, in group order), then
adds its lanes in one fixed tree: a row's bits depend on nothing but its own input, never on the
other rows of the call or the pass that computed it (tests/models/test_quant.py).

Measured on one thread of this loaded 2-core machine (best of 15, a 1536 x 576 matrix, cached):
1 row q4 97 us / int8 80 us (the decode-to-L1-then-dot version before it: 130 / 133), 4 rows
117 / 115 (153 / 177), 7 rows 180 / 157 (203 / 227).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic
from numba.extending import overload

from kafila.models.torch.few_rows import VF, product_tile
from kafila.models.torch.few_rows import tiles as float_tiles

GROUP = 32
HALF = 16
_F32 = ir.FloatType()
_V = ir.VectorType(_F32, HALF)
_I32 = ir.IntType(32)
QTILE = 32  # output rows per parallel task (a multiple of 4)


def _fused_dot(nr: int, mode: str):  # type: ignore[no-untyped-def]
    """A compiled intrinsic `dot(x, r, data, scales, mins, o0, o1, o2, o3, ys, ws)`: ys[r + a, b]
    = x[r + a] . W[o_b] for a < nr and four packed weight rows o_b, in one pass over the groups.
    Per group of 32 and weight row: the scale (and minimum) widened from float16 by `fpext`, the
    16 bytes (q4: low then high nibbles; int8: two halves) converted to two float32 vectors of 16
    as d * q (+ m) (the values quant.dequantize gives), and multiply-added (`llvm.fmuladd`) into
    that (row, weight row)'s 16-lane accumulator: inputs 32 g + l and 32 g + 16 + l go to lane l,
    groups in order; the lanes are added in one fixed halving tree. No fast-math: the additions
    of a row never depend on nr or on the other rows. mode "decode" decodes from the packed
    bytes; "keep" also stores the decoded rows into ws [4, in] (b-th row); "load" reads them from
    ws (an earlier pass's): the same values, the same additions, the same bits."""

    @intrinsic
    def dot(typingctx, x, r, data, scales, mins, o0, o1, o2, o3, ys, wsbuf):  # type: ignore[no-untyped-def]
        q4 = data.dtype == types.uint8  # q4 packs two values a byte; int8 is int8 (mins unused)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            arr = [
                context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 3, 4, 9, 10)
            ]
            xa, da, sa, ma, ya, wa = arr
            r0, outs = args[1], args[5:9]
            intp = r0.type
            k = builder.extract_value(xa.shape, 1)
            dcols = builder.extract_value(da.shape, 1)
            groups = builder.extract_value(sa.shape, 1)
            mad = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(_V, [_V] * 3), "llvm.fmuladd.v16f32"
            )
            zero = ir.Constant(_V, [0.0] * HALF)
            acc = [[cgutils.alloca_once_value(builder, zero) for _ in outs] for _ in range(nr)]
            xrows = [builder.gep(xa.data, [builder.mul(builder.add(r0, intp(a)), k)]) for a in range(nr)]
            i16p = ir.IntType(16).as_pointer()

            def half(a_: Any, o: ir.Value, g: ir.Value) -> ir.Value:  # scales/mins[o, g] as float32
                at = builder.add(builder.mul(o, groups), g)
                bits = builder.load(builder.gep(builder.bitcast(a_.data, i16p), [at]))
                return builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32)

            def splat(v: ir.Value) -> ir.Value:  # v in all 16 lanes
                u = ir.Constant(_V, ir.Undefined)
                one = builder.insert_element(u, v, _I32(0))
                return builder.shuffle_vector(one, u, ir.Constant(ir.VectorType(_I32, HALF), [0] * HALF))

            with cgutils.for_range(builder, groups, intp=intp) as loop:
                g = loop.index
                xs = []
                for a in range(nr):
                    p = builder.gep(xrows[a], [builder.mul(g, intp(GROUP))])
                    lo = builder.load(builder.bitcast(p, _V.as_pointer()), align=4)
                    hi = builder.load(builder.bitcast(builder.gep(p, [intp(HALF)]), _V.as_pointer()), align=4)
                    xs.append((lo, hi))
                for b, o in enumerate(outs):
                    wrow = builder.gep(
                        wa.data, [builder.add(builder.mul(intp(b), k), builder.mul(g, intp(GROUP)))]
                    )
                    wp = [builder.bitcast(builder.gep(wrow, [intp(j)]), _V.as_pointer()) for j in (0, HALF)]
                    if mode == "load":
                        ws = [builder.load(p, align=4) for p in wp]
                        for a in range(nr):
                            cell = acc[a][b]
                            v = builder.call(mad, [xs[a][0], ws[0], builder.load(cell)])
                            builder.store(builder.call(mad, [xs[a][1], ws[1], v]), cell)
                        continue
                    d = splat(half(sa, o, g))
                    src = builder.gep(
                        da.data,
                        [builder.add(builder.mul(o, dcols), builder.mul(g, intp(HALF if q4 else GROUP)))],
                    )
                    v8 = ir.VectorType(ir.IntType(8), HALF)
                    if q4:
                        m = splat(half(ma, o, g))
                        raw = builder.load(builder.bitcast(src, v8.as_pointer()), align=1)
                        ql = builder.uitofp(builder.and_(raw, ir.Constant(v8, [15] * HALF)), _V)
                        qh = builder.uitofp(builder.lshr(raw, ir.Constant(v8, [4] * HALF)), _V)
                        ws = [builder.fadd(builder.fmul(q, d), m) for q in (ql, qh)]
                    else:
                        raws = [
                            builder.load(
                                builder.bitcast(builder.gep(src, [intp(j)]), v8.as_pointer()), align=1
                            )
                            for j in (0, HALF)
                        ]
                        ws = [builder.fmul(builder.sitofp(v, _V), d) for v in raws]
                    if mode == "keep":
                        for v, p in zip(ws, wp, strict=True):
                            builder.store(v, p, align=4)
                    for a in range(nr):
                        cell = acc[a][b]
                        v = builder.call(mad, [xs[a][0], ws[0], builder.load(cell)])
                        builder.store(builder.call(mad, [xs[a][1], ws[1], v]), cell)
            for a in range(nr):
                yrow = builder.gep(ya.data, [builder.mul(builder.add(r0, intp(a)), intp(4))])
                for b in range(4):
                    v = builder.load(acc[a][b])
                    n = HALF
                    while n > 1:
                        n //= 2
                        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
                        hi = builder.shuffle_vector(
                            v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n)))
                        )
                        v = builder.fadd(lo, hi)
                    builder.store(builder.extract_element(v, _I32(0)), builder.gep(yrow, [intp(b)]))
            return context.get_dummy_value()

        return types.void(x, r, data, scales, mins, o0, o1, o2, o3, ys, wsbuf), codegen

    return dot


_DECODE = {n: _fused_dot(n, "decode") for n in (1, 2, 3, 4)}
_KEEP = {n: _fused_dot(n, "keep") for n in (3, 4)}
_LOAD = {n: _fused_dot(n, "load") for n in (1, 2, 3)}
d1, d2, d3, d4 = (_DECODE[n] for n in (1, 2, 3, 4))
k3, k4 = _KEEP[3], _KEEP[4]
ld1, ld2, ld3 = _LOAD[1], _LOAD[2], _LOAD[3]
# x rows of the first (decoding) pass: four where the CPU has 32 vector registers (16 accumulators),
# three otherwise, as few_rows.FIRST_ROWS.
FIRST = 4 if VF == 16 else 3


@njit(cache=True, nogil=True, boundscheck=False, fastmath=False)
def packed_tile(  # pragma: no cover (compiled)
    x: np.ndarray, data: np.ndarray, scales: np.ndarray, mins: np.ndarray, y: np.ndarray, t: int
) -> None:
    """Rows [t QTILE, (t + 1) QTILE) of y [N, out] = x [N, in] W^T, W q4 (data uint8) or int8
    (data int8, `mins` unused), four weight rows at a time: the first pass (up to FIRST x rows)
    decodes them from the packed bytes in registers, and where more rows follow keeps the decoded
    rows in ws (L1) for the later passes of three."""
    n = x.shape[0]
    out = data.shape[0]
    ys = np.empty((n, 4), np.float32)
    ws = np.empty((4, x.shape[1]), np.float32)
    for o in range(t * QTILE, min(out, (t + 1) * QTILE), 4):
        o1, o2, o3 = min(o + 1, out - 1), min(o + 2, out - 1), min(o + 3, out - 1)
        if n == 1:
            d1(x, 0, data, scales, mins, o, o1, o2, o3, ys, ws)
        elif n == 2:
            d2(x, 0, data, scales, mins, o, o1, o2, o3, ys, ws)
        elif n == 3:
            d3(x, 0, data, scales, mins, o, o1, o2, o3, ys, ws)
        elif n == 4 and FIRST == 4:
            d4(x, 0, data, scales, mins, o, o1, o2, o3, ys, ws)
        elif FIRST == 4:
            k4(x, 0, data, scales, mins, o, o1, o2, o3, ys, ws)
        else:
            k3(x, 0, data, scales, mins, o, o1, o2, o3, ys, ws)
        r = min(n, FIRST)
        while n - r >= 3:
            ld3(x, r, data, scales, mins, o, o1, o2, o3, ys, ws)
            r += 3
        if n - r == 2:
            ld2(x, r, data, scales, mins, o, o1, o2, o3, ys, ws)
        elif n - r == 1:
            ld1(x, r, data, scales, mins, o, o1, o2, o3, ys, ws)
        for b in range(min(4, out - o)):
            for rr in range(n):
                y[rr, o + b] = ys[rr, b]


def tiles(w: Any) -> int:
    """Parallel tasks of a product with weight `w` (any format; compiled only)."""
    raise NotImplementedError("compiled only")


def tile(x: np.ndarray, w: Any, y: np.ndarray, t: int) -> None:
    """Task `t` of y = x w^T (any format; compiled only)."""
    raise NotImplementedError("compiled only")


def rows_of(w: Any) -> int:
    """Output features of weight `w` (compiled only)."""
    raise NotImplementedError("compiled only")


def cols_of(w: Any) -> int:
    """Input features of weight `w` (compiled only)."""
    raise NotImplementedError("compiled only")


def _packed(w) -> int:  # type: ignore[no-untyped-def]
    """0 for a float weight array, 2 for an int8 tuple, 3 for a q4 tuple, -1 otherwise."""
    if isinstance(w, types.Array):
        return 0
    if isinstance(w, types.BaseTuple) and len(w) in (2, 3):
        return len(w)
    return -1


@overload(tiles)
def _tiles(w):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    kind = _packed(w)
    if kind == 0:
        return lambda w: float_tiles(w)
    if kind > 0:
        return lambda w: (w[0].shape[0] + QTILE - 1) // QTILE
    return None


@overload(tile)
def _tile(x, w, y, t):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    kind = _packed(w)
    if kind == 0:
        return lambda x, w, y, t: product_tile(x, w, y, t)
    if kind == 2:
        return lambda x, w, y, t: packed_tile(x, w[0], w[1], w[1], y, t)
    if kind == 3:
        return lambda x, w, y, t: packed_tile(x, w[0], w[1], w[2], y, t)
    return None


@overload(rows_of)
def _rows_of(w):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    kind = _packed(w)
    if kind == 0:
        return lambda w: w.shape[0]
    if kind > 0:
        return lambda w: w[0].shape[0]
    return None


@overload(cols_of)
def _cols_of(w):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    kind = _packed(w)
    if kind == 0:
        return lambda w: w.shape[1]
    if kind == 2:
        return lambda w: w[0].shape[1]
    if kind == 3:
        return lambda w: w[0].shape[1] * 2
    return None


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def product(x: np.ndarray, w: Any, y: np.ndarray) -> None:  # pragma: no cover
    """y [N, out] = x [N, in] w^T for a packed weight tuple (or a float weight)."""
    for t in prange(tiles(w)):
        tile(x, w, y, t)


def warm_up() -> None:
    """Compile the packed products (or load them from numba's disk cache) on tiny arrays."""
    x = np.ones((1, GROUP), np.float32)
    y = np.empty((1, 2), np.float32)
    scales = np.zeros((2, 1), np.uint16)
    product(x, (np.zeros((2, GROUP), np.int8), scales), y)
    product(x, (np.zeros((2, HALF), np.uint8), scales, scales), y)
