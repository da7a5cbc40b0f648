"""Products of a few rows with a large fp32 or bf16 weight on the CPU, at close to the memory bandwidth.

A decode step multiplies a few hidden rows (one per request in the batch) by every weight matrix
once, so its cost is reading the weights. torch's CPU products (MKL, oneDNN) pack the weight for
a general matrix product first and, measured on this project's AMD EPYC CI machine with two
threads, read it at 6-14 GB/s for one row and 2-5 GB/s for two to eight rows, against 17 GB/s for
a plain streaming read. This kernel reads each weight row once from memory for up to four input
rows at a time (three without AVX-512), held in registers, and prefetches them ahead of its loads
in that pass, so one row streams at 12-22 GB/s and a product of two rows costs 2-4% more than
one on the Xeon and 10-17% on AMD Zen 4, of four rows 4-13% and 11-19% (`benchmarks/products.py`;
figures in docs/engine.md): batching decode steps of several users then costs little more than
one.

Each output element is one dot product whose order of additions is written out (`_vector_dot`)
and depends only on `in`, never on how many rows are in the call, so a request's result is
bit-identical alone or in a batch.

bf16 weights are read as their uint16 bits and widened to float32 row by row (exact), so they
cost half the memory traffic; arithmetic is float32. `LlamaModel` sends its products here on the
CPU in fp32 and bf16 up to `llama.KERNEL_ROWS` rows: decode steps, and prefill chunks too, whose
weights also stream from memory once per chunk (there the kernel beats torch's packed product up
to 128 rows in fp32 and at every size in bf16, benchmarks/products.py). Compiled by numba on first
use (a few seconds) and cached on disk afterwards. numba keys a cached function on its own file
only, and decode_cpu's kernels compile this file's code into theirs: `decode_cpu.FEW_ROWS_SHA256`
names this file's contents, so a change here edits decode_cpu.py too and both recompile (a test
checks it). Threads: numba's pool, sized by NUMBA_NUM_THREADS, which `kafila.engine.backend` sets
to the usable CPUs before the first import.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from llvmlite import binding as llvm
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from kafila.models.torch import cpu_kernels

TILE = 8  # quadruples of output rows per parallel task


def numpy_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as numpy, no copy: float32 as float32, bfloat16 as its uint16 bits."""
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


@intrinsic
def bits_to_f32(typingctx, bits):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    """The float32 whose bit pattern is the uint32 `bits` (an LLVM bitcast, vectorisable)."""

    def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


def at(w: np.ndarray, o: int, i: int) -> float:
    """w[o, i] as float32, for a float32 or bfloat16-bits 2-D array (compiled: see the overload)."""
    raise NotImplementedError("compiled only")


@overload(at, jit_options={"fastmath": True})
def _at(w, o, i):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    if w.dtype == types.float32:
        return lambda w, o, i: w[o, i]
    if w.dtype == types.uint16:  # bfloat16 bits: the high half of a float32, widened exactly
        return lambda w, o, i: bits_to_f32(np.uint32(w[o, i]) << np.uint32(16))
    return None


