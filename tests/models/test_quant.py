"""Packed weights (int8, q4): formats, exact bytes, kernels against the dequantized reference,
the default model's own GGUF blocks, packed folders read by range, split stages in every format."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kafila.engine.stage import Stage
from kafila.models import quant
from kafila.models.checkpoint import Checkpoint
from kafila.models.manifest import GROUP, build_manifest, packed_bytes, specs_from_config
from kafila.models.quantize import quantize_folder

FORMATS = ["int8", "q4"]
# Logits of a packed model against the same model computed in fp32 torch ops with the dequantized
# weights (quant.dequantize): the same numbers summed in another order, on a CPU without the
# integer products (quant_cpu.INT_DOT).
LOGIT_ATOL = 2e-4
# With them, q4 products and the int8 head round their input to int8 per group of 32 first (as
# llama.cpp rounds it): the logits may then differ by this fraction of the largest |logit|.
# Measured 0.073 on the tiny model (hidden 96: three groups a row, random weights); on the default
# model 1.4 at most against logits of standard deviation 5.3, and perplexity is what is held there
# (the slow test below).
INT_LOGIT_RTOL = 0.1


def seen_by_blocks(x: np.ndarray, fmt: str) -> np.ndarray:
    """x as a block matrix in `fmt` multiplies it on this CPU: with quant_cpu.INT_DOT rounded to
    int8 groups (q4) or int16 groups (int8); else as it is. (The head, int8 in both formats,
    rounds x to int8 groups wherever INT_DOT holds.)"""
    from kafila.models.torch import quant_cpu

    if not quant_cpu.INT_DOT:
        return x
    return _rounded_rows(x, 127 if fmt == "q4" else 32767)


def logit_atol(want: np.ndarray) -> float:
    """The tolerance of a packed session's logits (the CPU kernels' path) against a float
    reference: LOGIT_ATOL where nothing rounds x, else INT_LOGIT_RTOL of the largest |logit|."""
    from kafila.models.torch import quant_cpu

    return INT_LOGIT_RTOL * float(np.abs(want).max()) if quant_cpu.INT_DOT else LOGIT_ATOL


U32 = 2.0**-24  # float32's unit roundoff


def product_bound(x: np.ndarray, p: quant.Packed) -> np.ndarray:
    """Per element of x W^T [N, out], how far a float32 kernel may be from the exact product of
    these x and W = d q (+ m): each product is a sum of `in` terms, and every path adds at most a
    few roundings per term (a product, the float16 scale times dx, the fused multiply-add, the
    minimums' sum), so within gamma_(in + 4) of the sum of the terms' magnitudes, with each weight
    counted as |d q| + |m| (Higham, "Accuracy and Stability of Numerical Algorithms" 3.1)."""
    n = x.shape[1] + 4
    gamma = n * U32 / (1 - n * U32)
    q = np.abs(quant.levels(p).astype(np.float64)).reshape(p.shape[0], -1, GROUP)
    parts = q * np.abs(p.scales.astype(np.float64))[..., None]
    if p.mins is not None:
        parts = parts + np.abs(p.mins.astype(np.float64))[..., None]
    return gamma * (np.abs(x.astype(np.float64)) @ parts.reshape(p.shape).T)


def _rounded_rows(x: np.ndarray, levels: int = 127) -> np.ndarray:
    """x [N, in] as the integer products see it: per group of 32, dx round(x / dx), dx = max|x| /
    levels (127: quant_cpu.quantize_rows, 32767: quantize_rows16; numpy, float32 as they compute)."""
    g = x.reshape(x.shape[0], -1, GROUP)
    top = np.abs(g).max(axis=2, keepdims=True)
    most = np.float32(levels)
    inv = np.where(top > 0, most / np.where(top > 0, top, 1), np.float32(0.0)).astype(np.float32)
    q = np.rint(g * inv)
    return (q * (top / most)).reshape(x.shape)


@pytest.mark.parametrize("fmt", FORMATS)
def test_pack_holds_the_stated_bytes_and_rounds_each_weight_to_its_groups_nearest_level(fmt: str) -> None:
    w = np.random.default_rng(0).standard_normal((48, 4 * GROUP)).astype(np.float32)
    p = quant.quantize(w, fmt)
    assert p.nbytes == packed_bytes(fmt, 48, 4 * GROUP) == {"int8": 34, "q4": 20}[fmt] * 48 * 4
    back = quant.dequantize(p)
    step = p.scales.astype(np.float32).repeat(GROUP, axis=1)  # [48, 128]: each weight's level spacing
    assert np.all(np.abs(back - w) <= step / 2 + 1e-6)
    levels = quant.levels(p)
    assert levels.min() >= (-127 if fmt == "int8" else 0) and levels.max() <= (127 if fmt == "int8" else 15)


def test_a_matrix_whose_inputs_are_not_in_groups_of_32_is_refused_with_its_shape() -> None:
    with pytest.raises(ValueError, match=r"\[4, 40\]"):
        quant.quantize(np.zeros((4, 40), np.float32), "q4")


@pytest.mark.parametrize("ggml_type", [quant.GGML_Q4_1, quant.GGML_Q8_0])
def test_ggml_blocks_repack_to_the_same_numbers_gguf_dequantizes(ggml_type: int) -> None:
    import gguf

    qtype = gguf.GGMLQuantizationType(ggml_type)
    w = np.random.default_rng(1).standard_normal((8, 3 * GROUP)).astype(np.float32)
    raw = gguf.quants.quantize(w, qtype)  # uint8 [8, blocks * block bytes]
    p = quant.from_ggml(raw, ggml_type, (8, 3 * GROUP))
    assert p.nbytes == raw.nbytes  # bytes copied, nothing widened
    np.testing.assert_array_equal(quant.dequantize(p), gguf.quants.dequantize(raw, qtype).reshape(8, -1))


@pytest.mark.parametrize("groups", [3, 18])  # 18: two runs of eight groups and two more
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_products_match_the_dequantized_matrix_and_rows_do_not_depend_on_the_batch(
    fmt: str, groups: int
) -> None:
    """The CPU kernel against the dequantized matrix times x as the kernel rounds it on this CPU
    (`seen_by_blocks`: int8 groups for q4, int16 for int8 where quant_cpu.INT_DOT holds)."""
    from kafila.models.torch.packed import PackedLinear

    rng = np.random.default_rng(2)
    p = quant.quantize(
        rng.standard_normal((101, groups * GROUP)).astype(np.float32), fmt
    )  # 101: a partial tile
    lin = PackedLinear.from_packed(p, torch.device("cpu"))
    x = rng.standard_normal((7, groups * GROUP)).astype(np.float32)
    seen = seen_by_blocks(x, fmt)
    ref = seen.astype(np.float64) @ quant.dequantize(p).astype(np.float64).T
    y = lin(torch.from_numpy(x))
    assert np.all(np.abs(y.double().numpy() - ref) <= product_bound(seen, p))
    for r in range(7):
        assert torch.equal(
            lin(torch.from_numpy(x[r : r + 1]))[0], y[r]
        )  # the same bits alone as in a batch of 7
    torch.testing.assert_close(
        lin.dequantized(slice(None), torch.float32), torch.from_numpy(quant.dequantize(p))
    )


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_float_kernel_of_cpus_without_integer_dot_products_matches_the_dequantized_matrix(
    fmt: str,
) -> None:
    """quant_cpu.packed_tile, the path where the CPU lacks AVX-512 VNNI: weights decoded to float32,
    x as it is; run here tile by tile from Python whatever this CPU has."""
    from kafila.models.torch import quant_cpu
    from kafila.models.torch.packed import PackedLinear

    rng = np.random.default_rng(4)
    p = quant.quantize(rng.standard_normal((70, 18 * GROUP)).astype(np.float32), fmt)
    w = PackedLinear.from_packed(p, torch.device("cpu")).arrays()
    x = rng.standard_normal((5, 18 * GROUP)).astype(np.float32)
    y = np.empty((5, 70), np.float32)
    for t in range((70 + quant_cpu.QTILE - 1) // quant_cpu.QTILE):
        quant_cpu.packed_tile(x, w[0], w[1], w[-1], w[1], y, t)  # scales: no high bits (not uint8)
    ref = x.astype(np.float64) @ quant.dequantize(p).astype(np.float64).T
    assert np.all(np.abs(y - ref) <= product_bound(x, p))


def _gguf_matrix(rows: int, cols: int, seed: int, kind: str = "Q6_K") -> quant.Packed:
    """A matrix of random `kind` blocks (tests.gguf_files.random_blocks) in the format it is served
    in (Q6_K: q6k, Q4_K: q4k, Q5_K: q5k, Q5_1: q5)."""
    import gguf

    from kafila.models import gguf_types
    from tests.gguf_files import random_blocks

    raw = random_blocks(kind, (rows, cols), np.random.default_rng(seed), std=0.05)
    qtype = int(gguf.GGMLQuantizationType[kind])
    return gguf_types.repack(raw, qtype, (rows, cols), gguf_types.PACKED[qtype][0])


def _weights_bound(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """product_bound for any matrix of weights w [out, in] (each counted as |w|)."""
    n = x.shape[1] + 4
    return n * U32 / (1 - n * U32) * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K", "Q5_K", "Q5_1"])
@pytest.mark.parametrize("supers", [1, 3])
def test_gguf_format_products_match_the_dequantized_matrix_and_rows_do_not_depend_on_the_batch(
    supers: int, kind: str
) -> None:
    """The kernels of a GGUF's types as stored (q6k, q4k, q5k; q5: Q5_1's levels and fifth bits)
    against the dequantized matrix times x as this CPU's path rounds it (int8 groups with
    quant_cpu.INT_DOT, as q4), rows alone as in a batch of 7, and the head's rounded product
    (round_x) the same."""
    from kafila.models.torch.packed import PackedLinear

    p = _gguf_matrix(101, supers * 256, seed=supers, kind=kind)  # 101: a partial tile
    lin = PackedLinear.from_packed(p, torch.device("cpu"))
    x = np.random.default_rng(3).standard_normal((7, supers * 256)).astype(np.float32)
    seen = seen_by_blocks(x, "q4")
    w = quant.dequantize(p)
    y = lin(torch.from_numpy(x))
    ref = seen.astype(np.float64) @ w.astype(np.float64).T
    assert np.all(np.abs(y.double().numpy() - ref) <= _weights_bound(seen, w))
    for r in range(7):
        assert torch.equal(lin(torch.from_numpy(x[r : r + 1]))[0], y[r])
    lin.round_x = True  # the head's product: x rounded to int8 groups wherever INT_DOT holds
    assert torch.equal(lin(torch.from_numpy(x)), y)


@pytest.mark.parametrize("kind", ["Q6_K", "Q4_K", "Q5_K", "Q5_1"])
def test_the_gguf_format_float_kernels_of_cpus_without_integer_dot_products_match_the_dequantized_matrix(
    kind: str,
) -> None:
    """quant_cpu.k_tile with float32 x (packed_tile for q5), the path where the CPU lacks AVX-512
    VNNI, run tile by tile."""
    from kafila.models.torch import quant_cpu
    from kafila.models.torch.packed import PackedLinear

    p = _gguf_matrix(70, 512, seed=7, kind=kind)
    arrays = PackedLinear.from_packed(p, torch.device("cpu")).arrays()
    x = np.random.default_rng(4).standard_normal((6, 512)).astype(np.float32)
    y = np.empty((6, 70), np.float32)

    def tile(x: np.ndarray, y: np.ndarray, t: int) -> None:
        if kind == "Q5_1":
            quant_cpu.packed_tile(x, *arrays, y, t)
        else:  # (q6k's d stands in for its absent dmin)
            quant_cpu.k_tile(x, x.shape[0], arrays[0], arrays[1], arrays[-1], y, t)

    for t in range((70 + quant_cpu.QTILE - 1) // quant_cpu.QTILE):
        tile(x, y, t)
    w = quant.dequantize(p)
    assert np.all(np.abs(y - x.astype(np.float64) @ w.astype(np.float64).T) <= _weights_bound(x, w))
    one = np.empty((1, 70), np.float32)
    for t in range(3):
        tile(x[5:6], one, t)
    assert np.array_equal(one[0], y[5])


@pytest.mark.parametrize(
    "formats",
    [("q4k", "q4k", "q6k"), ("q4", "q6k", "int8"), ("int8", "q4", "q4"), ("q5k", "q4"), ("q5", "q4k", "q6k")],
)
def test_a_stacked_product_of_several_formats_gives_each_parts_own_product_side_by_side(
    formats: tuple[str, ...],
) -> None:
    """A fused product of matrices in different formats (a GGUF's Q4_K q and k beside a Q6_K v):
    parts of one format in a row stack into one matrix; the stacked product, in torch and in one
    parallel call of the kernels (quant_cpu.product, as decode_cpu.block_step runs it), equals
    each part's own product in its columns, bit for bit."""
    from kafila.models.torch import quant_cpu
    from kafila.models.torch.packed import PackedLinear, StackedLinear

    rng = np.random.default_rng(6)
    kinds = {"q6k": "Q6_K", "q4k": "Q4_K", "q5k": "Q5_K", "q5": "Q5_1"}
    packed = [
        _gguf_matrix(40 + i, 512, seed=i, kind=kinds[f])
        if f in kinds
        else quant.quantize(rng.standard_normal((33 + i, 512)).astype(np.float32), f)
        for i, f in enumerate(formats)
    ]
    parts = [PackedLinear.from_packed(p, torch.device("cpu")) for p in packed]
    stacked = PackedLinear.stack(parts)
    assert isinstance(stacked, StackedLinear)
    assert [p.fmt for p in stacked.parts] == [
        f for i, f in enumerate(formats) if i == 0 or formats[i - 1] != f
    ]
    x = torch.from_numpy(rng.standard_normal((5, 512)).astype(np.float32))
    want = torch.cat([p(x) for p in parts], dim=1)
    assert stacked.shape == (want.shape[1], 512) and torch.equal(stacked(x), want)
    y = np.empty((5, want.shape[1]), np.float32)
    quant_cpu.product(x.numpy(), stacked.arrays(), y)
    assert np.array_equal(y, want.numpy())


def test_the_integer_products_round_each_group_of_x_as_the_reference_does() -> None:
    from kafila.models.torch import quant_cpu

    x = np.random.default_rng(5).standard_normal((3, 4 * GROUP)).astype(np.float32)
    x[1, :GROUP] = 0.0  # a group of zeros: scale 0, no division by it
    qx, dx, sx, xc = quant_cpu.quantize_rows(x)
    back = (qx.astype(np.float32).reshape(3, -1, GROUP) * dx[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(back, _rounded_rows(x))
    q16, d16, _, _ = quant_cpu.quantize_rows16(x)
    back16 = (q16.astype(np.float32).reshape(3, -1, GROUP) * d16[..., None]).reshape(x.shape)
    np.testing.assert_array_equal(back16, _rounded_rows(x, 32767))
    assert np.abs(q16).max() == 32767 and d16[1, 0] == 0.0
    np.testing.assert_allclose(sx, back.reshape(3, -1, GROUP).sum(axis=2), rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(xc, -128 * qx.astype(np.int32).reshape(3, -1, 4).sum(axis=2))
    assert np.abs(qx).max() == 127 and (dx[1, 0], sx[1, 0]) == (0.0, 0.0)


def _dequantized_copy(src: Path, dst: Path) -> Path:
    """The packed folder `src` widened to F32 (quant.dequantize): the fp32 reference model."""
    from kafila.models.quantize import write_safetensors

    ckpt = Checkpoint.open(src)
    dst.mkdir()
    specs = {t.name: t.spec for t in ckpt.tensors.values()}
    entries = []
    for name, info in ckpt.tensors.items():
        base = name.removesuffix("weight")
        if name.endswith(("scales", "mins")):
            continue
        raw = ckpt.read([name])[name][1]
        if base + "scales" in specs:
            fmt = "q4" if base + "mins" in specs else "int8"
            parts = ckpt.read([n for n in (base + "scales", base + "mins") if n in specs])
            data = np.frombuffer(raw, dtype=np.int8 if fmt == "int8" else np.uint8).reshape(info.shape)
            scales = np.frombuffer(parts[base + "scales"][1], np.float16).reshape(info.shape[0], -1)
            mins = (
                np.frombuffer(parts[base + "mins"][1], np.float16).reshape(scales.shape)
                if fmt == "q4"
                else None
            )
            w = quant.dequantize(quant.from_entries(fmt, data, scales, mins))
        else:
            w = np.frombuffer(raw, np.float32).reshape(info.shape)
        from kafila.models.manifest import TensorSpec

        entries.append((TensorSpec(name, "F32", w.shape), lambda w=w: w))
    write_safetensors(dst / "model.safetensors", entries, progress=False)
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.fixture(scope="module")
def packed(tiny_checkpoint, tmp_path_factory) -> dict[str, Path]:
    src = tiny_checkpoint("llama-gqa3-tied")
    root = tmp_path_factory.mktemp("packed")
    return {fmt: quantize_folder(src, fmt, root / fmt, progress=False) for fmt in FORMATS}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_packed_folder_is_priced_exactly_as_the_float_folder_in_that_format(
    tiny_checkpoint, packed, fmt
) -> None:
    """The manifest of the written folder (its headers' bytes), the pricing of the float folder in
    the format (quantize on load), the bytes a stage loads and the bytes the model holds agree."""
    src = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))
    ckpt = Checkpoint.open(packed[fmt], complete=True)
    assert ckpt.stored_format == fmt
    stored, priced = ckpt.manifest(), src.manifest("F32", fmt)
    assert stored == priced and stored.quant == fmt
    assert (
        build_manifest(specs_from_config(src.config, "F32"), src.config, quant=fmt).block_bytes
        == stored.block_bytes
    )
    stage = Stage.load(ckpt, range(1, 4), False, backend="torch", dtype="fp32", context=16)
    assert stage.bytes_loaded == sum(stored.block_bytes[1:4])  # norms included, as the manifest
    held = sum(
        lin.nbytes for blk in stage.model.blocks for lin in (blk.wqkv, blk.wo, blk.w_gate_up, blk.w_down)
    )
    norms = sum(2 * src.config.hidden_size * 4 for _ in range(3))
    assert held + norms == sum(stored.block_bytes[1:4])


def test_a_member_holding_some_blocks_of_a_packed_folder_reads_only_their_packed_bytes(packed) -> None:
    ckpt = Checkpoint.open(packed["q4"])
    m = ckpt.manifest()
    names = ckpt.names_for(range(2, 3), False)
    assert {n.rsplit(".", 1)[1] for n in names} >= {"weight", "scales", "mins"}
    ckpt.read(names)
    assert ckpt.bytes_read == m.block_bytes[2] == sum(m.block_bytes) // 5


def _logits(
    ckpt: Checkpoint,
    quant_fmt: str,
    splits: list[tuple[int, int]],
    wire: bool,
    dtype: str = "fp32",
    fed: list[int] | None = None,
) -> list[np.ndarray]:
    """Prefill a prompt in two chunks, then decode 4 steps through stages `splits`: greedy, or
    feeding the tokens `fed` (so that two models' logits are compared on the same inputs)."""
    stages = [
        Stage.load(ckpt, range(a, b), i == 0, backend="torch", dtype=dtype, context=32, quant=quant_fmt)
        for i, (a, b) in enumerate(splits)
    ]
    out: list[np.ndarray] = []
    for s in stages:
        s.open("r")

    def step(start: int, ids: list[int]) -> np.ndarray:
        h = stages[0].embed(ids)
        for s in stages:
            if wire:  # the bytes a ring link carries
                h = s.from_bytes(stages[0].to_bytes(h), tuple(h.shape))
            [h] = s.forward([("r", start, h)])
        return stages[0].logits(h[-1])

    prompt = [5, 9, 1, 77, 120, 3, 64, 18, 250]
    out += [step(0, prompt[:4]), step(4, prompt[4:])]
    for i, pos in enumerate(range(len(prompt), len(prompt) + 4)):
        out.append(step(pos, [int(out[-1].argmax()) if fed is None else fed[i]]))
    return out


FED = [11, 200, 37, 142]  # the decode steps' tokens where two models' logits are compared


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_logits_match_the_dequantized_fp32_reference(packed, tmp_path, fmt) -> None:
    ref = Checkpoint.open(_dequantized_copy(packed[fmt], tmp_path / "ref"))
    want = _logits(ref, "none", [(0, 5)], False, fed=FED)
    got = _logits(Checkpoint.open(packed[fmt]), "auto", [(0, 5)], False, fed=FED)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=logit_atol(w), rtol=0)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_split_stages_through_wire_bytes_give_exactly_the_single_stage_logits(packed, fmt, dtype) -> None:
    ckpt = Checkpoint.open(packed[fmt])
    full = _logits(ckpt, fmt, [(0, 5)], False, dtype)
    split = _logits(ckpt, fmt, [(0, 2), (2, 4), (4, 5)], True, dtype)
    for a, b in zip(full, split, strict=True):
        np.testing.assert_array_equal(a, b)


def test_a_sharded_bf16_folder_packs_to_one_file_without_its_shards(tiny_checkpoint, tmp_path) -> None:
    """The hub's layout (model-0000x-of-0000y.safetensors and an index) is replaced by the packed
    file, not copied beside it: a copied shard doubles the folder (16 GB for Qwen3-8B) and holds
    every tensor a second time."""
    src = tiny_checkpoint("llama-gqa3-tied", sharded=True, dtype="bfloat16")
    assert len(list(src.glob("model-*.safetensors"))) > 1
    out = quantize_folder(src, "q4", tmp_path / "q4", progress=False)
    assert sorted(f.name for f in out.iterdir() if "safetensors" in f.name) == ["model.safetensors"]
    assert (out / "config.json").is_file()
    ckpt = Checkpoint.open(out, complete=True)
    assert ckpt.stored_format == "q4"
    assert {t.file.name for t in ckpt.tensors.values()} == {"model.safetensors"}


def test_a_float_folder_packed_on_load_equals_its_packed_folder(tiny_checkpoint, packed) -> None:
    on_load = _logits(Checkpoint.open(tiny_checkpoint("llama-gqa3-tied")), "q4", [(0, 5)], False)
    stored = _logits(Checkpoint.open(packed["q4"]), "auto", [(0, 5)], False)
    for a, b in zip(on_load, stored, strict=True):
        np.testing.assert_array_equal(a, b)


def test_the_default_models_own_gguf_blocks_are_served_packed_and_priced_as_llama_cpp_reads_them() -> None:
    from kafila.models.default import DefaultModelUnavailable, ensure_default

    try:
        folder = ensure_default("smollm2-135m", progress=False, packed=True)
    except DefaultModelUnavailable as exc:
        pytest.skip(str(exc))
    ckpt = Checkpoint.open(folder, complete=True)
    m = ckpt.manifest()
    assert (m.quant, ckpt.stored_format, m.dtype) == ("q4", "q4", "F32")
    # Q4_1 blocks (20 bytes per 32 weights) and norms; the Q8_0 embedding read as one row per token
    assert sum(m.block_bytes) == 66_493_440
    assert sum(m.block_bytes) + m.head_read_bytes == 96_577_380  # llama.cpp: 96.6 MB per token


PERPLEXITY_TEXT = Path(__file__).parent.parent / "data" / "perplexity.txt"
# Measured on the default model (docs/engine-quant.md): none 8.722, int8 8.793, q4 8.722 (the GGUF's
# own blocks, the same values as the F32 folder); through the CPU kernels in chunks of 32, whose
# integer products round x (q4: int8 groups; int8: int16 groups, its head int8): none 8.722, int8 8.798,
# q4 8.689 (per CPU and kernel path in docs/engine-quant.md). Each format may be at most this much
# above the F32 model's one-prefill figure. The F32 model through the kernels differs from it only
# in summation order: its logits within LOGIT_ATOL, so each token's log-likelihood within twice
# that (log-softmax moves by at most twice the largest logit's move), its perplexity within
# exp(2 LOGIT_ATOL) (on the float paths it came out 3.7e-8 above it, relative).
PERPLEXITY_MARGIN = {"none": float(np.exp(2 * LOGIT_ATOL)), "int8": 1.02, "q4": 1.01}


def perplexity(stage: Stage, ids: list[int], chunk: int = 1 << 20) -> float:
    """exp of the mean negative log-likelihood of ids[1:] given the ids before, prefilled `chunk`
    tokens at a time (one prefill by default: the dequantized tiles' path past KERNEL_ROWS rows;
    chunks of 32 take the CPU kernels, integer products included, as decode steps do)."""
    stage.open("p")
    x = ids[:-1]
    parts = []
    for a in range(0, len(x), chunk):
        [h] = stage.forward([("p", a, stage.embed(x[a : a + chunk]))])
        parts.append(torch.from_numpy(stage.logits(h)))
    logits = torch.cat(parts)  # [T-1, V]
    stage.close("p")
    nll = torch.nn.functional.cross_entropy(logits.double(), torch.tensor(ids[1:]))
    return float(torch.exp(nll))


def answer_logits(stage: Stage, question: list[int], answer: list[int]) -> np.ndarray:
    """The logits [len(answer), V] that choose each token of `answer` after `question`, the answer
    fed in (one prefill: the CPU kernels' path up to KERNEL_ROWS rows)."""
    stage.open("a")
    [h] = stage.forward([("a", 0, stage.embed(question + answer[:-1]))])
    stage.close("a")
    return np.asarray(stage.logits(h))[len(question) - 1 :]


def answer_margins(logits: np.ndarray, ref: np.ndarray, answer: list[int]) -> list[tuple[float, float]]:
    """Per answer token: (its logit's lead over the best other token in `logits`, how far those two
    logits are from the fp32 model's `ref`). Where every lead is wider than twice that distance,
    the format's choice rests on more than its rounding, and a kernel path (which rounds x to 8
    bits at most, finer than the weights' 4 or 8) cannot turn it; elsewhere the answer is the
    CPU's, not the format's."""
    out = []
    for row, want, tok in zip(logits, ref, answer, strict=True):
        rival = int(np.argmax(np.where(np.arange(row.size) == tok, -np.inf, row)))
        lead = float(row[tok] - row[rival])
        moved = max(abs(float(row[tok] - want[tok])), abs(float(row[rival] - want[rival])))
        out.append((lead, moved))
    return out


@pytest.mark.slow
@pytest.mark.timeout(900)  # 141 s on a quiet 2-core machine: three formats, two perplexities each
def test_the_default_model_keeps_its_perplexity_and_its_answer_in_every_format(smollm2_path) -> None:
    """Perplexity (one prefill and through the CPU kernels) within PERPLEXITY_MARGIN of the fp32
    model in every format, on every CPU. The fp32 model answers Paris; a packed format is held to
    that answer where its logits lead to it by more than twice the format's own move from the fp32
    logits at every token up to "Paris" (`answer_margins`): q4's lead on its first token is narrow,
    and on a Xeon (AMX) it answered "L'Étoile" through llama.cpp's own kernels too."""
    from kafila.engine.generate import generate
    from kafila.engine.sampler import SamplingParams
    from kafila.engine.tokenizer import Tokenizer
    from kafila.models.registry import resolve
    from kafila.models.torch import cpu_kernels

    base = Checkpoint.open(smollm2_path)
    tok = Tokenizer.from_checkpoint(base)
    text = tok.encode(PERPLEXITY_TEXT.read_text())
    question = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}], True)
    ppl: dict[str, float] = {}
    held: dict[str, str] = {}
    ref: np.ndarray | None = None
    paris: list[int] = []
    for fmt in ("none", "int8", "q4"):
        ckpt = Checkpoint.open(resolve("smollm2-135m", progress=False, quant=fmt))
        stage = Stage.load(ckpt, range(30), True, backend="torch", dtype="fp32", context=512, quant=fmt)
        ppl[fmt] = perplexity(stage, text)
        ppl[fmt + " kernels"] = perplexity(stage, text, chunk=32)
        answer = list(
            generate(stage, question, SamplingParams(0.0, 0, 1.0, None, 12), eos_ids=tuple(tok.stop_ids))
        )
        said = tok.decode(answer)
        if fmt == "none":  # its kernel paths differ only in summation order: logits within LOGIT_ATOL
            assert "Paris" in said, said
            paris = answer[: next(k for k in range(1, len(answer) + 1) if "Paris" in tok.decode(answer[:k]))]
            ref = answer_logits(stage, question, paris)
            leads = [round(lead, 3) for lead, _ in answer_margins(ref, ref, paris)]
            assert min(leads) > 2 * LOGIT_ATOL, leads
            held[fmt] = f"answered {said!r} (leads {leads})"
            continue
        assert ref is not None
        margins = answer_margins(answer_logits(stage, question, paris), ref, paris)
        narrow = [(i, lead, moved) for i, (lead, moved) in enumerate(margins) if lead <= 2 * moved]
        if not narrow:
            assert "Paris" in said, (fmt, said, margins)
            held[fmt] = f"answered {said!r} (leads {[round(m[0], 3) for m in margins]})"
        else:
            i, lead, moved = narrow[0]
            held[fmt] = f"answer not held: {said!r}; token {i}'s lead {lead:.3f} <= 2 x {moved:.3f}"
    print("kernel path", cpu_kernels.PATH.name, "perplexity", {k: round(v, 3) for k, v in ppl.items()})
    print("answers", held)
    for fmt, margin in PERPLEXITY_MARGIN.items():
        assert ppl[fmt] <= ppl["none"] * margin, ppl
        assert ppl[fmt + " kernels"] <= ppl["none"] * margin, ppl


