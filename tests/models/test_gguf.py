"""GGUF files as models: every type's values as gguf.quants gives them, the folder they convert to,
the tokenizer from the file's metadata, and the engine's logits against a float model."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kafila.models import gguf_types as types
from kafila.models.checkpoint import Checkpoint
from kafila.models.gguf_convert import GGUFError, build_tokenizer, ensure_gguf
from kafila.models.quant import dequantize
from tests.gguf_files import Shape, float_folder, qwen3_tokenizer_meta, write_gguf

gguf = pytest.importorskip("gguf")

# per-tensor types of the mixed file: q/k/v share int8 (Q4_0 joins as int8), gate/up share q4 (Q4_0
# as q4), Q5_0 as int8; block 1 mixes q4 and int8 in q/k/v and holds a Q5_1 matrix (both widened)
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
TEXTS = [
    "What is the capital of France?",
    "  indented\n\ttabs  and   spaces\r\n",
    "naïve café – 東京 🚀 x=12345 don't I'LL",
    "<|im_start|>user\nhi<think>ok</think><|im_end|>",
]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A model cache of this module's own (conversions land there, not in the user's)."""
    folder = tmp_path_factory.mktemp("kafila-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KAFILA_CACHE", str(folder))
        yield folder


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


def _weights(seed: int, shape: tuple[int, int]) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal(shape).astype(np.float32)
    w[0, :32] = 0.0  # a block of zeros (scale 0)
    w[1, :32] *= 1000.0  # a block of large values
    return w


@pytest.mark.parametrize(
    ("kind", "fmt"), [("Q8_0", "int8"), ("Q4_1", "q4"), ("Q4_0", "q4"), ("Q4_0", "int8"), ("Q5_0", "int8")]
)
def test_each_repacked_type_dequantizes_to_gguf_quants_values(kind: str, fmt: str) -> None:
    qtype = gguf.GGMLQuantizationType[kind]
    blocks = gguf.quants.quantize(_weights(int(qtype), (64, 512)), qtype)
    want = gguf.quants.dequantize(blocks, qtype).reshape(64, 512).astype(np.float32)
    got = dequantize(types.repack(blocks, int(qtype), (64, 512), fmt))
    assert np.array_equal(got, want)
    if (kind, fmt) != ("Q4_0", "q4"):  # d q + (-8 d) may give +0 where d (q - 8) gives -0
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_group_takes_one_format_or_none() -> None:
    assert types.group_format([types.Q8_0, types.Q4_0, types.Q5_0]) == "int8"
    assert types.group_format([types.Q4_1, types.Q4_0]) == "q4"
    assert types.group_format([types.Q4_1, types.Q8_0]) is None
    assert types.group_format([types.Q4_K, types.Q4_K]) is None


def test_mixed_file_serves_each_tensor_in_its_own_type(mixed_folder: Path, capsys_module: list[str]) -> None:
    ckpt = Checkpoint.open(mixed_folder, complete=True)
    t = ckpt.tensors
    assert t["model.layers.0.self_attn.k_proj.weight"].dtype == "I8"  # Q4_0 joined int8 q/v
    assert t["model.layers.0.mlp.up_proj.weight"].dtype == "U8"  # Q4_0 as q4 beside Q4_1 gate
    assert t["model.layers.0.mlp.down_proj.weight"].dtype == "I8"  # Q5_0
    assert t["model.layers.1.mlp.down_proj.weight"].dtype == "F32"  # Q5_1: widened
    assert t["model.layers.1.self_attn.q_proj.weight"].dtype == "F32"  # q4 + int8 group: widened
    assert ckpt.stored_format == "q4"  # 6 q4 matrices, 4 int8
    lines = "\n".join(capsys_module)
    assert "Q5_1 has no packed format" in lines and "98304 bytes in the file -> 524288 bytes" in lines
    assert "Q4_1 is in a fused product" in lines
    # the planner prices the bytes each block holds: exactly its entries in the file
    m = ckpt.manifest()
    for i in range(2):
        held = sum(v.nbytes for n, v in t.items() if n.startswith(f"model.layers.{i}."))
        assert m.block_bytes[i] == held
    assert m.block_bytes[1] > m.block_bytes[0]  # the widened tensors cost their F32 bytes


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
@pytest.mark.parametrize("quant", ["auto", "none"], ids=["packed", "widened"])
def test_engine_logits_track_the_float_model_of_the_same_values(
    mixed_gguf: Path, mixed_folder: Path, tmp_path: Path, quant: str
) -> None:
    """Greedy tokens equal transformers' on the dequantized F32 weights. Served packed, the products
    round the activations to int8 groups (as llama.cpp's do): logits within 2% of the logits'
    spread in RMS, 10% at most. Widened (quant none), the same float model: within 1e-4 of it."""
    import torch
    import transformers

    from kafila.engine.stage import Stage

    ref_folder = float_folder(mixed_gguf, tmp_path / "float")
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_folder, dtype=torch.float32).eval()
    prompt = [9707, 11, 1879, 0, 3555, 374, 279, 6722]
    with torch.no_grad():
        out = ref.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, output_logits=True,
                           return_dict_in_generate=True)  # fmt: skip
    want_ids = out.sequences[0, len(prompt) :].tolist()
    ckpt = Checkpoint.open(mixed_folder)
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend="torch", dtype="fp32", context=64, quant=quant
    )
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
    assert config["quantization_config"]["format"] == "q4"
    assert config["model_type"] == "qwen3" and config["tie_word_embeddings"] is True


