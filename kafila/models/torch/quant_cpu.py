"""Few-row products with packed weights (int8, q4, q5 and the K-quants) on the CPU, compiled by numba.

`tile(x, w, y, t)` computes output rows [t * QTILE, (t + 1) * QTILE) of y = x W^T for x [N, in]
float32, reading each packed weight byte once per call for all N rows: four weight rows at a time,
each group of 32 weights is decoded into float32 vectors (scale * q (+ min), in registers) and
multiplied into the first pass's rows' accumulators (`_fused_dot`); later passes, for batches of
more rows, read the decoded rows back from L1. `w` is a tuple of numpy arrays (PackedLinear.arrays):
(data int8 [out, in], scales) for int8 or (data uint8 [out, in/2], scales, mins) for q4, scales
and minimums as float16 bits (uint16), widened exactly as they are read. A float weight (float32
array, or bf16 bits) goes to few_rows.product_tile, so `decode_cpu.block_step` takes any format
through these generic `prepare`/`tiles`/`tile`/`rows_of`/`cols_of`: `prepare(x, w)` gives `tile`
its x, the float rows, or for q4 on a CPU with AVX-512 VNNI (`INT_DOT`) the rows rounded to int8
groups (`quantize_rows`), which `tile` then multiplies as integers (`int_tile`, the section
"integer dot products" below: llama.cpp's way, 2-4x fewer instructions per weight byte). A
K-quant weight (a GGUF's Q6_K, Q4_K or Q5_K as stored: (data uint8 [out, in/256, bytes], d bits
and, but for q6k, dmin bits)) has kernels of its own (the section "K-quants");
a q5 one (q4's arrays and its fifth bits, `high`) takes q4's, the bits or'ed into the levels.
`product` runs a whole product that way; `float_product` with x in floats, `rounded_product` with
x rounded to int8 for any format (the head: PackedLinear.round_x). int8 weights take x rounded to
int16 (`quantize_rows16`, `vpdpwssd`): rounding it to int8 changed the default model's answer.

Each row accumulates in 16 lanes (lane l: inputs l, l + 16 of every group, in group order), then
adds its lanes in one fixed tree: a row's bits depend on nothing but its own input, never on the
other rows of the call or the pass that computed it (tests/models/test_quant.py).

Measured on one thread of this loaded 2-core machine (best of 15, a 1536 x 576 matrix, cached):
1 row q4 97 us / int8 80 us (the decode-to-L1-then-dot version before it: 130 / 133), 4 rows
117 / 115 (153 / 177), 7 rows 180 / 157 (203 / 227). The default model's q4 products of a token
(30 blocks and the int8 head, streamed from memory): 21.8 ms this way, 7.05 ms the integer way
(docs/engine-quant.md).
"""

from __future__ import annotations

from typing import Any

import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.core.extending import intrinsic
from numba.extending import overload

from kafila.models.manifest import Q4K_BYTES, Q5K_BYTES, Q6K_BYTES, SUPER
from kafila.models.torch import cpu_kernels
from kafila.models.torch.few_rows import VF, _prefetch, product_tile
from kafila.models.torch.few_rows import tiles as float_tiles

GROUP = 32
HALF = 16
_F32 = ir.FloatType()
_V = ir.VectorType(_F32, HALF)
_I32 = ir.IntType(32)
QTILE = 32  # output rows per parallel task (a multiple of 4)


def _fifth_bits(
    builder: ir.IRBuilder, high_row: ir.Value, g: ir.Value, intp: ir.Type, n: int, first: int
) -> ir.Value:
    """q5's fifth bits of entries first .. first + n - 1 of group g as <n x i8> of 0 or 16, from the
    row's `high` bytes (i8*; group g's four at 4 g: bit j % 8 of byte j / 8 is entry j's)."""
    v4 = ir.VectorType(_I8, 4)
    four = builder.load(
        builder.bitcast(builder.gep(high_row, [builder.mul(g, intp(4))]), v4.as_pointer()), align=1
    )
    picks = [(first + i) // 8 for i in range(n)]
    spread = builder.shuffle_vector(four, four, ir.Constant(ir.VectorType(_I32, n), picks))
    vn = ir.VectorType(_I8, n)
    mask = ir.Constant(vn, [1 << ((first + i) % 8) for i in range(n)])
    on = builder.icmp_unsigned("!=", builder.and_(spread, mask), ir.Constant(vn, [0] * n))
    return builder.select(on, ir.Constant(vn, [16] * n), ir.Constant(vn, [0] * n))


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
    def dot(typingctx, x, r, data, scales, mins, high, o0, o1, o2, o3, ys, wsbuf):  # type: ignore[no-untyped-def]
        q4 = data.dtype == types.uint8  # q4 (and q5) pack two values a byte; int8 is int8 (mins unused)
        q5 = high.dtype == types.uint8  # q5: `high` holds the fifth bits (else it is any unused array)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            arr = [
                context.make_array(signature.args[i])(context, builder, args[i])
                for i in (0, 2, 3, 4, 10, 11, 5)
            ]
            xa, da, sa, ma, ya, wa, ha = arr
            r0, outs = args[1], args[6:10]
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
                        lo = builder.and_(raw, ir.Constant(v8, [15] * HALF))
                        hi = builder.lshr(raw, ir.Constant(v8, [4] * HALF))
                        if q5:
                            hrow = builder.gep(ha.data, [builder.mul(o, builder.extract_value(ha.shape, 1))])
                            lo = builder.or_(lo, _fifth_bits(builder, hrow, g, intp, HALF, 0))
                            hi = builder.or_(hi, _fifth_bits(builder, hrow, g, intp, HALF, HALF))
                        ql, qh = builder.uitofp(lo, _V), builder.uitofp(hi, _V)
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

        return types.void(x, r, data, scales, mins, high, o0, o1, o2, o3, ys, wsbuf), codegen

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
    x: np.ndarray,
    data: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray,
    high: np.ndarray,
    y: np.ndarray,
    t: int,
) -> None:
    """Rows [t QTILE, (t + 1) QTILE) of y [N, out] = x [N, in] W^T, W q4 (data uint8), q5 (q4's
    and `high` uint8) or int8 (data int8, `mins` unused; `high` unused where it is not uint8),
    four weight rows at a time: the first pass (up to FIRST x rows)
    decodes them from the packed bytes in registers, and where more rows follow keeps the decoded
    rows in ws (L1) for the later passes of three."""
    n = x.shape[0]
    out = data.shape[0]
    ys = np.empty((n, 4), np.float32)
    ws = np.empty((4, x.shape[1]), np.float32)
    for o in range(t * QTILE, min(out, (t + 1) * QTILE), 4):
        o1, o2, o3 = min(o + 1, out - 1), min(o + 2, out - 1), min(o + 3, out - 1)
        if n == 1:
            d1(x, 0, data, scales, mins, high, o, o1, o2, o3, ys, ws)
        elif n == 2:
            d2(x, 0, data, scales, mins, high, o, o1, o2, o3, ys, ws)
        elif n == 3:
            d3(x, 0, data, scales, mins, high, o, o1, o2, o3, ys, ws)
        elif n == 4 and FIRST == 4:
            d4(x, 0, data, scales, mins, high, o, o1, o2, o3, ys, ws)
        elif FIRST == 4:
            k4(x, 0, data, scales, mins, high, o, o1, o2, o3, ys, ws)
        else:
            k3(x, 0, data, scales, mins, high, o, o1, o2, o3, ys, ws)
        r = min(n, FIRST)
        while n - r >= 3:
            ld3(x, r, data, scales, mins, high, o, o1, o2, o3, ys, ws)
            r += 3
        if n - r == 2:
            ld2(x, r, data, scales, mins, high, o, o1, o2, o3, ys, ws)
        elif n - r == 1:
            ld1(x, r, data, scales, mins, high, o, o1, o2, o3, ys, ws)
        for b in range(min(4, out - o)):
            for rr in range(n):
                y[rr, o + b] = ys[rr, b]