@pytest.mark.parametrize("fmt", FORMATS)
def test_mlx_serves_a_packed_folder_with_its_quantized_matmul_as_torch_does(packed, fmt) -> None:
    """MLX (mlx[cpu] here) runs the same packed numbers through mx.quantized_matmul: its logits
    match torch's packed model within float32 summation order, and its split stages match its own
    single stage exactly through the wire bytes."""
    pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'kafila[mlx]')")
    ckpt = Checkpoint.open(packed[fmt])

    def run(backend: str, splits: list[tuple[int, int]]) -> list[np.ndarray]:
        stages = [
            Stage.load(ckpt, range(a, b), i == 0, backend=backend, dtype="fp32", context=32)
            for i, (a, b) in enumerate(splits)
        ]
        for s in stages:
            s.open("r")
        out = []
        for start, ids in ((0, [5, 9, 1, 77]), (4, [120, 3]), (6, [64])):
            h = stages[0].embed(ids)
            for s in stages:
                h = s.from_bytes(stages[0].to_bytes(h), tuple(h.shape))
                [h] = s.forward([("r", start, h)])
            out.append(stages[0].logits(h[-1]))
        return out

    mlx_full = run("mlx", [(0, 5)])
    for a, b in zip(mlx_full, run("torch", [(0, 5)]), strict=True):  # MLX keeps x in floats
        np.testing.assert_allclose(a, b, atol=logit_atol(a), rtol=0)
    for a, b in zip(run("mlx", [(0, 3), (3, 5)]), mlx_full, strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("fmt", FORMATS)
def test_products_past_the_kernels_rows_take_dequantized_tiles_and_torch_matmul(fmt, monkeypatch) -> None:
    """The path CUDA and large prefill chunks take (torch ops only; tiles of TILE_ROWS output rows)."""
    from kafila.models.torch import packed as packed_mod

    monkeypatch.setattr(packed_mod, "TILE_ROWS", 16)  # several tiles and a partial one
    rng = np.random.default_rng(3)
    p = quant.quantize(rng.standard_normal((40, 2 * GROUP)).astype(np.float32), fmt)
    lin = packed_mod.PackedLinear.from_packed(p, torch.device("cpu"))
    x = torch.from_numpy(rng.standard_normal((packed_mod.KERNEL_ROWS + 3, 2 * GROUP)).astype(np.float32))
    ref = x.double() @ torch.from_numpy(quant.dequantize(p)).double().T
    torch.testing.assert_close(lin(x).double(), ref, atol=1e-4, rtol=1e-5)
    assert lin(x.bfloat16()).dtype == torch.bfloat16


def test_the_head_stage_reads_the_packed_embeddings_scales_with_it(packed) -> None:
    """manifest.stage_tensors, which Checkpoint.names_for and the session's weights fetch
    (kafila.session.weights.fetch.shard_names) use, lists a packed head matrix's scales with it."""
    from kafila.models.manifest import stage_tensors

    ckpt = Checkpoint.open(packed["q4"])
    names = stage_tensors(ckpt.tensors, range(0, 0), True)
    assert sorted(names) == ["model.embed_tokens.scales", "model.embed_tokens.weight", "model.norm.weight"]
    assert ckpt.names_for(range(0, 0), True) == sorted(names, key=lambda n: ckpt.tensors[n].start)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_large_matrix_is_quantized_in_chunks_of_rows_to_the_same_bytes(fmt, monkeypatch) -> None:
    w = np.random.default_rng(4).standard_normal((50, GROUP)).astype(np.float32)
    whole = quant.quantize(w, fmt)
    monkeypatch.setattr(quant, "CHUNK_ROWS", 16)  # four chunks, the last partial
    chunked = quant.quantize(w, fmt)
    np.testing.assert_array_equal(quant.dequantize(chunked), quant.dequantize(whole))
    assert chunked.nbytes == whole.nbytes


@pytest.mark.parametrize("fmt", FORMATS)
def test_bf16_bits_are_quantized_as_their_float32_values_without_a_whole_float32_copy(fmt) -> None:
    """A bf16 matrix given as its uint16 bits packs to the same bytes as its exact float32
    values, and the float32 copies stay chunk-sized: at Qwen3-8B's widths a whole one of the
    embedding is 2.5 GB (tracemalloc sees numpy's allocations)."""
    import tracemalloc

    rows, cols = 24 * quant.CHUNK_ROWS + 5, 8 * GROUP
    w = torch.randn(rows, cols, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    bits = w.view(torch.int16).numpy().view(np.uint16)
    tracemalloc.start()
    try:
        got = quant.quantize(bits, fmt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    want = quant.quantize(w.float().numpy(), fmt)
    for a, b in ((got.data, want.data), (got.scales, want.scales), (got.mins, want.mins)):
        np.testing.assert_array_equal(a, b)
    whole = 4 * rows * cols
    assert peak < whole / 2, f"quantize held {peak} bytes at its peak; a whole float32 copy is {whole}"


def test_torchs_int4_matmul_takes_q4_products_as_the_dequantized_matrix(monkeypatch) -> None:
    """The CUDA path's weight-only int4 matmul (PackedLinear.int4_product: Q4_1's (d, m) as torch's
    (scale, zero)), run here through torch's CPU variant of the op: the same levels, scales and
    zeros; on a card tests/engine/test_cuda.py runs `_weight_int4pack_mm` itself."""
    from kafila.models.torch.packed import PackedLinear

    rng = np.random.default_rng(6)
    p = quant.quantize(rng.standard_normal((48, 18 * GROUP)).astype(np.float32), "q4")
    lin = PackedLinear.from_packed(p, torch.device("cpu"))
    x = torch.from_numpy(rng.standard_normal((5, 18 * GROUP)).astype(np.float32))
    ref = x.double() @ torch.from_numpy(quant.dequantize(p)).double().T
    torch.testing.assert_close(lin.int4_product(x).double(), ref, atol=1e-4, rtol=1e-5)


def test_a_q4_model_on_torchs_int4_matmul_matches_the_dequantized_fp32_reference(
    packed, tmp_path, monkeypatch
) -> None:
    """A whole q4 model through torch ops with every q4 product on the int4 matmul (as on CUDA;
    the CPU variant here), against the dequantized fp32 model: the float tolerance."""
    from kafila.models.torch import packed as packed_module
    from kafila.models.torch.packed import PackedLinear

    ref = Checkpoint.open(_dequantized_copy(packed["q4"], tmp_path / "ref"))
    want = _logits(ref, "none", [(0, 5)], False, fed=FED)
    monkeypatch.setattr(packed_module, "kernels_available", lambda: False)  # torch ops, not the numba kernels
    monkeypatch.setattr(PackedLinear, "_int4_takes", lambda self, x: self.fmt == "q4")
    got = _logits(Checkpoint.open(packed["q4"]), "auto", [(0, 5)], False, fed=FED)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, atol=LOGIT_ATOL, rtol=0)
