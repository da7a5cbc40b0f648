"""Few-row products with packed weights (int8, q4) on the CPU, compiled by numba.

`tile(x, w, y, t)` computes output rows [t * QTILE, (t + 1) * QTILE) of y = x W^T for x [N, in]
float32, reading each packed weight byte once for all N rows: a group of 32 weights is decoded
into float32 (scale * q (+ min), in registers) and multiplied into every row's accumulators before
the next group is read. `w` is a tuple of numpy arrays, as `weight_arrays` makes them: (data int8
[out, in], scales) for int8 or (data uint8 [out, in/2], scales, mins) for q4, scales and minimums
as float16 bits (uint16), widened exactly as they are read. A float weight (float32 array, or bf16
bits) goes to few_rows.product_tile, so `decode_cpu.block_step` takes any format through these
generic `tiles`/`tile`/`rows_of`/`cols_of`.

Each row accumulates in 16 lanes (lane l: inputs l, l + 16 of every group, in group order), then
adds its lanes in order: a row's bits depend on nothing but its own input, never on the other rows
of the call (no fast-math: LLVM may vectorize across lanes, not reorder a lane's additions).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core.extending import intrinsic
from numba.extending import overload

from kafila.models.torch.few_rows import _dot_1 as dot_1
from kafila.models.torch.few_rows import _dot_2 as dot_2
from kafila.models.torch.few_rows import _dot_3 as dot_3
from kafila.models.torch.few_rows import product_tile
from kafila.models.torch.few_rows import tiles as float_tiles

GROUP = 32
HALF = 16
QTILE = 32  # output rows per parallel task (a multiple of 4)


def _group_decoder(q4: bool):  # type: ignore[no-untyped-def]
    """A compiled intrinsic `decode(data, row, g, scales, mins, ws, a)`: ws[a, 32 g : 32 g + 32] =
    the 32 weights of group g of packed row `row`, as float32 (q4: d * q + m from 16 bytes' low
    then high nibbles; int8: d * q from 32 bytes, `mins` unused), d = scales[row, g] and
    m = mins[row, g] float16 bits widened by LLVM's `fpext` (one vcvtph2ps on x86 with F16C, every
    x86-64 CPU since 2012; a native conversion on ARM). Written as LLVM IR on whole vectors (one
    load, one convert, one multiply-add, one store per half), which numba's loops did not vectorize."""
    n = HALF if q4 else GROUP

    @intrinsic
    def decode(typingctx, data, row, g, scales, mins, ws, a):  # type: ignore[no-untyped-def]
        if not all(
            isinstance(t, types.Array) and t.layout == "C" and t.ndim == 2 for t in (data, ws, scales, mins)
        ):
            return None

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            da = context.make_array(signature.args[0])(context, builder, args[0])
            wa = context.make_array(signature.args[5])(context, builder, args[5])
            row_, g_, a_ = args[1], args[2], args[6]
            intp = row_.type

            def half(i: int) -> ir.Value:  # scales/mins[row, g] as float32
                arr = context.make_array(signature.args[i])(context, builder, args[i])
                at_ = builder.add(builder.mul(row_, builder.extract_value(arr.shape, 1)), g_)
                bits = builder.load(
                    builder.gep(builder.bitcast(arr.data, ir.IntType(16).as_pointer()), [at_])
                )
                return builder.fpext(builder.bitcast(bits, ir.HalfType()), ir.FloatType())

            dv, mv = half(3), half(4)
            src = builder.gep(
                da.data,
                [
                    builder.add(
                        builder.mul(row_, builder.extract_value(da.shape, 1)), builder.mul(g_, intp(n))
                    )
                ],
            )
            dst = builder.gep(
                wa.data,
                [
                    builder.add(
                        builder.mul(a_, builder.extract_value(wa.shape, 1)), builder.mul(g_, intp(GROUP))
                    )
                ],
            )
            i8v = ir.VectorType(ir.IntType(8), n)
            fv = ir.VectorType(ir.FloatType(), HALF)

            def splat(v: ir.Value) -> ir.Value:
                undef = ir.Constant(fv, ir.Undefined)
                one = builder.insert_element(undef, v, ir.IntType(32)(0))
                return builder.shuffle_vector(
                    one, undef, ir.Constant(ir.VectorType(ir.IntType(32), HALF), [0] * HALF)
                )

            dd, mm = splat(dv), splat(mv)
            if q4:
                raw = builder.load(builder.bitcast(src, i8v.as_pointer()), align=1)
                lo = builder.and_(raw, ir.Constant(i8v, [15] * n))
                hi = builder.lshr(raw, ir.Constant(i8v, [4] * n))
                halves = [builder.uitofp(lo, fv), builder.uitofp(hi, fv)]
                halves = [builder.fadd(builder.fmul(h, dd), mm) for h in halves]
            else:  # two 16-byte halves, each widened to 16 floats
                half_v = ir.VectorType(ir.IntType(8), HALF)
                loads = [
                    builder.load(builder.bitcast(builder.gep(src, [intp(k)]), half_v.as_pointer()), align=1)
                    for k in (0, HALF)
                ]
                halves = [builder.fmul(builder.sitofp(v, fv), dd) for v in loads]
            for k, h in enumerate(halves):
                p = builder.gep(dst, [intp(k * HALF)])
                builder.store(h, builder.bitcast(p, fv.as_pointer()), align=4)
            return context.get_dummy_value()

        sig = types.void(data, row, g, scales, mins, ws, a)
        return sig, codegen

    return decode