# -- integer dot products (AVX-512 VNNI) -------------------------------------------------------------
#
# llama.cpp's CPU products do not decode weights to floats: they quantize the activation row to
# int8 per group of 32 (a scale per group) and multiply bytes by bytes (`vpdpbusd`: 32 products of
# an unsigned and a signed byte summed into 8 int32 lanes per instruction), converting one int32
# sum per group to float. Decoding every weight to float32 (the path above) costs 3-4 times more
# instructions per weight byte, and on this 2-core AMD EPYC the q4 product was bound by those
# instructions, not by memory (5.7 GB/s from L2; docs/engine-quant.md, "Measured": all products
# of a q4 token). Where the CPU has AVX-512 VNNI (Intel since Ice Lake, AMD since Zen 4) the packed
# products take this integer path; elsewhere, or where $KAFILA_CPU_KERNELS forces another path
# (cpu_kernels), the float path above.
#
# Per row x and group g of 32 inputs: dx = max|x_g| / 127, qx = round(x_g / dx) in [-127, 127],
# sx = dx sum(qx) (the rounded inputs' sum, as llama.cpp's Q8_1 keeps it: then the q4 product is
# exactly W . (dx qx); the exact sum would add m (sum(x) - sx), and Q4_1's minimums are large:
# on the default model that doubled the logits' largest deviation). Then
#   q4:   y += dw dx sum(qw qx) + m sx       (qw in [0, 15]: the nibbles are unsigned bytes)
#   int8: y += dw dx sum(qw qx)             (qw signed: vpdpbusd takes (qw + 128) as unsigned and
#         its int32 lanes start at -128 sum(qx) of their four inputs, `xc`, made once per row)
# The integer sums are exact; the rounding of x to qx is the only approximation, the one llama.cpp
# makes (Q8_0/Q8_1 activations). A row's bits depend only on that row (its own dx, fixed orders).

# The path in force (cpu_kernels: $KAFILA_CPU_KERNELS, else "vnni" where the CPU has it).
INT_DOT = cpu_kernels.PATH.int_dot
_I8, _V8F = ir.IntType(8), ir.VectorType(_F32, 8)
_V8I = ir.VectorType(_I32, 8)
_V32B = ir.VectorType(_I8, GROUP)
_V16B = ir.VectorType(_I8, HALF)


@njit(cache=True, nogil=True, boundscheck=False, fastmath=False, error_model="numpy", inline="always")
def _round_group(
    x: np.ndarray, r: int, g: int, levels: np.float32, qx: np.ndarray
) -> np.float32:  # pragma: no cover
    """Group g of 32 in row r of x [N, in] float32 rounded into qx [N, in] (int8 or int16): qx =
    rint(x levels / max|x_g|), all 0 for a group of zeros. Returns max|x_g| (float32); the caller
    makes dx = max|x_g| / levels. Shared by quantize_rows (levels 127) and quantize_rows16 (32767)."""
    top = np.float32(0.0)
    for i in range(g * GROUP, (g + 1) * GROUP):
        top = max(top, abs(x[r, i]))
    inv = levels / top if top > 0 else np.float32(0.0)
    for i in range(g * GROUP, (g + 1) * GROUP):
        qx[r, i] = np.rint(x[r, i] * inv)  # the cast to qx's integer type: in range, exact
    return top