@njit(cache=True, nogil=True)
def bf16_bits(b: np.uint32) -> np.uint32:  # pragma: no cover (compiled)
    """The bfloat16 nearest (ties to even, as torch rounds) to the float32 with bits `b`, as its bits."""
    return (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


def store_row(dst: np.ndarray, j: int, src: np.ndarray) -> None:
    """dst[j] = src (float32), rounded to nearest even when dst holds bfloat16 bits (compiled)."""
    raise NotImplementedError("compiled only")


@overload(store_row, jit_options={"fastmath": True})
def _store_row(dst, j, src):  # type: ignore[no-untyped-def]  # pragma: no cover (compiled)
    if dst.dtype == types.float32:

        def copy(dst, j, src):  # type: ignore[no-untyped-def]
            for i in range(src.shape[0]):
                dst[j, i] = src[i]

        return copy
    if dst.dtype == types.uint16:

        def narrow(dst, j, src):  # type: ignore[no-untyped-def]
            bits = src.view(np.uint32)
            for i in range(src.shape[0]):
                dst[j, i] = np.uint16(bf16_bits(bits[i]))

        return narrow
    return None


@njit(cache=True, nogil=True)
def tiles(w: np.ndarray) -> int:  # pragma: no cover (compiled)
    """Parallel tasks of a product with w: TILE quadruples of output rows each."""
    return ((w.shape[0] + 3) // 4 + TILE - 1) // TILE


def vector_lanes(features: dict[str, bool]) -> int:
    """float32 lanes of the dot products' vectors on a CPU with these LLVM features by default: 16
    (one 512-bit register) where it has AVX-512F, 8 otherwise (AVX2's 256 bits; LLVM splits a vector
    where registers are narrower, as on ARM's 128-bit NEON). The width sets the order of each dot
    product's additions, so the bits of a product depend on it: every row of a call, alone or in
    a batch, uses the same width on one machine."""
    return cpu_kernels.supported(features)[0].lanes


# The path in force ($KAFILA_CPU_KERNELS, else the CPU's own): 8 lanes runs on any CPU, so a CPU
# with AVX-512 can run the width an AVX2 machine computes with. numba's cache is keyed on the host
# CPU, and cpu_kernels gives a forced path a cache folder of its own.
VF = cpu_kernels.PATH.lanes
_F32, _I16, _I32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)


def _lanes(t: ir.Type, n: int) -> ir.Type:
    return ir.VectorType(t, n) if n > 1 else t


def _row(builder: ir.IRBuilder, array: Any, index: ir.Value) -> ir.Value:
    """Pointer to array[index, 0] of a C-contiguous 2-D array."""
    return builder.gep(array.data, [builder.mul(index, builder.extract_value(array.shape, 1))])


def _load(builder: ir.IRBuilder, p: ir.Value, n: int, bf16: bool) -> ir.Value:
    """n floats (a vector, or one float for n = 1) from p: float32, or bfloat16 bits widened exactly."""
    if not bf16:
        return builder.load(builder.bitcast(p, _lanes(_F32, n).as_pointer()), align=4)
    bits = builder.load(builder.bitcast(p, _lanes(_I16, n).as_pointer()), align=2)
    wide = builder.zext(bits, _lanes(_I32, n))  # the high half of a float32
    return builder.bitcast(
        builder.shl(wide, ir.Constant(_lanes(_I32, n), [16] * n if n > 1 else 16)), _lanes(_F32, n)
    )


@dataclass(frozen=True)
class Prefetch:
    """How a first pass prefetches each weight row (`llvm.prefetch`, for reading): `fp32[n - 1]`
    (`bf16[n - 1]` for bfloat16 weights) bytes ahead of the vector step in a pass of n x rows
    (1-4), into the cache level `locality` names (3: every level, L1 included; 2: L2 and further
    out)."""

    fp32: tuple[int, int, int, int]
    bf16: tuple[int, int, int, int]
    locality: int

    def bytes_ahead(self, rows: int, bf16: bool) -> int:
        return (self.bf16 if bf16 else self.fp32)[rows - 1]


def prefetch_for(cpu: str) -> Prefetch:
    """The prefetch measured best on a CPU that LLVM names `cpu` (benchmarks/products.py).

    The CPU's own prefetchers stream a row product of one input row at close to the memory
    bandwidth, but with two to four rows in the pass (more arithmetic between loads) they fall
    behind. On the project's 2-vCPU Xeon (Emerald Rapids; one thread, 30 blocks of the default
    model's shapes, 425 MB in fp32) two rows cost +8-9% over one without a prefetch and +2-3.5%
    with 384-1024 bytes ahead into L1, four rows +24-25% and +11-14% (2048 bytes: slower); bf16's
    one row 12% faster. On AMD Zen 4 (EPYC, 2 vCPUs) that L1 prefetch made fp32 products slower
    than none (1.05-1.19x at 1-8 rows); into L2 is faster there, and how far ahead depends on the
    rows in the pass and the dtype, measured side by side in one process (docs/engine.md, "Prefetch
    distance per pass, weights on huge pages"). fp32: 1024 bytes for passes of one to three rows
    (flat from 384 to 1024; 2048 cost +6% for one row, +13-21% for two, +6-8% for three), 2048
    for the four-row pass (1024: +12%; 2048-4096 level). bf16: 1024 for one and two rows
    (2048: +5-11%), 2048 for three and four (1024: +26% and +28%). Other CPUs keep the Xeon's
    setting. numba keys its disk cache on the host CPU, so a kernel compiled with one setting never
    runs on another."""
    if cpu.startswith("znver"):
        return Prefetch(fp32=(1024, 1024, 1024, 2048), bf16=(1024, 1024, 2048, 2048), locality=2)
    return Prefetch(fp32=(512,) * 4, bf16=(512,) * 4, locality=3)


# A prefetch reads past the row's end into the next one, or past the array (it never faults).
PREFETCH = prefetch_for(llvm.get_host_cpu_name())


def _prefetch(builder: ir.IRBuilder, p: ir.Value) -> None:
    """A hint to bring the cache line holding `p` closer (no load, no fault)."""
    i8p = ir.IntType(8).as_pointer()
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, _I32, _I32, _I32]), "llvm.prefetch.p0i8"
    )
    locality = _I32(PREFETCH.locality)
    builder.call(fn, [builder.bitcast(p, i8p), _I32(0), locality, _I32(1)])  # read, locality, data