LLAMA_QUANTIZE = (
    Path.home() / ".cache/kafila/llama.cpp/llama_cpp_python-0.3.36/vendor/llama.cpp/build/bin/llama-quantize"
)  # built by benchmarks/llama_build.py


def _served_values(ckpt: Checkpoint, name: str) -> np.ndarray:
    """Tensor `name` of a converted folder as float32: a packed matrix dequantized, floats widened."""
    from kafila.models.quant import from_entries

    base = name.removesuffix("weight")
    names = [n for n in (name, base + "scales", base + "mins") if n in ckpt.tensors]
    raw = ckpt.read(names)

    def array(n: str) -> np.ndarray:
        info, data = raw[n]
        kind = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8}[info.dtype]
        return np.frombuffer(bytes(data), dtype=kind).reshape(info.shape)

    if len(names) == 1:
        return array(name).astype(np.float32)
    fmt = "q4" if base + "mins" in raw else "int8"
    mins = array(base + "mins") if fmt == "q4" else None
    return dequantize(from_entries(fmt, array(name), array(base + "scales"), mins))


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


def _check_served_values(file: Path, fresh: bool = True) -> None:
    """Every tensor of the folder `file` converts to holds gguf.quants' values of the file's tensor
    (a Llama's q/k rows put back), and (`fresh`: converted here) each widened type was said on
    the console."""
    from kafila.models.default import GGUFFile, unpermute_qk
    from kafila.models.gguf_convert import tensor_name

    lines: list[str] = []
    ckpt = Checkpoint.open(ensure_gguf(file, progress=False, say=lines.append), complete=True)
    gf = GGUFFile.open(file)
    arch = ckpt.config.model_type
    heads = {"q_proj": ckpt.config.num_attention_heads, "k_proj": ckpt.config.num_key_value_heads}
    for t in gf.tensors:
        name = tensor_name(t.name, arch)
        raw = gf.raw(t)
        want = raw.view(np.float32) if t.ggml_type == 0 else gguf.quants.dequantize(raw, t.ggml_type)
        want = np.asarray(want, np.float32).reshape(t.shape)
        for proj, n in heads.items():
            if arch == "llama" and name.endswith(f"{proj}.weight"):
                want = unpermute_qk(want, n)
        assert np.array_equal(_served_values(ckpt, name), want), name
    widened = {types.type_name(t.ggml_type) for t in gf.tensors if t.ggml_type in types.WIDENED}
    assert not fresh or all(any(f" {w} " in line for line in lines) for w in widened), (widened, lines)


def test_mixed_file_serves_gguf_quants_values_in_every_tensor(mixed_gguf: Path, mixed_folder: Path) -> None:
    _check_served_values(mixed_gguf, fresh=False)  # converted by the fixture, which said so