@njit(cache=True, nogil=True, boundscheck=False, fastmath=False, error_model="numpy")
def quantize_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover
    """x [N, in] float32 as the integer products take it: (qx int8 [N, in], dx float32 [N, groups],
    sx float32 [N, groups], xc int32 [N, in/4]) per group of 32, see above (np.rint: ties to
    even); xc[r, 8 g + l] =
    -128 * (the sum of qx[r, 32 g + 4 l ... + 3])."""
    n, k = x.shape
    groups = k // GROUP
    qx = np.empty((n, k), np.int8)
    dx = np.empty((n, groups), np.float32)
    sx = np.empty((n, groups), np.float32)
    xc = np.empty((n, k // 4), np.int32)
    for r in range(n):
        for g in range(groups):
            top = _round_group(x, r, g, np.float32(127.0), qx)
            total = np.int32(0)
            for lane in range(GROUP // 4):
                at = g * GROUP + 4 * lane
                four = (
                    np.int32(qx[r, at])
                    + np.int32(qx[r, at + 1])
                    + np.int32(qx[r, at + 2])
                    + np.int32(qx[r, at + 3])
                )
                xc[r, g * (GROUP // 4) + lane] = np.int32(-128) * four
                total += four
            dx[r, g] = top / np.float32(127.0)
            sx[r, g] = dx[r, g] * np.float32(total)
    return qx, dx, sx, xc


@njit(cache=True, nogil=True, boundscheck=False, fastmath=False, error_model="numpy")
def quantize_rows16(
    x: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:  # pragma: no cover
    """x [N, in] float32 rounded to int16 per group of 32 for the int8 format's products: (qx int16
    [N, in], dx [N, groups] = max|x_g| / 32767, and two empty arrays in quantize_rows' places). 256
    times finer than int8: rounding x to int8 changed the default model's greedy answer in int8."""
    n, k = x.shape
    groups = k // GROUP
    qx = np.empty((n, k), np.int16)
    dx = np.empty((n, groups), np.float32)
    for r in range(n):
        for g in range(groups):
            top = _round_group(x, r, g, np.float32(32767.0), qx)
            dx[r, g] = top / np.float32(32767.0)
    return qx, dx, np.empty((n, 0), np.float32), np.empty((n, 0), np.int32)


def _hsum8(builder: ir.IRBuilder, v: ir.Value, lanes: int = 8) -> ir.Value:
    """The `lanes` lanes of v added in one fixed halving tree."""
    n = lanes
    while n > 1:
        n //= 2
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, _I32(0))


def _int_dot(nr: int):  # type: ignore[no-untyped-def]
    """A compiled intrinsic `dot(qx, dx, sx, xc, r, data, scales, mins, o0, o1, o2, o3, ys)`:
    ys[r + a, b] = x[r + a] . W[o_b] for a < nr and four packed weight rows, the
    integer way (see above). Per group of 32 and weight row, the 32 weight bytes (q4: low nibbles
    then high, which is the group's input order; int8: each byte + 128) are one 256-bit vector;
    `vpdpbusd` sums their products with each row's qx into 8 int32 lanes, converted to float32 and
    multiply-added with the scale dw dx into that (row, weight row)'s 8 lanes. Groups go eight at
    a time: their eight scales (and q4's minimums) are widened from float16 as one vector and
    multiplied by the row's dx (sx) as one, each group's lane then broadcast; q4's m sx go into 8
    lanes (group g in lane g % 8), the groups past the last eight into a scalar. Each (row, weight
    row) pair is added in one fixed order whatever nr is, so no row's bits depend on another's.
    The weight rows of the quadruple two ahead are prefetched, one hint per cache line."""

    @intrinsic
    def dot(typingctx, qx, dx, sx, xc, r, data, scales, mins, high, o0, o1, o2, o3, ys):  # type: ignore[no-untyped-def]
        q4 = data.dtype == types.uint8
        q5 = high.dtype == types.uint8  # q4's nibbles and their fifth bits
        wide = qx.dtype == types.int16  # int8 weights by x rounded to int16: vpdpwssd, 16 lanes
        lanes = 16 if wide else 8
        vf, vi = ir.VectorType(_F32, lanes), ir.VectorType(_I32, lanes)

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            qa, da_x, sa_x, ca, wd, ws_, wm, wh, ya = (
                context.make_array(signature.args[i])(context, builder, args[i])
                for i in (0, 1, 2, 3, 5, 6, 7, 8, 13)
            )
            r0, outs = args[4], args[9:13]  # the last quadruple repeats row out - 1 past the end
            intp = r0.type
            k = builder.extract_value(qa.shape, 1)
            dcols = builder.extract_value(wd.shape, 1)
            groups = builder.extract_value(ws_.shape, 1)

            def fn(name: str, t: ir.Type) -> Any:
                return cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t] * 3), name)

            dot_name = "llvm.x86.avx512.vpdpwssd.512" if wide else "llvm.x86.avx512.vpdpbusd.256"
            dpbusd, mad = fn(dot_name, vi), fn(f"llvm.fmuladd.v{lanes}f32", vf)
            mad8, mad1 = fn("llvm.fmuladd.v8f32", _V8F), fn("llvm.fmuladd.f32", _F32)
            zero_f, zero_i = ir.Constant(vf, [0.0] * lanes), ir.Constant(vi, [0] * lanes)
            acc = [[cgutils.alloca_once_value(builder, zero_f) for _ in range(4)] for _ in range(nr)]
            zero8 = ir.Constant(_V8F, [0.0] * 8)
            macc8 = [[cgutils.alloca_once_value(builder, zero8) for _ in range(4)] for _ in range(nr)]
            macc = [[cgutils.alloca_once_value(builder, _F32(0.0)) for _ in range(4)] for _ in range(nr)]
            rows = [builder.add(r0, intp(a)) for a in range(nr)]
            i8p, i16p = _I8.as_pointer(), ir.IntType(16).as_pointer()
            step = HALF if q4 else GROUP  # packed bytes per group

            def base(a_: Any, row: ir.Value, width: ir.Value, ptr: ir.Type | None = None) -> ir.Value:
                """Pointer to a_[row, 0] (made once: the loops below only add the group's offset)."""
                data = a_.data if ptr is None else builder.bitcast(a_.data, ptr)
                return builder.gep(data, [builder.mul(row, width)])

            qrows = [base(qa, row, k) for row in rows]
            drows = [base(da_x, row, groups) for row in rows]
            srows = [base(sa_x, row, groups) for row in rows]
            crows = [base(ca, row, builder.mul(groups, intp(GROUP // 4))) for row in rows]
            wrows = [base(wd, ob, dcols, i8p) for ob in outs]
            scale_rows = [base(ws_, ob, groups, i16p) for ob in outs]
            min_rows = [base(wm, ob, groups, i16p) for ob in outs]
            if q5:
                high_rows = [base(wh, ob, builder.extract_value(wh.shape, 1), i8p) for ob in outs]
            ahead = builder.mul(dcols, intp(8))  # the same group of the rows two quadruples on

            def load(p: ir.Value, t: ir.Type, align: int) -> ir.Value:
                return builder.load(builder.bitcast(p, t.as_pointer()), align=align)

            def halves8(row: ir.Value, g: ir.Value) -> ir.Value:  # 8 float16 from row[g] as float32
                return builder.fpext(load(builder.gep(row, [g]), ir.VectorType(ir.HalfType(), 8), 2), _V8F)

            def half(row: ir.Value, g: ir.Value) -> ir.Value:  # one float16 as float32
                return builder.fpext(
                    builder.bitcast(builder.load(builder.gep(row, [g])), ir.HalfType()), _F32
                )

            def splat(v: ir.Value, lane: int) -> ir.Value:  # lane `lane` of an 8-vector in all lanes
                return builder.shuffle_vector(v, v, ir.Constant(vi, [lane] * lanes))

            def group(g: ir.Value, scale_of: Any, prefetch: bool) -> None:
                """One group: every (row, weight row) pair's int32 sums into its accumulator;
                scale_of(a, b) gives the pair's dw dx as an 8-vector."""
                xs, cs = [], []
                for a in range(nr):
                    xt = ir.VectorType(ir.IntType(16) if wide else _I8, GROUP)
                    xs.append(
                        builder.bitcast(load(builder.gep(qrows[a], [builder.mul(g, intp(GROUP))]), xt, 1), vi)
                    )
                    if not q4 and not wide:
                        cs.append(load(builder.gep(crows[a], [builder.mul(g, intp(GROUP // 4))]), _V8I, 4))
                for b in range(4):
                    src = builder.gep(wrows[b], [builder.mul(g, intp(step))])
                    if prefetch:
                        _prefetch(builder, builder.gep(src, [ahead]))
                    if q4:
                        raw = load(src, _V16B, 1)
                        lo = builder.and_(raw, ir.Constant(_V16B, [15] * HALF))
                        hi = builder.lshr(raw, ir.Constant(_V16B, [4] * HALF))
                        w = builder.shuffle_vector(
                            lo, hi, ir.Constant(ir.VectorType(_I32, GROUP), list(range(GROUP)))
                        )
                        if q5:
                            w = builder.or_(w, _fifth_bits(builder, high_rows[b], g, intp, GROUP, 0))
                    elif wide:
                        w = builder.sext(load(src, _V32B, 1), ir.VectorType(ir.IntType(16), GROUP))
                    else:
                        w = builder.xor(load(src, _V32B, 1), ir.Constant(_V32B, [-128] * GROUP))
                    wv = builder.bitcast(w, vi)
                    for a in range(nr):
                        total = builder.sitofp(
                            builder.call(dpbusd, [zero_i if q4 or wide else cs[a], wv, xs[a]]), vf
                        )
                        c = acc[a][b]
                        builder.store(builder.call(mad, [total, scale_of(a, b), builder.load(c)]), c)

            chunks = builder.udiv(groups, intp(8))
            with cgutils.for_range(builder, chunks, intp=intp) as loop:  # eight groups at a time
                g0 = builder.mul(loop.index, intp(8))
                dx8 = [load(builder.gep(drows[a], [g0]), _V8F, 4) for a in range(nr)]
                sc = [[builder.fmul(halves8(scale_rows[b], g0), dx8[a]) for b in range(4)] for a in range(nr)]
                if q4:
                    sx8 = [load(builder.gep(srows[a], [g0]), _V8F, 4) for a in range(nr)]
                    for b in range(4):
                        m8 = halves8(min_rows[b], g0)
                        for a in range(nr):
                            c = macc8[a][b]
                            builder.store(builder.call(mad8, [m8, sx8[a], builder.load(c)]), c)
                for j in range(8):  # q4: a 64-byte line every 4 groups; int8: every 2
                    prefetch = j % (4 if q4 else 2) == 0
                    group(builder.add(g0, intp(j)), lambda a, b, j=j: splat(sc[a][b], j), prefetch)
            with cgutils.for_range_slice(builder, builder.mul(chunks, intp(8)), groups, intp(1), intp) as (
                g,
                _,
            ):
                dxs = [builder.load(builder.gep(drows[a], [g])) for a in range(nr)]
                ds = [half(scale_rows[b], g) for b in range(4)]
                u = ir.Constant(_V8F, ir.Undefined)

                def scalar_scale(a: int, b: int) -> ir.Value:
                    return splat(builder.insert_element(u, builder.fmul(ds[b], dxs[a]), _I32(0)), 0)

                if q4:
                    for b in range(4):
                        m = half(min_rows[b], g)
                        for a in range(nr):
                            c, sxa = macc[a][b], builder.load(builder.gep(srows[a], [g]))
                            builder.store(builder.call(mad1, [m, sxa, builder.load(c)]), c)
                group(g, scalar_scale, True)
            for a in range(nr):
                yrow = builder.gep(ya.data, [builder.mul(rows[a], intp(4))])
                for b in range(4):
                    total = _hsum8(builder, builder.load(acc[a][b]), lanes)
                    if q4:
                        mins_sum = builder.fadd(
                            _hsum8(builder, builder.load(macc8[a][b])), builder.load(macc[a][b])
                        )
                        total = builder.fadd(total, mins_sum)
                    builder.store(total, builder.gep(yrow, [intp(b)]))
            return context.get_dummy_value()

        return types.void(qx, dx, sx, xc, r, data, scales, mins, high, o0, o1, o2, o3, ys), codegen

    return dot


if INT_DOT:  # the intrinsic names an instruction only such a CPU has
    i1, i2, i3, i4 = (_int_dot(n) for n in (1, 2, 3, 4))
else:  # int_tile is never compiled there (prepare keeps the floats)
    i1 = i2 = i3 = i4 = None


@njit(cache=True, nogil=True, boundscheck=False, fastmath=False)
def int_tile(  # pragma: no cover (compiled)
    qx: np.ndarray,
    dx: np.ndarray,
    sx: np.ndarray,
    xc: np.ndarray,
    data: np.ndarray,
    scales: np.ndarray,
    mins: np.ndarray,
    high: np.ndarray,
    y: np.ndarray,
    t: int,
) -> None:
    """Rows [t QTILE, (t + 1) QTILE) of y [N, out] = x W^T from x as `quantize_rows` gives it,
    four weight rows at a time, in passes of up to four x rows (later passes find the packed rows
    in L1); `high` as packed_tile's."""
    n = qx.shape[0]
    out = data.shape[0]
    ys = np.empty((n, 4), np.float32)
    for o in range(t * QTILE, min(out, (t + 1) * QTILE), 4):
        o1, o2, o3 = min(o + 1, out - 1), min(o + 2, out - 1), min(o + 3, out - 1)
        r = 0
        while n - r >= 4:
            i4(qx, dx, sx, xc, r, data, scales, mins, high, o, o1, o2, o3, ys)
            r += 4
        if n - r == 3:
            i3(qx, dx, sx, xc, r, data, scales, mins, high, o, o1, o2, o3, ys)
        elif n - r == 2:
            i2(qx, dx, sx, xc, r, data, scales, mins, high, o, o1, o2, o3, ys)
        elif n - r == 1:
            i1(qx, dx, sx, xc, r, data, scales, mins, high, o, o1, o2, o3, ys)
        for b in range(min(4, out - o)):
            for rr in range(n):
                y[rr, o + b] = ys[rr, b]


# -- K-quants: a GGUF's Q6_K, Q4_K and Q5_K as stored -------------------------------------------------
#
# A K-quant row is super-blocks of 256 inputs (kafila.models.quant has the layouts), handed to the
# kernels as data uint8 [out, n, bytes] with d (and dmin) as float16 bits [out, n]; the block size
# tells q6k (208), q4k (140) and q5k (172) apart at run time (one switch per quadruple of weight
# rows). Per super-block and weight row the sub-scales are widened and multiplied by d once (q6k:
# 16 d sc, one per 16 inputs; q4k, q5k: 8 d sc and 8 dmin m, one per 32: all exact in float32),
# then each group g of 32 has its levels made in a vector: q6k's from its two bit planes, q4k's the
# low or high nibbles of one 32-byte chunk, q5k's with the fifth bits or'ed in. The integer path
# (INT_DOT): two groups' levels (unsigned) in one `vpdpbusd` with the row's qx (quantize_rows: int8
# per group of 32, as q4 takes it); q6k's int32 lanes start at -32 times the sum of their four qx
# (xc / 4), so the sums are sum((q - 32) qx); lanes 0-3 hold a group's first 16 inputs, 4-7 its
# last 16, converted to float32 and multiply-added with (d sc) dx lane by lane; q4k and q5k add
# -(dmin m) sx per group once a super-block (sx: the row's rounded inputs' sums, as q4's minimums).
# The float path (elsewhere): each weight dequantized bit for bit ((q - 32) (d sc); (d sc) q -
# dmin m, two roundings as gguf.quants) and multiply-added with x in 16 lanes in packed_tile's
# order (lane l: inputs l, l + 16 of each group). Rows go four weight rows at a time in passes of up
# to four x rows (later passes find the rows in L1).

_V16F = ir.VectorType(_F32, HALF)
K_BYTES = {"q6k": Q6K_BYTES, "q4k": Q4K_BYTES, "q5k": Q5K_BYTES}


def _vconst(t: ir.VectorType, values: list[int]) -> ir.Constant:
    return ir.Constant(t, values)


def _byte_shift(builder: ir.IRBuilder, v: ir.Value, shifts: list[int]) -> ir.Value:
    """v (<n x i8>) shifted right by shifts[i] in byte i, shifted as 16-bit lanes (x86 has no byte
    shifts; the two bytes of a lane must shift alike): the caller masks each byte after."""
    n = v.type.count
    v16 = ir.VectorType(ir.IntType(16), n // 2)
    return builder.bitcast(builder.lshr(builder.bitcast(v, v16), _vconst(v16, shifts[::2])), v.type)


def _k_levels(builder: ir.IRBuilder, kind: str, blk: ir.Value, g: int, pair: bool, intp: ir.Type) -> ir.Value:
    """The levels of group g (0..7) of the super-block at `blk` (i8*) in format `kind`: <32 x i8>,
    or with `pair` those of groups g and g + 1 (g even) as <64 x i8> (q6k: 0..63; q4k: 0..15; q5k:
    0..31)."""
    n = 2 * GROUP if pair else GROUP
    v8 = ir.VectorType(_I8, n)

    def load(offset: int, t: ir.Type) -> ir.Value:
        return builder.load(builder.bitcast(builder.gep(blk, [intp(offset)]), t.as_pointer()), align=1)

    def twice(v: ir.Value) -> ir.Value:  # a 32-byte vector repeated: both groups of a pair read it
        return builder.shuffle_vector(v, v, _vconst(ir.VectorType(_I32, n), list(range(GROUP)) * 2))

    if kind == "q6k":
        half, quarter = g // 4, g % 4
        ql = load(64 * half + 32 * (g % 2), v8)  # a pair's 64 bytes are one run (g even)
        if quarter >= 2:
            ql = _byte_shift(builder, ql, [4] * n)
        low = builder.and_(ql, _vconst(v8, [15] * n))
        qh = load(128 + 32 * half, _V32B)
        shifts = [2 * quarter] * GROUP + ([2 * quarter + 2] * GROUP if pair else [])
        high = builder.and_(_byte_shift(builder, twice(qh) if pair else qh, shifts), _vconst(v8, [3] * n))
        return builder.or_(low, builder.shl(high, _vconst(v8, [4] * n)))
    chunk = load(K_BYTES[kind] - 128 + 32 * (g // 2), _V32B)  # groups 2 c (low nibbles), 2 c + 1 (high)
    if pair:
        q = builder.and_(_byte_shift(builder, twice(chunk), [0] * GROUP + [4] * GROUP), _vconst(v8, [15] * n))
    else:
        q = builder.and_(_byte_shift(builder, chunk, [4 * (g % 2)] * GROUP), _vconst(v8, [15] * n))
    if kind == "q5k":  # bit s of byte j of the 32 after the scales: entry 32 s + j's fifth
        qh = load(12, _V32B)
        shifts = [g] * GROUP + ([g + 1] * GROUP if pair else [])
        bit = builder.and_(_byte_shift(builder, twice(qh) if pair else qh, shifts), _vconst(v8, [1] * n))
        q = builder.or_(q, builder.shl(bit, _vconst(v8, [4] * n)))
    return q


def _k_scales(
    builder: ir.IRBuilder, kind: str, blk: ir.Value, d_bits: ir.Value, m_bits: ir.Value, intp: ir.Type
) -> tuple[ir.Value, ir.Value | None]:
    """The super-block's scales: (<16 x float> d sc, one per 16 inputs, and for q4k and q5k <8 x
    float> dmin m, one per group of 32). q6k's sc are the int8 at bytes 192..207; q4k's and q5k's
    sc and m the 6-bit fields of bytes 0..11 (quant.scale_min_k4), each d sc given twice."""

    def widen(bits: ir.Value) -> ir.Value:
        return builder.fpext(builder.bitcast(bits, ir.HalfType()), _F32)

    v16b, v4 = ir.VectorType(_I8, HALF), ir.VectorType(_I32, 4)
    if kind == "q6k":
        sc = builder.load(builder.bitcast(builder.gep(blk, [intp(192)]), v16b.as_pointer()), align=1)
        d = builder.insert_element(ir.Constant(_V16F, ir.Undefined), widen(d_bits), _I32(0))
        return builder.fmul(builder.sitofp(sc, _V16F), _lanes(builder, d, [0] * HALF)), None
    # the 12 bytes as 32-bit words u0, u1, u2 (u3: the block's next bytes, unused), each lane of
    # the result four fields (llama.cpp's kmask arithmetic): sc 0-3, sc 4-7, m 0-3, m 4-7
    u = builder.load(builder.bitcast(blk, v4.as_pointer()), align=1)
    a = _lanes(builder, u, [0, 2, 1, 2])  # the low bits of each lane's fields
    b = _lanes(builder, u, [0, 0, 1, 1])  # lanes 1, 3: the high two bits of fields 4-7
    low = builder.and_(
        builder.lshr(a, _vconst(v4, [0, 0, 0, 4])),
        _vconst(v4, [0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F]),
    )
    high = builder.shl(
        builder.and_(builder.lshr(b, _vconst(v4, [6] * 4)), _vconst(v4, [0, 0x03030303] * 2)),
        _vconst(v4, [4] * 4),
    )
    fields = builder.bitcast(builder.or_(low, high), v16b)  # sc 0-7, m 0-7
    pair = builder.insert_element(ir.Constant(_V16F, ir.Undefined), widen(d_bits), _I32(0))
    pair = builder.insert_element(pair, widen(m_bits), _I32(1))
    both = builder.fmul(builder.uitofp(fields, _V16F), _lanes(builder, pair, [0] * 8 + [1] * 8))
    return _lanes(builder, both, [i // 2 for i in range(HALF)]), _lanes(builder, both, list(range(8, HALF)))


def _lanes(builder: ir.IRBuilder, v: ir.Value, picks: list[int]) -> ir.Value:
    """A vector of v's lanes `picks`."""
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, len(picks)), picks))


def _k_dot_code(integer: bool):  # type: ignore[no-untyped-def]
    """`k_dot`'s code generator for x in int8 groups (`integer`) or float32."""

    def make(context: Any, builder: ir.IRBuilder, signature: Any, args: Any) -> Any:
        xs_t = signature.args[0].types if integer else (signature.args[0],)
        xs_v = cgutils.unpack_tuple(builder, args[0]) if integer else [args[0]]
        xa = [context.make_array(t)(context, builder, v) for t, v in zip(xs_t, xs_v, strict=True)]
        weights = tuple(
            context.make_array(signature.args[i])(context, builder, args[i]) for i in (3, 4, 5, 10)
        )
        r0, nr_v, outs = args[1], args[2], args[6:10]
        intp = r0.type
        size = builder.extract_value(weights[0].shape, 2)
        end = builder.append_basic_block("k_dot_end")
        switch = builder.switch(builder.add(builder.mul(nr_v, intp(1024)), size), end)
        for kind, nbytes in K_BYTES.items():
            for nr in (1, 2, 3, 4):
                block = builder.append_basic_block(f"{kind}_rows{nr}")
                switch.add_case(intp(nr * 1024 + nbytes), block)
                builder.position_at_end(block)
                _k_rows(builder, kind, nr, integer, xa, weights, r0, outs)
                builder.branch(end)
        builder.position_at_end(end)
        return context.get_dummy_value()

    return make


def _k_dot() -> Any:
    """`k_dot(xp, r, nr, data, d, dmin, o0, o1, o2, o3, ys)`: ys[r + a, b] = x[r + a] . W[o_b] for
    a < nr (1..4) and four K-quant weight rows o_b (see above); xp is quantize_rows' tuple (the
    integer path: INT_DOT only) or float32 x [N, in]. One switch picks the code of (nr, the
    format); each (row, weight row) pair is added in one fixed order whatever nr is. The rows of
    the quadruple two ahead are prefetched, one hint per cache line."""

    @intrinsic
    def dot(typingctx, xp, r, nr, data, d, dmin, o0, o1, o2, o3, ys):  # type: ignore[no-untyped-def]
        sig = types.void(xp, r, nr, data, d, dmin, o0, o1, o2, o3, ys)
        return sig, _k_dot_code(isinstance(xp, types.BaseTuple))

    return dot


k_dot = _k_dot()


def _k_rows(
    builder: ir.IRBuilder, kind: str, nr: int, integer: bool, xa: list[Any], weights: tuple[Any, ...],
    r0: ir.Value, outs: list[ir.Value],
) -> None:  # fmt: skip
    """The code of `_k_dot` for nr rows of x and weights in format `kind`."""
    wd, da, ma, ya = weights
    intp = r0.type
    nbytes = K_BYTES[kind]
    mins = kind != "q6k"
    k = builder.extract_value(xa[0].shape, 1)
    nblocks = builder.extract_value(da.shape, 1)
    row_bytes = builder.mul(nblocks, intp(nbytes))
    groups = builder.mul(nblocks, intp(8))
    lanes = HALF  # integer: two groups' 8 int32 lanes each; float: a group's 16 halves
    vf, vi = ir.VectorType(_F32, lanes), ir.VectorType(_I32, lanes)

    def fn(name: str, t: ir.Type) -> Any:
        return cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t] * 3), name)

    dpbusd, mad = fn("llvm.x86.avx512.vpdpbusd.512", vi), fn(f"llvm.fmuladd.v{lanes}f32", vf)
    mad8 = fn("llvm.fmuladd.v8f32", _V8F)
    acc = [
        [cgutils.alloca_once_value(builder, ir.Constant(vf, [0.0] * lanes)) for _ in range(4)]
        for _ in range(nr)
    ]
    zero8 = ir.Constant(_V8F, [0.0] * 8)  # -(dmin m) sx sums: the integer path's q4k and q5k
    macc = (
        [[cgutils.alloca_once_value(builder, zero8) for _ in range(4)] for _ in range(nr)]
        if integer and mins
        else []
    )
    rows = [builder.add(r0, intp(a)) for a in range(nr)]
    i8p, i16p = _I8.as_pointer(), ir.IntType(16).as_pointer()
    xrows = [builder.gep(xa[0].data, [builder.mul(row, k)]) for row in rows]
    if integer:
        drows = [builder.gep(xa[1].data, [builder.mul(row, groups)]) for row in rows]
        srows = [builder.gep(xa[2].data, [builder.mul(row, groups)]) for row in rows]
        crows = [builder.gep(xa[3].data, [builder.mul(row, builder.mul(groups, intp(8)))]) for row in rows]
    wrows = [builder.gep(builder.bitcast(wd.data, i8p), [builder.mul(ob, row_bytes)]) for ob in outs]
    d_rows = [builder.gep(builder.bitcast(da.data, i16p), [builder.mul(ob, nblocks)]) for ob in outs]
    m_rows = [builder.gep(builder.bitcast(ma.data, i16p), [builder.mul(ob, nblocks)]) for ob in outs]
    ahead = builder.mul(row_bytes, intp(8))  # the same super-block of the rows two quadruples on

    def load(p: ir.Value, t: ir.Type, align: int) -> ir.Value:
        return builder.load(builder.bitcast(p, t.as_pointer()), align=align)

    with cgutils.for_range(builder, nblocks, intp=intp) as loop:
        sb = loop.index
        blks = [builder.gep(row, [builder.mul(sb, intp(nbytes))]) for row in wrows]
        scales = []
        for b in range(4):
            for line in range(0, nbytes, 64):
                _prefetch(builder, builder.gep(blks[b], [builder.add(ahead, intp(line))]))
            d_bits, m_bits = (builder.load(builder.gep(r, [sb])) for r in (d_rows[b], m_rows[b]))
            scales.append(_k_scales(builder, kind, blks[b], d_bits, m_bits, intp))
        g0 = builder.mul(sb, intp(8))
        if integer:
            dx8 = [load(builder.gep(drows[a], [g0]), _V8F, 4) for a in range(nr)]
            dx16 = [_lanes(builder, dx8[a], [i // 2 for i in range(HALF)]) for a in range(nr)]
            # (d sc) dx per 16 inputs, for each (row, weight row) pair once a super-block
            scdx = [[builder.fmul(scales[b][0], dx16[a]) for b in range(4)] for a in range(nr)]
            if mins:  # -(dmin m) sx, a super-block's eight groups at once
                for a in range(nr):
                    sx8 = load(builder.gep(srows[a], [g0]), _V8F, 4)
                    for b in range(4):
                        c = macc[a][b]
                        builder.store(builder.call(mad8, [scales[b][1], sx8, builder.load(c)]), c)
        for g in range(0, 8, 2 if integer else 1):
            gi = builder.add(g0, intp(g))
            xp = [builder.gep(xrows[a], [builder.mul(gi, intp(GROUP))]) for a in range(nr)]
            if integer:  # groups g and g + 1
                xs = [builder.bitcast(load(p, ir.VectorType(_I8, 2 * GROUP), 1), vi) for p in xp]
                if mins:
                    cs = [ir.Constant(vi, [0] * lanes)] * nr
                else:
                    two = ir.Constant(vi, [2] * lanes)
                    cs = [
                        builder.ashr(load(builder.gep(crows[a], [builder.mul(gi, intp(8))]), vi, 4), two)
                        for a in range(nr)
                    ]
            else:
                xs = [(load(p, _V16F, 4), load(builder.gep(p, [intp(HALF)]), _V16F, 4)) for p in xp]
            for b in range(4):
                q = _k_levels(builder, kind, blks[b], g, integer, intp)
                dsc = scales[b][0]
                if integer:
                    w = builder.bitcast(q, vi)
                    for a in range(nr):
                        total = builder.sitofp(builder.call(dpbusd, [cs[a], w, xs[a]]), vf)
                        sc = _lanes(builder, scdx[a][b], [2 * g + i // 4 for i in range(HALF)])
                        c = acc[a][b]
                        builder.store(builder.call(mad, [total, sc, builder.load(c)]), c)
                    continue
                ws = []
                for h in (0, 1):
                    part = _lanes(builder, q, list(range(h * HALF, (h + 1) * HALF)))
                    scale = _lanes(builder, dsc, [2 * g + h] * HALF)
                    if mins:
                        assert scales[b][1] is not None
                        low = _lanes(builder, scales[b][1], [g] * HALF)
                        ws.append(builder.fsub(builder.fmul(builder.uitofp(part, _V16F), scale), low))
                    else:
                        centred = builder.sub(part, ir.Constant(_V16B, [32] * HALF))
                        ws.append(builder.fmul(builder.sitofp(centred, _V16F), scale))
                for a in range(nr):
                    c = acc[a][b]
                    v = builder.call(mad, [xs[a][0], ws[0], builder.load(c)])
                    builder.store(builder.call(mad, [xs[a][1], ws[1], v]), c)
    for a in range(nr):
        yrow = builder.gep(ya.data, [builder.mul(rows[a], intp(4))])
        for b in range(4):
            total = _hsum8(builder, builder.load(acc[a][b]), lanes)
            if integer and mins:
                total = builder.fsub(total, _hsum8(builder, builder.load(macc[a][b])))
            builder.store(total, builder.gep(yrow, [intp(b)]))


@njit(cache=True, nogil=True, boundscheck=False, fastmath=False)
def k_tile(  # pragma: no cover (compiled)
    xp: Any, n: int, data: np.ndarray, d: np.ndarray, dmin: np.ndarray, y: np.ndarray, t: int
) -> None:
    """Rows [t QTILE, (t + 1) QTILE) of y [N, out] = x W^T for a K-quant W (data uint8 [out, n,
    bytes], d and dmin float16 bits [out, n]; q6k's dmin: any [out, n] array, unused) and x as
    quantize_rows gives it (the integer path) or float32 [N, in]: four weight rows at a time, in
    passes of up to four x rows."""
    out = data.shape[0]
    ys = np.empty((n, 4), np.float32)
    for o in range(t * QTILE, min(out, (t + 1) * QTILE), 4):
        o1, o2, o3 = min(o + 1, out - 1), min(o + 2, out - 1), min(o + 3, out - 1)
        for r in range(0, n, 4):
            k_dot(xp, r, min(4, n - r), data, d, dmin, o, o1, o2, o3, ys)
        for b in range(min(4, out - o)):
            for rr in range(n):
                y[rr, o + b] = ys[rr, b]


def prepare(x: np.ndarray, w: Any) -> Any:
    """The input of `tile` for x [N, in] float32 and weight `w`: x itself, or for a packed weight on
    a CPU with the integer path, `quantize_rows(x)` (compiled only)."""
    raise NotImplementedError("compiled only")


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


STACK = 9  # `_packed`'s kind of a stacked weight: a tuple of 2 or 3 packed tuples (StackedLinear)


def _packed(w) -> int:  # type: ignore[no-untyped-def]
    """0 for a float weight array, 2 for an int8 tuple, 3 for a q4 tuple, 5 for a q5 tuple (q4's and
    the high bits), 6 for a K-quant tuple (3-D uint8 data, d and for q4k and q5k dmin), STACK for a
    tuple of 2 or 3 of those, -1 otherwise."""
    if isinstance(w, types.Array):
        return 0
    if not isinstance(w, types.BaseTuple) or len(w) not in (2, 3, 4):
        return -1
    if len(w) in (2, 3) and all(_packed(p) in (2, 3, 5, 6) for p in w.types):
        return STACK
    if not all(isinstance(a, types.Array) for a in w.types):
        return -1
    if w.types[0].ndim == 3:
        return 6 if len(w) in (2, 3) else -1
    return 5 if len(w) == 4 else len(w)


@overload(tiles)
def _tiles(w):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    kind = _packed(w)
    if kind == STACK and len(w) == 2:
        return lambda w: tiles(w[0]) + tiles(w[1])
    if kind == STACK:
        return lambda w: tiles(w[0]) + tiles(w[1]) + tiles(w[2])
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
    if kind == 6 and isinstance(x, types.BaseTuple):  # (q6k's d stands in for its absent dmin)
        if len(w) == 2:
            return lambda x, w, y, t: k_tile(x, x[0].shape[0], w[0], w[1], w[1], y, t)
        return lambda x, w, y, t: k_tile(x, x[0].shape[0], w[0], w[1], w[2], y, t)
    if kind == 6:
        if len(w) == 2:
            return lambda x, w, y, t: k_tile(x, x.shape[0], w[0], w[1], w[1], y, t)
        return lambda x, w, y, t: k_tile(x, x.shape[0], w[0], w[1], w[2], y, t)
    if isinstance(x, types.BaseTuple):  # quantize_rows' output: the integer path
        if kind == 2:  # (scales stand in for the unused mins and high)
            return lambda x, w, y, t: int_tile(x[0], x[1], x[2], x[3], w[0], w[1], w[1], w[1], y, t)
        if kind == 3:
            return lambda x, w, y, t: int_tile(x[0], x[1], x[2], x[3], w[0], w[1], w[2], w[1], y, t)
        if kind == 5:
            return lambda x, w, y, t: int_tile(x[0], x[1], x[2], x[3], w[0], w[1], w[2], w[3], y, t)
        return None
    if kind == 2:
        return lambda x, w, y, t: packed_tile(x, w[0], w[1], w[1], w[1], y, t)
    if kind == 3:
        return lambda x, w, y, t: packed_tile(x, w[0], w[1], w[2], w[1], y, t)
    if kind == 5:
        return lambda x, w, y, t: packed_tile(x, w[0], w[1], w[2], w[3], y, t)
    return None


@overload(prepare)
def _prepare(x, w):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    if _packed(w) in (3, 5, 6) and INT_DOT:  # q4, q5, K-quants: x rounded to int8
        return lambda x, w: quantize_rows(x)
    if _packed(w) == 2 and INT_DOT:  # int8: to int16 (docs/engine-quant.md says why)
        return lambda x, w: quantize_rows16(x)
    return lambda x, w: x


@overload(rows_of)
def _rows_of(w):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    kind = _packed(w)
    if kind == STACK and len(w) == 2:
        return lambda w: rows_of(w[0]) + rows_of(w[1])
    if kind == STACK:
        return lambda w: rows_of(w[0]) + rows_of(w[1]) + rows_of(w[2])
    if kind == 0:
        return lambda w: w.shape[0]
    if kind > 0:
        return lambda w: w[0].shape[0]
    return None


@overload(cols_of)
def _cols_of(w):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    kind = _packed(w)
    if kind == STACK:
        return lambda w: cols_of(w[0])
    if kind == 0:
        return lambda w: w.shape[1]
    if kind == 2:
        return lambda w: w[0].shape[1]
    if kind in (3, 5):
        return lambda w: w[0].shape[1] * 2
    if kind == 6:
        return lambda w: w[0].shape[1] * SUPER
    return None


def run(x: np.ndarray, w: Any, y: np.ndarray) -> None:
    """y [N, out] = x [N, in] w^T for a weight of any format, a stacked one included, as one
    parallel loop over its tasks where the caller is parallel (inlined: compiled only)."""
    raise NotImplementedError("compiled only")


@overload(run, inline="always")
def _run(x, w, y):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    kind = _packed(w)
    if kind == STACK and len(w) == 2:  # each part's own tasks, its own columns of y
        # (the parts go into the loop one by one: a tuple of tuples cannot cross into a parallel one)

        def two(x, w, y):  # type: ignore[no-untyped-def]
            w0, w1 = w[0], w[1]
            r0 = rows_of(w0)
            x0, x1, y0, y1 = prepare(x, w0), prepare(x, w1), y[:, :r0], y[:, r0:]
            t0 = tiles(w0)
            for t in prange(t0 + tiles(w1)):
                if t < t0:
                    tile(x0, w0, y0, t)
                else:
                    tile(x1, w1, y1, t - t0)

        return two
    if kind == STACK:

        def three(x, w, y):  # type: ignore[no-untyped-def]
            w0, w1, w2 = w[0], w[1], w[2]
            r0 = rows_of(w0)
            r1 = r0 + rows_of(w1)
            x0, x1, x2 = prepare(x, w0), prepare(x, w1), prepare(x, w2)
            y0, y1, y2 = y[:, :r0], y[:, r0:r1], y[:, r1:]
            t0 = tiles(w0)
            t1 = t0 + tiles(w1)
            for t in prange(t1 + tiles(w2)):
                if t < t0:
                    tile(x0, w0, y0, t)
                elif t < t1:
                    tile(x1, w1, y1, t - t0)
                else:
                    tile(x2, w2, y2, t - t1)

        return three

    def one(x, w, y):  # type: ignore[no-untyped-def]
        xp = prepare(x, w)
        for t in prange(tiles(w)):
            tile(xp, w, y, t)

    return one


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def product(x: np.ndarray, w: Any, y: np.ndarray) -> None:  # pragma: no cover
    """y = x w^T with x as block_step gives it to the weight's format (`prepare`)."""
    run(x, w, y)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def float_product(x: np.ndarray, w: Any, y: np.ndarray) -> None:  # pragma: no cover
    """y = x w^T with x in floats (weights decoded to float32), whatever the CPU."""
    for t in prange(tiles(w)):
        tile(x, w, y, t)


@njit(parallel=True, cache=True, boundscheck=False, nogil=True)
def rounded_product(x: np.ndarray, w: Any, y: np.ndarray) -> None:  # pragma: no cover
    """y = x w^T with x rounded to int8 groups (`quantize_rows`), integer products: INT_DOT only."""
    xp = quantize_rows(x)
    for t in prange(tiles(w)):
        tile(xp, w, y, t)


def warm_up() -> None:
    """Compile the packed products (or load them from numba's disk cache) on tiny arrays."""
    x = np.ones((1, GROUP), np.float32)
    y = np.empty((1, 2), np.float32)
    scales = np.zeros((2, 1), np.uint16)
    q4 = (np.zeros((2, HALF), np.uint8), scales, scales)
    x_k = np.ones((1, SUPER), np.float32)
    q6k = (np.zeros((2, 1, Q6K_BYTES), np.uint8), scales)
    q4k = (np.zeros((2, 1, Q4K_BYTES), np.uint8), scales, scales)
    for xs, w in (
        (x, (np.zeros((2, GROUP), np.int8), scales)),
        (x, q4),
        (x, (*q4, np.zeros((2, GROUP // 8), np.uint8))),
        (x_k, q6k),
        (x_k, q4k),
    ):
        product(xs, w, y)
        float_product(xs, w, y)
        if INT_DOT:
            rounded_product(xs, w, y)
