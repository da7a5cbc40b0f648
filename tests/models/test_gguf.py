"""GGUF files as models: every type's values as gguf.quants gives them, the folder they convert to,
the tokenizer from the file's metadata, and the engine's logits against a float model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kafila.models import gguf_types as types
from kafila.models.checkpoint import Checkpoint
from kafila.models.gguf_convert import GGUFError, build_tokenizer, ensure_gguf
from kafila.models.manifest import packed_format
from kafila.models.quant import dequantize
from tests.gguf_files import Shape, float_folder, qwen3_tokenizer_meta, served_values, write_gguf

gguf = pytest.importorskip("gguf")

# per-tensor types of the mixed file, each in its own format: q/k/v are int8, q4, int8 (a stacked
# product of three), gate/up q4, Q5_0 q5; block 1's q/k/v int8, q4, q4 (two), and Q5_1 as q5
MIXED = {
    "token_embd": "Q8_0",
    "attn_q": "Q8_0",
    "attn_k": "Q4_0",
    "attn_v": "Q8_0",
    "attn_output": "Q4_0",
    "ffn_gate": "Q4_1",
    "ffn_up": "Q4_0",
    "ffn_down": "Q5_0",
    "blk.1.attn_v": "Q4_1",
    "blk.1.ffn_down": "Q5_1",
}
# the K-quants (and Q5_1): Q4_K, Q5_K, Q6_K as q4k, q5k, q6k and Q5_1 as q5 (block 0's q/k/v: q4k,
# q4k, q6k, a stacked product); Q3_K and Q2_K requantized to q4
KQUANTS = {
    "token_embd": "Q4_K",
    "attn_q": "Q4_K",
    "attn_k": "Q4_K",
    "attn_v": "Q6_K",
    "attn_output": "Q5_K",
    "ffn_gate": "Q4_K",
    "ffn_up": "Q4_K",
    "ffn_down": "Q6_K",
    "blk.1.attn_v": "Q4_K",
    "blk.1.ffn_gate": "Q3_K",
    "blk.1.ffn_up": "Q2_K",
    "blk.1.ffn_down": "Q5_1",
}
TEXTS = [
    "What is the capital of France?",
    "  indented\n\ttabs  and   spaces\r\n",
    "naïve café – 東京 🚀 x=12345 don't I'LL",
    "<|im_start|>user\nhi<think>ok</think><|im_end|>",
]


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("gguf")
    meta = qwen3_tokenizer_meta(qwen3_tokenizer_dir)
    return write_gguf(folder / "tiny-qwen3-mixed.gguf", Shape(), meta, MIXED, tied=True)


@pytest.fixture(scope="module")
def mixed_folder(mixed_gguf: Path, cache: Path, capsys_module: list[str]) -> Path:
    return ensure_gguf(mixed_gguf, progress=False, say=capsys_module.append)


@pytest.fixture(scope="module")
def capsys_module() -> list[str]:
    return []


@pytest.fixture(scope="module")
def kquant_gguf(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    folder = tmp_path_factory.mktemp("gguf-k")
    meta = qwen3_tokenizer_meta(qwen3_tokenizer_dir)
    return write_gguf(folder / "tiny-qwen3-kquants.gguf", Shape(), meta, KQUANTS, tied=True)


@pytest.fixture(scope="module")
def kquant_lines() -> list[str]:
    return []


@pytest.fixture(scope="module")
def kquant_folder(kquant_gguf: Path, cache: Path, kquant_lines: list[str]) -> Path:
    return ensure_gguf(kquant_gguf, progress=False, say=kquant_lines.append)


def _weights(seed: int, shape: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[0, :32] = 0.0  # a block of zeros (scale 0)
    w[1, :32] *= 1000.0  # a block of large values
    return w


@pytest.mark.parametrize(
    ("kind", "fmt"),
    [("Q8_0", "int8"), ("Q4_1", "q4"), ("Q4_0", "q4"), ("Q4_0", "int8"), ("Q5_0", "int8"), ("Q5_0", "q5"),
     ("Q5_1", "q5")],
)  # fmt: skip
def test_each_repacked_type_dequantizes_to_gguf_quants_values(kind: str, fmt: str) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(_weights(int(qtype), (64, 512)), qtype)
    want = gguf.quants.dequantize(blocks, qtype).reshape(64, 512).astype(np.float32)
    got = dequantize(types.repack(blocks, int(qtype), (64, 512), fmt))
    assert np.array_equal(got, want)
    if (kind, fmt) not in (
        ("Q4_0", "q4"),
        ("Q5_0", "q5"),
    ):  # d q + (-8 d) may give +0 where d (q - 8) gives -0
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def _half_ulp16(x: np.ndarray) -> np.ndarray:
    """Half a float16 unit in the last place at |x| (2^-25 in the subnormal range)."""
    e = np.floor(np.log2(np.maximum(np.abs(x), 2.0**-14)))
    return np.asarray(2.0 ** (e - 11), dtype=np.float64)


@pytest.mark.parametrize(
    ("kind", "fmt", "size", "scales"), [("Q6_K", "q6k", 208, (208,)), ("Q4_K", "q4k", 140, (0, 2)),
                                        ("Q5_K", "q5k", 172, (0, 2))],
)  # fmt: skip
def test_the_k_quants_are_served_as_stored_and_dequantize_to_gguf_quants_values_bit_for_bit(
    kind: str, fmt: str, size: int, scales: tuple[int, ...]
) -> None:
    """A Q6_K (Q4_K, Q5_K) matrix as q6k (q4k, q5k): the file's bytes of every block (all but the
    float16 d, and dmin, in the data entry; those in the scales and mins), values equal
    gguf.quants' in every bit, in numpy and in torch."""
    import torch

    from kafila.models.torch.packed import PackedLinear
    from tests.gguf_files import random_blocks

    raw = random_blocks(kind, (24, 768), np.random.default_rng(13), std=0.05)
    qtype = gguf.GGMLQuantizationType[kind]
    want = np.asarray(gguf.quants.dequantize(raw, qtype), np.float32).reshape(24, 768)
    p = types.repack(raw, int(qtype), (24, 768), fmt)
    assert p.fmt == fmt and p.nbytes == raw.nbytes and types.how(int(qtype), fmt) == "kept"
    assert p.data.shape == (24, 3 * size) and p.scales.shape == (24, 3)
    blocks = raw.reshape(24, 3, -1)
    kept = np.delete(blocks, [a + i for a in scales for i in (0, 1)], axis=2)
    assert np.array_equal(p.data, kept.reshape(24, -1))  # the rest of each block, as stored
    assert np.array_equal(dequantize(p).view(np.uint32), want.view(np.uint32))
    got = PackedLinear.from_packed(p, torch.device("cpu")).dequantized(
        torch.tensor([5, 0, 23]), torch.float32
    )
    assert np.array_equal(got.numpy().view(np.uint32), want[[5, 0, 23]].view(np.uint32))
    with pytest.raises(ValueError, match="not a multiple of 256"):
        types.repack(raw[:, : raw.shape[1] // 3], int(qtype), (24, 128), fmt)


@pytest.mark.parametrize(
    ("kind", "fmt"), [("Q4_K", "q4k"), ("Q5_K", "q5k"), ("Q6_K", "int8"), ("Q6_K", "q6k"), ("Q3_K", "q4")]
)
def test_row_chunks_serve_the_whole_matrix(kind: str, fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Large matrices are repacked and requantized `REQUANT_ROWS` rows at a time: the same arrays
    and the same measured error as at once."""
    from tests.gguf_files import random_blocks

    qtype = int(gguf.GGMLQuantizationType[kind])
    raw = random_blocks(kind, (40, 512), np.random.default_rng(5), std=0.05)
    whole, error = types.serve(raw, qtype, (40, 512), fmt)
    monkeypatch.setattr(types, "REQUANT_ROWS", 16)  # 40 rows: chunks of 16, 16 and 8
    chunked, chunked_error = types.serve(raw, qtype, (40, 512), fmt)
    assert np.array_equal(whole.data, chunked.data) and np.array_equal(whole.scales, chunked.scales)
    assert (whole.mins is None) == (chunked.mins is None)
    assert whole.mins is None or np.array_equal(whole.mins, chunked.mins)
    if error is not None and chunked_error is not None:
        assert chunked_error.count == error.count and chunked_error.worst == error.worst
        assert chunked_error.relative_rms == pytest.approx(error.relative_rms, rel=1e-9)
    else:
        assert error is None and chunked_error is None


@pytest.mark.parametrize(
    ("kind", "fmt"),
    [("Q4_K", "int8"), ("Q5_K", "int8"), ("Q6_K", "int8"), ("Q5_1", "int8"), ("Q3_K", "q4"),
     ("Q2_K", "q4"), ("Q3_K", "int8"), ("Q2_K", "int8"), ("Q4_1", "int8")],
)  # fmt: skip
def test_each_requantized_type_is_within_half_a_step_of_gguf_quants(kind: str, fmt: str) -> None:
    """Requantized from gguf.quants' values, each entry is within half its group's step (plus the
    float16 rounding of a q4 group's min and float32 rounding), and the measured error says so."""
    from tests.gguf_files import K_SCALES, random_blocks

    qtype = gguf.GGMLQuantizationType[kind]
    rows, cols = 32, 512
    rng = np.random.default_rng(int(qtype))
    if kind in K_SCALES:
        raw = random_blocks(kind, (rows, cols), rng, std=0.05)
    else:
        raw = np.asarray(gguf.quants.quantize(_weights(int(qtype), (rows, cols)), qtype))
    want = gguf.quants.dequantize(raw, qtype).reshape(rows, cols).astype(np.float64)
    packed, error = types.serve(raw, int(qtype), (rows, cols), fmt)
    assert packed.fmt == fmt and error is not None and types.how(int(qtype), fmt) == "requantized"
    got = dequantize(packed).astype(np.float64).reshape(rows, cols // 32, 32)
    step = packed.scales.astype(np.float64)[..., None]
    low = 0.0 if packed.mins is None else _half_ulp16(packed.mins.astype(np.float64))[..., None]
    top = np.abs(want).reshape(rows, cols // 32, 32).max(axis=2, keepdims=True)
    bound = step / 2 * (1 + 2.0**-9) + low + 2.0**-22 * top
    err = np.abs(got - want.reshape(got.shape))
    assert (err <= bound).all(), float((err - bound).max())
    assert error.count == rows * cols and 0.0 < error.worst_steps <= 0.5 + 2.0**-8
    assert error.worst == pytest.approx(float(err.max()), rel=1e-6)
    assert error.relative_rms == pytest.approx(float(np.sqrt((err**2).sum() / (want**2).sum())), rel=1e-6)


def test_a_group_takes_each_types_own_format_or_none() -> None:
    assert types.group_formats([types.Q8_0, types.Q4_0, types.Q5_0]) == ["int8", "q4", "q5"]
    assert types.group_formats([types.Q4_1, types.Q8_0]) == ["q4", "int8"]
    assert types.group_formats([types.Q4_K, types.Q4_K, types.Q6_K]) == ["q4k", "q4k", "q6k"]
    assert types.group_formats([types.Q5_K, types.Q5_1]) == ["q5k", "q5"]
    assert types.group_formats([types.Q4_K, types.F16]) is None


def test_mixed_file_serves_each_tensor_in_its_own_type(mixed_folder: Path, capsys_module: list[str]) -> None:
    ckpt = Checkpoint.open(mixed_folder, complete=True)
    t = ckpt.tensors
    assert t["model.layers.0.self_attn.k_proj.weight"].dtype == "U8"  # Q4_0 as q4 between int8 q and v
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == "I8"  # Q8_0
    assert t["model.layers.0.mlp.up_proj.weight"].dtype == "U8"  # Q4_0 as q4 beside Q4_1 gate
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == "U8"  # Q5_0 as q5
    assert "model.layers.0.mlp.down_proj.high" in t
    assert t["model.layers.1.mlp.down_proj.weight"].dtype == "U8"  # Q5_1 as q5
    assert t["model.layers.1.self_attn.v_proj.weight"].dtype == "U8"  # Q4_1: kept
    assert ckpt.stored_format == "q4"  # 11 q4 and q5 matrices, 3 int8
    lines = "\n".join(capsys_module)
    assert "requantized" not in lines
    assert "widened" not in lines and "F32" not in lines
    # the planner prices the bytes each block holds: exactly its entries in the file
    m = ckpt.manifest()
    for i in range(2):
        held = sum(v.nbytes for n, v in t.items() if n.startswith(f"model.layers.{i}."))
        assert m.block_bytes[i] == held


def test_tokenizer_from_metadata_gives_the_hf_tokenizers_ids(qwen3_tokenizer_dir: Path) -> None:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(qwen3_tokenizer_dir / "tokenizer.json"))
    ours = build_tokenizer(qwen3_tokenizer_meta(qwen3_tokenizer_dir), Path("meta.gguf"))
    for text in TEXTS:
        assert ours.encode(text).ids == hf.encode(text).ids, text
        assert ours.decode(ours.encode(text).ids, skip_special_tokens=False) == text


def test_folder_carries_chat_template_and_special_tokens(mixed_folder: Path) -> None:
    ckpt = Checkpoint.open(mixed_folder)
    assert ckpt.chat_template is not None and "<|im_start|>" in ckpt.chat_template
    st = ckpt.special_tokens
    assert (st.eos, st.eos_ids) == ("<|im_end|>", (151645,))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("backend", "quant"),
    [("torch", "auto"), ("torch", "none"), ("mlx", "auto")],
    ids=["packed", "widened", "mlx-packed"],
)
@pytest.mark.parametrize("file", ["mixed", "kquant"])
def test_engine_logits_track_the_float_model_of_the_same_values(
    file: str, tmp_path: Path, backend: str, quant: str, request: pytest.FixtureRequest
) -> None:
    """Greedy tokens equal transformers' on the served values as F32 weights (gguf.quants' values
    where they are kept; the tests above bound the others). Served packed, the products round the
    activations to int8 groups (as llama.cpp's do): logits within 2% of the logits' spread in RMS,
    10% at most. Widened (quant none), the same float model: within 1e-4 of it. On MLX (mlx[cpu]
    here) the packed matrices are MLX's affine quantized layout (`mx.quantized_matmul`, group 32)
    holding the same values, the file served as it is on the CPU kernels."""
    if backend == "mlx":
        pytest.importorskip("mlx.core")
    import torch
    import transformers

    from kafila.engine.stage import Stage

    source: Path = request.getfixturevalue(f"{file}_gguf")
    folder: Path = request.getfixturevalue(f"{file}_folder")
    ref_folder = float_folder(source, tmp_path / "float", served=folder)
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    prompt = [9707, 11, 1879, 0, 3555, 374, 279, 6722]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)  # fmt: skip
    want_ids = out.sequences[0, len(prompt) :].tolist()
    ckpt = Checkpoint.open(folder)
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend=backend, dtype="fp32", context=64, quant=quant
    )
    if backend == "mlx":  # every block matrix held packed in MLX's layout, none widened
        from kafila.models.mlx.llama import Packed, Stacked

        mats = [getattr(b, m) for b in stage.model.blocks for m in ("wqkv", "wo", "w_gate_up", "w_down")]
        parts = [p for w in mats for p in (w.parts if isinstance(w, Stacked) else [w])]
        assert all(isinstance(p, Packed) for p in parts)
        assert any(isinstance(w, Stacked) for w in mats)  # a fused product of several formats
    got_ids, got_logits = _greedy(stage, prompt, 6)
    assert got_ids == want_ids
    want = torch.stack(out.logits).squeeze(1).numpy()
    diff, spread = np.asarray(got_logits) - want, float(want.std())
    rms, worst = float(np.sqrt((diff**2).mean())) / spread, float(np.abs(diff).max()) / spread
    if quant == "none":
        assert worst <= 1e-4, (rms, worst)
    else:
        assert rms <= 0.02 and worst <= 0.10, (rms, worst)


def _greedy(stage: Any, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """`n` greedy tokens from one stage holding the whole model, and the logits each came from."""
    stage.open("r")
    [h] = stage.forward([("r", 0, stage.embed(prompt))])
    logits = [np.asarray(stage.logits(h[-1]))]
    ids = [int(logits[-1].argmax())]
    for pos in range(len(prompt), len(prompt) + n - 1):
        [h] = stage.forward([("r", pos, stage.embed(ids[-1:]))])
        logits.append(np.asarray(stage.logits(h[-1])))
        ids.append(int(logits[-1].argmax()))
    stage.close("r")
    return ids, logits


def test_split_stages_give_the_one_stage_logits_exactly(mixed_folder: Path) -> None:
    from kafila.engine.stage import Stage
    from tests.engine.test_stage import _decode_run

    ckpt = Checkpoint.open(mixed_folder)

    def load(blocks: range, head: bool) -> Stage:
        return Stage.load(ckpt, blocks, head, backend="torch", dtype="fp32", context=32)

    full = _decode_run([load(range(2), True)], steps=4)
    split = _decode_run([load(range(0, 1), True), load(range(1, 2), False)], wire=True, steps=4)
    for ours, want in zip(split, full, strict=True):
        assert np.array_equal(ours, want)


def test_default_gguf_converts_to_the_default_packed_folder(
    cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kafila.models.default import DEFAULT_MODELS, DefaultModelUnavailable, ensure_default, locate_gguf

    try:
        file = locate_gguf(DEFAULT_MODELS["smollm2-135m"])
    except DefaultModelUnavailable as exc:
        pytest.skip(str(exc))
    ours = Checkpoint.open(ensure_gguf(file, progress=False), complete=True)
    default = Checkpoint.open(ensure_default("smollm2-135m", progress=False, packed=True), complete=True)
    assert ours.config == default.config
    assert sorted(ours.tensors) == sorted(default.tensors)
    names = [
        "model.layers.7.self_attn.q_proj.weight",
        "model.layers.7.self_attn.k_proj.mins",
        "lm_head.weight",
    ]
    names = [n for n in names if n in default.tensors] + ["model.embed_tokens.scales"]
    got, want = ours.read(names), default.read(names)
    assert all(got[n][1] == want[n][1] for n in names)
    assert ours.manifest() == default.manifest()
    from tokenizers import Tokenizer

    a = Tokenizer.from_file(str(ours.tokenizer_file))
    b = Tokenizer.from_file(str(default.tokenizer_file))
    for text in TEXTS:
        assert a.encode(text).ids == b.encode(text).ids


def test_unsupported_architecture_and_type_are_named(
    tmp_path: Path, qwen3_tokenizer_dir: Path, cache: Path
) -> None:
    meta = qwen3_tokenizer_meta(qwen3_tokenizer_dir)
    small = Shape(hidden=256, layers=1, heads=4, kv_heads=2, head_dim=64, ffn=256)
    tokens = {"tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"][:512], "tokenizer.ggml.merges": []}
    meta_small = {**meta, **tokens, "tokenizer.ggml.token_type": [1] * 512}  # refused before it is read
    gemma = write_gguf(tmp_path / "gemma.gguf", small, meta_small, {}, tied=True, arch="gemma")
    with pytest.raises(GGUFError, match=r"architecture 'gemma'.*llama and qwen3"):
        ensure_gguf(gemma, progress=False)
    iq = write_gguf(tmp_path / "iq.gguf", small, meta_small, {"attn_q": "IQ4_NL"}, tied=True)
    with pytest.raises(types.UnsupportedType, match=r"blk\.0\.attn_q\.weight is IQ4_NL"):
        ensure_gguf(iq, progress=False)


def test_config_json_names_the_served_format(mixed_folder: Path) -> None:
    config = json.loads((mixed_folder / "config.json").read_text())
    assert config["quantization_config"]["format"] == "q4"  # most block matrices
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] is True


LLAMA_QUANTIZE = (
    Path.home() / ".cache/kafila/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize"
)  # built by benchmarks/llama_build.py


@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_QUANTIZE.is_file(), reason="llama.cpp is not built (benchmarks/llama_build.py)")
@pytest.mark.parametrize("kind", ["Q4_K_M", "Q4_0"])
def test_llama_quantized_default_model_serves_gguf_quants_values(
    kind: str, tmp_path: Path, cache: Path
) -> None:
    """The default model requantized by llama.cpp (its K-quants fall back to Q5_0/Q8_0 on rows of
    576): every tensor Kafila serves holds gguf.quants' values of the file's tensor."""
    import subprocess

    from kafila.models.default import DEFAULT_MODELS, locate_gguf

    source = locate_gguf(DEFAULT_MODELS["smollm2-135m"])
    file = tmp_path / f"smollm2.{kind}.gguf"
    subprocess.run(
        [str(LLAMA_QUANTIZE), "--allow-requantize", str(source), str(file), kind],
        capture_output=True,
        check=True,
    )
    _check_served_values(file)


def _check_served_values(file: Path, fresh: bool = True) -> dict[str, str]:
    """Every tensor of the folder `file` converts to holds gguf.quants' values of the file's tensor
    (a Llama's q/k rows put back) where its levels are kept, and is within half a step of its
    served group of them (plus a q4 min's float16 rounding) where the product scales were rounded
    or it was requantized; (`fresh`: converted here) each requantized type was said on the
    console. Returns how each tensor was served."""
    from kafila.models.default import GGUFFile
    from kafila.models.gguf_convert import tensor_name
    from kafila.models.gguf_types import unpermute_qk

    lines: list[str] = []
    ckpt = Checkpoint.open(ensure_gguf(file, progress=False, say=lines.append), complete=True)
    gf = GGUFFile.open(file)
    arch = ckpt.config.model_type
    heads = {"q_proj": ckpt.config.num_attention_heads, "k_proj": ckpt.config.num_key_value_heads}
    served: dict[str, str] = {}
    for t in gf.tensors:
        name = tensor_name(t.name, arch)
        raw = gf.raw(t)
        want = raw.view(np.float32) if t.ggml_type == 0 else gguf.quants.dequantize(raw, t.ggml_type)
        want = np.asarray(want, np.float32).reshape(t.shape)
        for proj, n in heads.items():
            if arch == "llama" and name.endswith(f"{proj}.weight"):
                want = unpermute_qk(want, n)
        got = served_values(ckpt, name)
        fmt = packed_format(name, {n: info.spec for n, info in ckpt.tensors.items()})
        served[name] = "float" if fmt == "none" else types.how(t.ggml_type, fmt)
        if served[name] in ("float", "kept"):
            assert np.array_equal(got, want), name
        else:
            _assert_within_half_a_step(ckpt, name, got, want)
    requantized = [t for t in gf.tensors if served[tensor_name(t.name, arch)] == "requantized"]
    said = {types.type_name(t.ggml_type) for t in requantized}
    assert not fresh or all(any(f" {k} requantized" in line for line in lines) for k in said), (said, lines)
    return served


def _assert_within_half_a_step(ckpt: Checkpoint, name: str, got: np.ndarray, want: np.ndarray) -> None:
    base = name.removesuffix("weight")
    read = ckpt.read([n for n in (base + "scales", base + "mins") if n in ckpt.tensors])
    step = np.frombuffer(bytes(read[base + "scales"][1]), np.float16).astype(np.float64)
    rows, cols = got.shape
    bound = step.reshape(rows, cols // 32, 1) / 2 * (1 + 2.0**-9)
    if base + "mins" in read:
        mins = np.frombuffer(bytes(read[base + "mins"][1]), np.float16).astype(np.float64)
        bound = bound + _half_ulp16(mins).reshape(rows, cols // 32, 1)
    w = want.astype(np.float64).reshape(rows, cols // 32, 32)
    bound = bound + 2.0**-22 * np.abs(w).max(axis=2, keepdims=True)
    err = np.abs(got.astype(np.float64).reshape(w.shape) - w)
    assert (err <= bound).all(), (name, float((err - bound).max()))


def test_mixed_file_serves_gguf_quants_values_in_every_tensor(mixed_gguf: Path, mixed_folder: Path) -> None:
    _check_served_values(mixed_gguf, fresh=False)  # converted by the fixture, which said so


def test_kquant_file_serves_each_type_packed(
    kquant_gguf: Path, kquant_folder: Path, kquant_lines: list[str]
) -> None:
    """Q4_K, Q5_K and Q6_K are q4k, q5k and q6k, Q5_1 q5, all as stored (block 0's q/k/v a stacked
    product of q4k and q6k), Q3_K and Q2_K requantized, each within half a step of
    gguf.quants' values; nothing widened; the console names each requantized type with its bytes
    and the error it measured."""
    served = _check_served_values(kquant_gguf, fresh=False)
    t = Checkpoint.open(kquant_folder).tensors
    assert served["model.layers.0.mlp.down_proj.weight"] == "kept"  # Q6_K as q6k: its own bytes
    down = t["model.layers.0.mlp.down_proj.weight"]
    assert down.dtype == "U8" and "model.layers.0.mlp.down_proj.mins" not in t
    assert served["model.layers.0.self_attn.v_proj.weight"] == "kept"  # Q6_K beside Q4_K q and k
    assert served["model.embed_tokens.weight"] == "kept" and t["model.embed_tokens.weight"].dtype == "U8"
    assert served["model.layers.0.self_attn.q_proj.weight"] == "kept"  # Q4_K beside Q6_K's v: q4k
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == "U8"
    assert served["model.layers.1.self_attn.q_proj.weight"] == "kept"
    assert t["model.layers.1.mlp.gate_proj.weight"].dtype == "U8"  # Q3_K to q4, beside Q2_K's
    assert t["model.layers.1.mlp.down_proj.weight"].dtype == "U8"  # Q5_1 as q5
    assert served["model.layers.1.mlp.down_proj.weight"] == "kept"
    assert served["model.layers.0.self_attn.o_proj.weight"] == "kept"  # Q5_K as q5k
    assert all(v != "float" for n, v in served.items() if t[n].shape and len(t[n].shape) == 2)
    lines = "\n".join(kquant_lines)
    for kind, fmt in [("Q3_K", "q4"), ("Q2_K", "q4")]:
        assert f"{kind} requantized to {fmt}" in lines, lines
    assert not any(f"{k} requantized" in lines for k in ("Q4_K", "Q5_K", "Q6_K", "Q5_1"))
    assert "widened" not in lines and "F32" not in lines


LLAMA31 = {  # Llama 3.1's rope_scaling, its original context cut to this tiny model's
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


def _llama_cpp_rope_freqs(theta: float, dim: int, s: dict[str, Any]) -> np.ndarray:
    """The factors llama.cpp's converter (convert_hf_to_gguf.py, LlamaModel) writes as rope_freqs
    for a llama3 rope_scaling: 1 for high frequencies, `factor` for low ones, smoothed between."""
    import math

    import torch

    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    old, low, high, factor = (
        s["original_max_position_embeddings"], s["low_freq_factor"], s["high_freq_factor"], s["factor"]
    )  # fmt: skip
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


@pytest.mark.slow
def test_llama31_rope_freqs_follow_transformers_llama3_scaling(
    tmp_path: Path, qwen3_tokenizer_dir: Path, cache: Path
) -> None:
    """A Llama GGUF with rope_freqs (as llama.cpp writes Llama 3.1's) serves transformers' llama3
    RoPE scaling: inverse frequencies within float32 rounding of transformers' and logits over 200
    positions within 1e-4 of the logits' spread of a transformers Llama with that rope_scaling,
    where leaving the factors out moves them by far more."""
    import torch
    import transformers
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kafila.engine.stage import Stage
    from kafila.models import rope

    meta = qwen3_tokenizer_meta(qwen3_tokenizer_dir)
    tokens = {"tokenizer.ggml.tokens": meta["tokenizer.ggml.tokens"][:512], "tokenizer.ggml.merges": []}
    meta = {**meta, **tokens, "tokenizer.ggml.token_type": [1] * 512, "tokenizer.chat_template": None}
    for key in ("bos", "eos", "padding"):
        meta[f"tokenizer.ggml.{key}_token_id"] = 0
    shape = Shape(arch="llama", hidden=256, layers=1, heads=4, kv_heads=2, head_dim=64, ffn=256)
    factors = _llama_cpp_rope_freqs(1_000_000.0, 64, LLAMA31)
    file = write_gguf(tmp_path / "llama31.gguf", shape, meta, {}, rope_freqs=factors)
    folder = ensure_gguf(file, progress=False)
    ckpt = Checkpoint.open(folder)
    assert ckpt.config.rope_scaling == {"rope_type": "freq_factors", "freq_factors": factors.tolist()}

    ref_folder = float_folder(file, tmp_path / "float")
    config = json.loads((ref_folder / "config.json").read_text()) | {"rope_scaling": LLAMA31}
    (ref_folder / "config.json").write_text(json.dumps(config))
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    want_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](ref.config, "cpu")
    np.testing.assert_allclose(rope.inv_freq(ckpt.config), want_freq.numpy(), rtol=2e-7, atol=0)

    prompt = [int(i) for i in np.random.default_rng(3).integers(1, 512, 200)]
    with torch.no_grad():
        want = ref(torch.tensor([prompt])).logits[0].numpy()
    spread = float(want.std())

    def served(c: Checkpoint) -> np.ndarray:
        stage = Stage.load(c, range(1), True, backend="torch", dtype="fp32", context=256, quant="none")
        stage.open("r")
        [h] = stage.forward([("r", 0, stage.embed(prompt))])
        stage.close("r")
        return np.stack([np.asarray(stage.logits(h[i])) for i in range(len(prompt))])

    worst = float(np.abs(served(ckpt) - want).max()) / spread
    assert worst <= 1e-4, worst
    plain = shutil.copytree(folder, tmp_path / "no-factors")
    config = json.loads((plain / "config.json").read_text()) | {"rope_scaling": None}
    (plain / "config.json").write_text(json.dumps(config))
    assert float(np.abs(served(Checkpoint.open(plain)) - want).max()) / spread > 100 * max(worst, 1e-5)
