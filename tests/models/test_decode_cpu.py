"""The fused CPU decode step (kafila.models.torch.decode_cpu) against the torch block code.

Two stages of the same tiny model, one taking the fused path and one forced onto torch's ops,
prefill three requests of different lengths and then decode them together at different positions
(and in a batch of one): the hidden states agree to 1e-5 of their scale at every step, and a
request decodes bit-identically alone or batched on the fused path.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from kafila.engine.backend import TorchBackend
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from tests.tiny_models import SHAPES


def cpu(dtype: str) -> TorchBackend:
    """The CPU, where these kernels run, also on a machine with a CUDA card (where "torch" is the card)."""
    return TorchBackend("torch", "cpu", dtype)


PROMPTS = {"a": [5, 17, 200, 33], "b": [9, 1, 250, 64, 7, 99, 128], "c": [42]}


def _stage(path, fused: bool, dtype: str = "fp32") -> Stage:
    ckpt = Checkpoint.open(path)
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend=cpu(dtype), dtype=dtype, context=32, concurrency=3
    )
    assert stage.model.fused_decode  # fp32 and bf16 on the CPU take the fused path by default
    stage.model.fused_decode = fused
    return stage


def _decode(stage: Stage, steps: int, together: bool, greedy: bool = True) -> dict[str, list[np.ndarray]]:
    """Prefill every prompt, then `steps` decode steps (greedy, or fixed tokens when not `greedy`,
    so that two dtypes see the same inputs); hidden rows per request per step."""
    out: dict[str, list[np.ndarray]] = {rid: [] for rid in PROMPTS}
    last, pos = {}, {}
    for rid, prompt in PROMPTS.items():
        stage.open(rid)
        [h] = stage.forward([(rid, 0, stage.embed(prompt))])
        last[rid], pos[rid] = int(stage.logits(h[-1:]).argmax()), len(prompt)
    for _ in range(steps):
        groups = [list(PROMPTS)] if together else [[rid] for rid in PROMPTS]
        for group in groups:
            hidden = stage.forward([(rid, pos[rid], stage.embed([last[rid]])) for rid in group])
            for rid, h in zip(group, hidden, strict=True):
                out[rid].append(h.float().numpy().copy())
                greedy_token = int(stage.logits(h).argmax())
                last[rid], pos[rid] = greedy_token if greedy else (7 * pos[rid]) % 200, pos[rid] + 1
    for rid in PROMPTS:
        stage.close(rid)
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_decode_matches_the_torch_block_code(tiny_checkpoint, shape: str) -> None:
    path = tiny_checkpoint(shape)
    fused = _decode(_stage(path, fused=True), steps=6, together=True)
    torch_ops = _decode(_stage(path, fused=False), steps=6, together=True)
    for rid in PROMPTS:
        for ours, ref in zip(fused[rid], torch_ops[rid], strict=True):
            scale = np.abs(ref).max()  # hidden states grow through the blocks (here up to ~30)
            assert scale > 0.1
            np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("shape", ["llama-gqa3-tied", "qwen3-gqa2-untied"])
def test_bf16_fused_decode_strays_from_fp32_no_more_than_the_torch_block_code(
    tiny_checkpoint, shape: str
) -> None:
    """bf16 computes in float32 between roundings of the residual stream, torch's ops round after
    every op: against fp32, the fused path's error is at most the torch path's."""
    path = tiny_checkpoint(shape)
    run = {
        name: _decode(_stage(path, fused=fused, dtype=dtype), steps=4, together=True, greedy=False)
        for name, fused, dtype in [("fused", True, "bf16"), ("torch", False, "bf16"), ("fp32", True, "fp32")]
    }

    def error(name: str) -> float:
        return max(
            float(np.abs(a - ref).max())
            for rid in PROMPTS
            for a, ref in zip(run[name][rid], run["fp32"][rid], strict=True)
        )

    assert 0 < error("fused") <= error("torch")


def test_bf16_fused_decode_does_not_depend_on_the_division(tiny_checkpoint) -> None:
    """The residual stream is rounded to bf16 after every block, as it is on the wire between
    members, so one stage of five blocks equals stages of two and three blocks, bit for bit."""
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3-gqa2-untied"))

    def load(blocks: range, head: bool) -> Stage:
        return Stage.load(ckpt, blocks, head, backend=cpu("bf16"), dtype="bf16", context=32, concurrency=1)

    whole, first, second = load(range(5), True), load(range(2), True), load(range(2, 5), False)
    prompt, token = PROMPTS["b"], 3
    for s in (whole, first, second):
        s.open("r")
    [a] = whole.forward([("r", 0, whole.embed(prompt))])
    [b] = second.forward([("r", 0, first.forward([("r", 0, first.embed(prompt))])[0])])
    for pos in range(len(prompt), len(prompt) + 4):
        [a] = whole.forward([("r", pos, whole.embed([token]))])
        [h] = first.forward([("r", pos, first.embed([token]))])
        [b] = second.forward([("r", pos, second.from_bytes(first.to_bytes(h), h.shape))])
        assert np.array_equal(np.asarray(whole.to_bytes(a)), np.asarray(second.to_bytes(b)))
        token = int(whole.logits(a).argmax())


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_decode_is_bit_identical_alone_or_batched(tiny_checkpoint, dtype: str) -> None:
    path = tiny_checkpoint("qwen3-gqa2-untied")
    batched = _decode(_stage(path, fused=True, dtype=dtype), steps=5, together=True)
    alone = _decode(_stage(path, fused=True, dtype=dtype), steps=5, together=False)
    for rid in PROMPTS:
        for a, b in zip(batched[rid], alone[rid], strict=True):
            assert np.array_equal(a, b)


def test_compiled_kernels_load_from_numba_cache_in_fresh_processes() -> None:
    """A cached function that calls another parallel function crashes numba on load from its disk
    cache (seen as a segfault in every member after the first): the kernels are written so that it
    cannot happen. Two fresh processes in turn: the first may compile, the second loads."""
    code = "from kafila.models.torch import decode_cpu; decode_cpu.warm_up(); print('warm')"
    for _ in range(2):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
        assert done.returncode == 0 and "warm" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("inner", [40, 43])
@pytest.mark.parametrize("out", [1, 2, 3, 5, 7, 13, 70, 257])
@pytest.mark.parametrize("rows", [1, 2, 3, 16, 64])
def test_few_row_product_equals_torch_for_any_output_width(out: int, rows: int, inner: int) -> None:
    """The kernel takes output rows four at a time; a width not divisible by four repeats the last
    quadruple's first row for the rows past the end. It reads the input VF (8 or 16) at a time; an
    input width not divisible by VF ends one by one (40 and 43 leave tails at either width)."""
    import torch

    from kafila.models.torch import few_rows

    gen = torch.Generator().manual_seed(out * 100 + rows + inner)
    x, w = torch.randn(rows, inner, generator=gen), torch.randn(out, inner, generator=gen)
    torch.testing.assert_close(few_rows.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)
    xb, wb = x.bfloat16(), w.bfloat16()
    ref = (xb.float() @ wb.float().T).bfloat16()  # float32 products of the bf16 values, rounded once
    torch.testing.assert_close(few_rows.linear(xb, wb), ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_rows_product_is_the_same_bits_whatever_else_is_in_the_call(dtype: str) -> None:
    """The kernel takes input rows four at a time (three without AVX-512), then three, two or one: a
    row's result is the same bits whether it was computed alone or in any place of a group, in any
    batch size (widths not divisible by four or eight included)."""
    import torch

    from kafila.models.torch import few_rows

    gen = torch.Generator().manual_seed(11)
    w = torch.randn(13, 43, generator=gen).to(getattr(torch, dtype))
    x = torch.randn(9, 43, generator=gen)  # [9, in] float32 (a bf16 step widens its rows too)
    every = few_rows.linear(x, w)  # [9, 13]: rows in groups (0, 1, 2, 3), (4, 5, 6), (7, 8)
    for a in range(9):
        for b in range(a + 1, 10):  # rows [a, b) on their own: each lands elsewhere in a group
            assert torch.equal(few_rows.linear(x[a:b], w), every[a:b]), (a, b)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_weight_prefetch_changes_no_bits(dtype: str) -> None:
    """The first pass's prefetch (as this CPU has it, few_rows.PREFETCH) moves data, not arithmetic:
    with it and without, every row count gives the same bits (widths with and without a tail)."""
    import torch

    from kafila.models.torch import few_rows

    gen = torch.Generator().manual_seed(12)
    for inner in (43, 576):
        w = torch.randn(37, inner, generator=gen).to(getattr(torch, dtype))
        for rows in range(1, 8):
            x = torch.randn(rows, inner, generator=gen)
            with_it, without = few_rows.linear(x, w), few_rows.linear(x, w, prefetch=False)
            assert torch.equal(with_it, without), (inner, rows)


def test_the_prefetch_is_the_one_measured_for_the_cpu() -> None:
    """AMD Zen (LLVM's `znver*`) prefetches into L2, 1024 bytes ahead in passes of one to three rows
    and 2048 in the four-row pass (bf16: from three rows); other CPUs 512 bytes into L1
    (benchmarks/products.py's figures in docs/engine.md)."""
    from kafila.models.torch.few_rows import Prefetch, prefetch_for

    assert prefetch_for("znver4") == Prefetch(
        fp32=(1024, 1024, 1024, 2048), bf16=(1024, 1024, 2048, 2048), locality=2
    )
    assert prefetch_for("emeraldrapids") == Prefetch(fp32=(512,) * 4, bf16=(512,) * 4, locality=3)
    assert prefetch_for("skylake-avx512") == Prefetch(fp32=(512,) * 4, bf16=(512,) * 4, locality=3)


def test_the_products_vectors_are_as_wide_as_the_cpus_registers() -> None:
    """16 float32 lanes (512 bits) where the CPU has AVX-512F, 8 (AVX2) otherwise; this machine's
    kernels were built for the path in force (its own CPU's unless $KAFILA_CPU_KERNELS forces one)."""
    import llvmlite.binding as llvm

    from kafila.models.torch import cpu_kernels, few_rows

    assert few_rows.vector_lanes({"avx512f": True, "avx2": True}) == 16
    assert few_rows.vector_lanes({"avx512f": False, "avx2": True}) == 8
    assert few_rows.vector_lanes({}) == 8  # ARM: LLVM splits the 8 lanes into NEON registers
    own = few_rows.vector_lanes(dict(llvm.get_host_cpu_features()))
    assert (own if not os.environ.get(cpu_kernels.ENV) else cpu_kernels.PATH.lanes) == few_rows.VF


def test_the_decode_kernels_name_the_few_row_code_they_were_compiled_with() -> None:
    """decode_cpu's cached kernels compile few_rows' products into themselves, and numba's disk cache
    only notices a change of their own file: decode_cpu.FEW_ROWS_SHA256 must name few_rows.py."""
    import hashlib
    from pathlib import Path

    from kafila.models.torch import decode_cpu, few_rows

    digest = hashlib.sha256(Path(few_rows.__file__).read_bytes()).hexdigest()[:16]
    assert digest == decode_cpu.FEW_ROWS_SHA256, (
        f"few_rows.py changed: set FEW_ROWS_SHA256 = {digest!r} in decode_cpu.py, or numba keeps running "
        "the old products inside the cached decode kernels"
    )


def test_the_decode_kernels_name_the_packed_product_code_they_were_compiled_with() -> None:
    """As above, for quant_cpu.py: block_step compiles its packed products into itself."""
    import hashlib
    from pathlib import Path

    from kafila.models.torch import decode_cpu, quant_cpu

    digest = hashlib.sha256(Path(quant_cpu.__file__).read_bytes()).hexdigest()[:16]
    assert digest == decode_cpu.QUANT_CPU_SHA256, (
        f"quant_cpu.py changed: set QUANT_CPU_SHA256 = {digest!r} in decode_cpu.py, or numba keeps running "
        "the old packed products inside the cached decode kernels"
    )


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_prefill_is_bit_identical_alone_or_with_other_prompts(tiny_checkpoint, dtype: str) -> None:
    """Prefill chunks of up to KERNEL_ROWS rows take the few-row kernel, whose rows do not depend
    on each other: a prompt prefilled alone and together with two others gives the same bits (four
    users admitted together prefill in one step at the head and at every member)."""
    from kafila.models.torch import llama

    stage = _stage(tiny_checkpoint("llama-gqa3-tied"), fused=True, dtype=dtype)
    prompts = {rid: [(7 * i + n) % 250 for i in range(n)] for rid, n in (("a", 12), ("b", 30), ("c", 9))}
    assert not llama._too_many(51, stage.model.dtype)  # 51 rows, three prompts: one kernel call
    stage.open("alone")
    [alone] = stage.forward([("alone", 0, stage.embed(prompts["b"]))])
    stage.close("alone")
    for rid in prompts:
        stage.open(rid)
    together = stage.forward([(rid, 0, stage.embed(p)) for rid, p in prompts.items()])
    assert np.array_equal(np.asarray(stage.to_bytes(alone)), np.asarray(stage.to_bytes(together[1])))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_a_first_prefill_chunk_runs_one_compiled_call_per_block_a_later_one_the_torch_ops(
    tiny_checkpoint, dtype: str
) -> None:
    """A prompt's first chunk (from position 0, up to FUSED_PREFILL_ROWS rows) goes through
    decode_cpu.block_step, one call per block with a row per position; its next chunk through the
    torch ops. Both agree with the torch ops alone to 1e-5 of their scale (fp32)."""
    path = tiny_checkpoint("llama-gqa3-tied")
    fused, ops = _stage(path, fused=True, dtype=dtype), _stage(path, fused=False, dtype=dtype)
    calls: list[int] = []
    step = fused.model._block_step

    def counted(x, *args):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return step(x, *args)

    fused.model._block_step = counted
    prompt = [(5 * i + 3) % 250 for i in range(20)]
    for stage in (fused, ops):
        stage.open("a")
    for start, stop, expected in ((0, 12, [12] * len(fused.model.blocks)), (12, 20, [])):
        calls.clear()
        [a] = fused.forward([("a", start, fused.embed(prompt[start:stop]))])
        [b] = ops.forward([("a", start, ops.embed(prompt[start:stop]))])
        assert calls == expected
        a, b = a.float().numpy(), b.float().numpy()
        if dtype == "fp32":
            assert np.abs(a - b).max() <= 1e-5 * np.abs(b).max()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_twenty_users_decode_bit_identically_alone_or_batched(tiny_checkpoint, dtype: str) -> None:
    """A decode step of more than 16 rows (a lane of twenty users) takes the fused path too, up to
    KERNEL_ROWS, so every request's hidden state is the same bits as when it decodes alone."""
    ckpt = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend=cpu(dtype), dtype=dtype, context=32, concurrency=20
    )
    prompts = {rid: [(11 * rid + 3 * i) % 250 for i in range(1 + rid % 5)] for rid in range(20)}
    for rid, prompt in prompts.items():
        stage.open(rid)
        stage.forward([(rid, 0, stage.embed(prompt))])
    step = [(rid, len(p), stage.embed([7 + rid])) for rid, p in prompts.items()]  # [1, H] each
    batched = stage.forward(step)
    for (rid, pos, _), together in zip(step, batched, strict=True):
        stage.close(rid)
        stage.open(rid)
        stage.forward([(rid, 0, stage.embed(prompts[rid]))])
        [alone] = stage.forward([(rid, pos, stage.embed([7 + rid]))])
        assert np.array_equal(np.asarray(stage.to_bytes(alone)), np.asarray(stage.to_bytes(together)))


def test_prefill_products_past_the_kernel_rows_go_to_torch() -> None:
    """fp32 products of up to KERNEL_ROWS (128) rows give the kernel's bits, longer ones torch's (the
    two differ in the last bits here, so each comparison tells which ran); bf16 takes the kernel at
    any size."""
    import torch
    import torch.nn.functional as F

    from kafila.models.torch import few_rows, llama

    rows = llama.KERNEL_ROWS[torch.float32]
    assert rows == 128
    gen = torch.Generator().manual_seed(5)
    w, x = torch.randn(70, 300, generator=gen), torch.randn(rows + 1, 300, generator=gen)
    product = llama.Linear(w)
    assert not torch.equal(F.linear(x[:rows], w), few_rows.linear(x[:rows], w))
    assert torch.equal(product(x[:rows]), few_rows.linear(x[:rows], w))
    assert torch.equal(product(x), F.linear(x, w))
    wb, xb = w.bfloat16(), torch.randn(300, 300, generator=gen).bfloat16()
    assert torch.equal(llama.Linear(wb)(xb), few_rows.linear(xb, wb))


def test_without_numba_the_torch_ops_run_and_agree(tiny_checkpoint, monkeypatch) -> None:
    """numba comes with the `torch` extra; a torch installed without it still decodes, through
    torch's ops (few-row products included), to the same tokens (simulated: numba reported absent)."""
    from kafila.models.torch import packed as packed_module

    path = tiny_checkpoint("llama-gqa3-tied")
    with_kernels = _decode(_stage(path, fused=True), steps=4, together=True)
    monkeypatch.setattr(packed_module, "kernels_available", lambda: False)
    ckpt = Checkpoint.open(path)
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend=cpu("fp32"), dtype="fp32", context=32, concurrency=3
    )
    assert not stage.model.fused_decode
    without = _decode(stage, steps=4, together=True)
    for rid in PROMPTS:
        for a, b in zip(with_kernels[rid], without[rid], strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


def test_the_compiled_exp_is_within_five_ulps_and_clamps_without_overflow() -> None:
    """decode_cpu._exp (softmax and SwiGLU) is arithmetic, not libm: within 5 float32 ulps of e^x
    over float32's range, 1.2e-38 below it and finite above it (never inf, never NaN)."""
    from numba import njit

    from kafila.models.torch import decode_cpu

    @njit
    def exps(x: np.ndarray, out: np.ndarray) -> None:
        for i in range(x.shape[0]):
            out[i] = decode_cpu._exp(x[i])

    x = np.linspace(-87.3, 88.3, 200_001).astype(np.float32)
    got = np.empty_like(x)
    exps(x, got)
    want = np.exp(x.astype(np.float64))
    ulps = np.abs(got - want) / np.spacing(want.astype(np.float32))
    assert ulps.max() <= 5 and ulps.mean() <= 2, (ulps.max(), ulps.mean())
    edges = np.array([-1e4, -100.0, 100.0, 1e4], np.float32)
    out = np.empty_like(edges)
    exps(edges, out)
    assert np.all(np.isfinite(out)) and out[0] == out[1] < 1.2e-38 and out[2] == out[3] > 1e38