def _lanes_sum(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """The VF lanes of v added in one fixed tree, halving: for VF = 8, ((0+4)+(2+6)) + ((1+5)+(3+7))."""
    for n in [VF >> s for s in range(1, VF.bit_length())]:  # VF/2, VF/4, ..., 1
        lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n))))
        hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, n), list(range(n, 2 * n))))
        v = builder.fadd(lo, hi)
    return builder.extract_element(v, _I32(0))


def _vector_dot(nr: int, prefetch: bool):  # type: ignore[no-untyped-def]
    """A compiled intrinsic `dot(x, r, w, o0, o1, o2, o3, y)`: y[r + a, o] = x[r + a] . w[o] for
    a < nr and the four weight rows o, in one pass over the inputs, each weight row read once for
    all nr rows (four memory streams at once); with `prefetch`, for the pass that reads them from memory.

    Written as LLVM IR so that the order of every dot product's additions is spelled out: each
    (row, weight row) pair accumulates in its own VF-lane vector by multiply-adds over the input in
    order (`llvm.fmuladd`: fused where the CPU has FMA), a scalar tail takes `in % VF`, and the lanes
    are added in one fixed tree. No fast-math flags, so LLVM may not reorder them: y[r, o] comes out
    the same bits whichever nr computed it and whichever weight rows shared the pass, that is,
    whatever else is in the batch. (With fast-math, LLVM chose its own interleaving per loop, so one
    loop had to compute every row, and rows after the first re-read the weights from L1 one by one:
    a second row cost 8-16% of the first, here 2-9%.)
    With `prefetch` each vector step also prefetches the weight rows as `PREFETCH` says (see
    `prefetch_for`); that moves no arithmetic, so the bits are the same with it and without."""
    vec = ir.VectorType(_F32, VF)

    @intrinsic
    def dot(typingctx, x, r, w, o0, o1, o2, o3, y):  # type: ignore[no-untyped-def]
        if not all(isinstance(a, types.Array) and a.layout == "C" and a.ndim == 2 for a in (x, w, y)):
            return None  # contiguous rows only: row r starts at data + r * shape[1]
        bf16 = w.dtype == types.uint16

        def codegen(context, builder, signature, args):  # type: ignore[no-untyped-def]
            xa, wa, ya = (context.make_array(signature.args[i])(context, builder, args[i]) for i in (0, 2, 7))
            r0, outs = args[1], args[3:7]
            intp = r0.type
            k = builder.extract_value(xa.shape, 1)
            mad = [
                cgutils.get_or_insert_function(
                    builder.module, ir.FunctionType(t, [t] * 3), f"llvm.fmuladd.{name}"
                )
                for t, name in ((vec, f"v{VF}f32"), (_F32, "f32"))
            ]
            xs = [_row(builder, xa, builder.add(r0, intp(a))) for a in range(nr)]
            ws = [_row(builder, wa, o) for o in outs]
            zero = (ir.Constant(vec, [0.0] * VF), ir.Constant(_F32, 0.0))
            acc = [[[cgutils.alloca_once_value(builder, z) for z in zero] for _ in ws] for _ in xs]

            ahead = intp(PREFETCH.bytes_ahead(nr, bf16) // (2 if bf16 else 4))  # in weight elements

            def accumulate(i: ir.Value, lanes: int) -> None:  # acc[a][b] += x[a][i:i+lanes] * w[b][...]
                slot = 0 if lanes > 1 else 1
                if prefetch and lanes > 1:
                    for wp in ws:
                        _prefetch(builder, builder.gep(wp, [builder.add(i, ahead)]))
                xv = [_load(builder, builder.gep(p, [i]), lanes, False) for p in xs]
                for b, wp in enumerate(ws):
                    wv = _load(builder, builder.gep(wp, [i]), lanes, bf16)
                    for a in range(nr):
                        cell = acc[a][b][slot]
                        builder.store(builder.call(mad[slot], [xv[a], wv, builder.load(cell)]), cell)

            body = builder.mul(builder.udiv(k, intp(VF)), intp(VF))
            with cgutils.for_range_slice(builder, intp(0), body, intp(VF), intp) as (i, _):
                accumulate(i, VF)
            with cgutils.for_range_slice(builder, body, k, intp(1), intp) as (i, _):
                accumulate(i, 1)
            for a in range(nr):
                yp = _row(builder, ya, builder.add(r0, intp(a)))
                for b, o in enumerate(outs):
                    vsum, tail = (builder.load(cell) for cell in acc[a][b])
                    builder.store(builder.fadd(_lanes_sum(builder, vsum), tail), builder.gep(yp, [o]))
            return context.get_dummy_value()

        return types.void(x, r, w, o0, o1, o2, o3, y), codegen

    return dot


# The first pass over four weight rows reads them from memory (prefetching) for up to four x rows
# where the CPU has 32 vector registers (AVX-512: 16 accumulators + 4 x + 4 w vectors; AVX2's 16
# registers would spill), three otherwise; later passes read the weight rows from the L1 cache
# three x rows at a time (12 accumulators), then two or one. One pass of four instead of three
# and one: 4-8 rows 8-15% faster on AMD Zen 4, 19 rows 4% (docs/engine.md); later passes of four
# were slower for prefill-sized calls on the Xeon (docs/benchmarks.md, "Tried and rejected").
FIRST_ROWS = 4 if VF == 16 else 3
_dot_3, _dot_2, _dot_1 = _vector_dot(3, False), _vector_dot(2, False), _vector_dot(1, False)
_first_4, _first_3 = _vector_dot(4, True), _vector_dot(3, True)
_first_2, _first_1 = _vector_dot(2, True), _vector_dot(1, True)


@njit(cache=True, boundscheck=False, nogil=True, fastmath=False)  # set: see the docstring's end
def product_tile(  # pragma: no cover (compiled)
    x: np.ndarray, w: np.ndarray, y: np.ndarray, tile: int, prefetch: bool = True
) -> None:
    """One parallel task of y = x w^T (see `_product`): output rows o in [tile * TILE, (tile + 1) *
    TILE) of the first quarter together with rows o + q, o + 2q, o + 3q (q = out / 4), four memory
    streams at once (measured against two: 15-35% faster for one x row, 20-60% for four in fp32,
    10-18% for one row in bf16), each read from memory once for the first `FIRST_ROWS` x rows and
    from L1 for three at a time after them (`_vector_dot`: the bits of a row's result do not
    depend on which rows share the pass). The first pass over four weight rows prefetches them
    (`prefetch=False`: no prefetch and passes of three, for benchmarks/products.py's comparison).
    Compiled callers run `for tile in prange(tiles(w))`: a cached function must not call another
    parallel function (numba's cache then crashes on load), so the loop is written where it runs.
    `fastmath=False` is written out because numba compiles a function that does not set it with its
    caller's: under `_product`'s and `block_step`'s fast-math the scalar tail (`in % VF`) and the
    lanes' sum could be reordered differently in each pass variant, and on AMD Zen 4 a row from a
    pass of one came out 1-2 ulps off the same row from a pass of three (widths not divisible by
    16; tests/models/test_decode_cpu.py)."""
    n = x.shape[0]
    out = w.shape[0]
    q = (out + 3) // 4
    for o in range(tile * TILE, min(q, (tile + 1) * TILE)):
        # the last quadruple of an `out` not divisible by 4 repeats row o for the rows past the end
        # (the same dot product written twice: the same bits)
        o1 = o + q if o + q < out else o
        o2 = o + 2 * q if o + 2 * q < out else o
        o3 = o + 3 * q if o + 3 * q < out else o
        r = 0
        if prefetch and n >= 4 and FIRST_ROWS == 4:
            _first_4(x, 0, w, o, o1, o2, o3, y)
            r = 4
        elif prefetch and n >= 3:
            _first_3(x, 0, w, o, o1, o2, o3, y)
            r = 3
        elif prefetch and n == 2:
            _first_2(x, 0, w, o, o1, o2, o3, y)
            r = 2
        elif prefetch and n == 1:
            _first_1(x, 0, w, o, o1, o2, o3, y)
            r = 1
        while n - r >= 3:
            _dot_3(x, r, w, o, o1, o2, o3, y)
            r += 3
        if n - r == 2:
            _dot_2(x, r, w, o, o1, o2, o3, y)
        elif n - r == 1:
            _dot_1(x, r, w, o, o1, o2, o3, y)


@njit(parallel=True, fastmath=True, cache=True, boundscheck=False, nogil=True)
def _product(x: np.ndarray, w: np.ndarray, y: np.ndarray, prefetch: bool) -> None:  # pragma: no cover
    """y[r, o] = sum_i x[r, i] w[o, i] for x [N, in] and y [N, out] float32, w [out, in] float32 or
    bfloat16 bits (widened as they are read)."""
    for tile in prange(tiles(w)):
        product_tile(x, w, y, tile, prefetch)


def linear(x: torch.Tensor, w: torch.Tensor, prefetch: bool = True) -> torch.Tensor:
    """x [N, in] @ w[out, in]^T -> [N, out] in x's dtype: CPU, fp32 or bf16, w contiguous, few rows."""
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)  # [N, out]
    _product(x.float().contiguous().numpy(), numpy_view(w), y.numpy(), prefetch)
    return y.to(x.dtype)