_decode_q4, _decode_i8 = _group_decoder(True), _group_decoder(False)


@njit(cache=True, nogil=True, boundscheck=False)
def _q4_rows(
    data: np.ndarray, scales: np.ndarray, mins: np.ndarray, o: int, ws: np.ndarray
) -> None:  # pragma: no cover
    """ws [4, in] float32 = rows o..o+3 of a q4 matrix (rows past the end repeat the last one)."""
    out = data.shape[0]
    for a in range(4):
        row = min(o + a, out - 1)
        for g in range(scales.shape[1]):
            _decode_q4(data, row, g, scales, mins, ws, a)


@njit(cache=True, nogil=True, boundscheck=False)
def _i8_rows(data: np.ndarray, scales: np.ndarray, o: int, ws: np.ndarray) -> None:  # pragma: no cover
    """ws [4, in] float32 = rows o..o+3 of an int8 matrix (rows past the end repeat the last one)."""
    out = data.shape[0]
    for a in range(4):
        row = min(o + a, out - 1)
        for g in range(scales.shape[1]):
            _decode_i8(data, row, g, scales, scales, ws, a)


@njit(cache=True, nogil=True, boundscheck=False, fastmath=False)
def _dot_four(
    x: np.ndarray, ws: np.ndarray, ys: np.ndarray, y: np.ndarray, o: int
) -> None:  # pragma: no cover
    """y[:, o:o+4] = x [N, in] ws [4, in]^T through few_rows' dot passes (each row's sums in one
    fixed order whatever N is), the four weight rows read from L1 for every pass."""
    n = x.shape[0]
    r = 0
    while n - r >= 3:
        dot_3(x, r, ws, 0, 1, 2, 3, ys)
        r += 3
    if n - r == 2:
        dot_2(x, r, ws, 0, 1, 2, 3, ys)
    elif n - r == 1:
        dot_1(x, r, ws, 0, 1, 2, 3, ys)
    for b in range(min(4, y.shape[1] - o)):
        for r in range(n):
            y[r, o + b] = ys[r, b]


@njit(cache=True, nogil=True, boundscheck=False, fastmath=False)
def q4_tile(
    x: np.ndarray, data: np.ndarray, scales: np.ndarray, mins: np.ndarray, y: np.ndarray, t: int
) -> None:  # pragma: no cover (compiled)
    """Rows [t QTILE, (t + 1) QTILE) of y [N, out] = x [N, in] W^T, W q4: four rows at a time
    decoded into float32 (in L1), then multiplied into every x row."""
    ws = np.empty((4, x.shape[1]), np.float32)
    ys = np.empty((x.shape[0], 4), np.float32)
    for o in range(t * QTILE, min(data.shape[0], (t + 1) * QTILE), 4):
        _q4_rows(data, scales, mins, o, ws)
        _dot_four(x, ws, ys, y, o)


@njit(cache=True, nogil=True, boundscheck=False, fastmath=False)
def i8_tile(
    x: np.ndarray, data: np.ndarray, scales: np.ndarray, y: np.ndarray, t: int
) -> None:  # pragma: no cover
    """Rows [t QTILE, (t + 1) QTILE) of y [N, out] = x [N, in] W^T, W int8 (as q4_tile)."""
    ws = np.empty((4, x.shape[1]), np.float32)
    ys = np.empty((x.shape[0], 4), np.float32)
    for o in range(t * QTILE, min(data.shape[0], (t + 1) * QTILE), 4):
        _i8_rows(data, scales, o, ws)
        _dot_four(x, ws, ys, y, o)


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
        return lambda x, w, y, t: i8_tile(x, w[0], w[1], y, t)
    if kind == 3:
        return lambda x, w, y, t: q4_tile(x, w[0], w[1], w[2], y, t)
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
