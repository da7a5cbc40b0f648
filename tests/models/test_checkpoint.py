"""Checkpoint: headers parsed by hand agree with safetensors, ranged reads read only what is asked,
and every kind of broken folder gives an error that names the file and the problem."""

from __future__ import annotations

import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import pytest
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import kafila.models.checkpoint as checkpoint_module
from kafila.models.checkpoint import Checkpoint, CheckpointError
from kafila.models.manifest import EMBED, FINAL_NORM, LM_HEAD, block_index

TinyFactory = Callable[..., Path]


def _reference(folder: Path) -> dict[str, bytes]:
    """Every tensor's bytes as safetensors itself loads them."""
    out: dict[str, bytes] = {}
    for file in sorted(folder.glob("*.safetensors")):
        for name, array in load_file(file).items():
            out[name] = array.tobytes()
    return out


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize("shape", ["llama-gqa3-tied", "llama-mha-untied", "qwen3-gqa2-untied"])
def test_headers_match_safetensors(tiny_checkpoint: TinyFactory, shape: str, sharded: bool) -> None:
    folder = tiny_checkpoint(shape, sharded=sharded)
    ckpt = Checkpoint.open(folder)
    if sharded:
        assert len({t.file for t in ckpt.tensors.values()}) > 2
    seen = set()
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(file, "np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                info = ckpt.tensors[name]
                sl = f.get_slice(name)
                assert info.file == file.resolve()
                assert info.shape == tuple(sl.get_shape())
                assert info.dtype == sl.get_dtype()
                seen.add(name)
    assert seen == set(ckpt.tensors)
    assert ckpt.tied == (LM_HEAD not in seen)
    assert ckpt.config.num_hidden_layers == ckpt.n_blocks == 5


@pytest.mark.parametrize("sharded", [False, True])
@pytest.mark.parametrize(
    ("blocks", "head"), [(range(0, 1), True), (range(1, 3), False), (range(2, 5), True), (range(0, 0), True)]
)
def test_ranged_read_reads_only_those_tensors(
    tiny_checkpoint: TinyFactory, sharded: bool, blocks: range, head: bool
) -> None:
    folder = tiny_checkpoint("llama-mha-untied", sharded=sharded)
    ref = _reference(folder)
    ckpt = Checkpoint.open(folder)
    names = ckpt.names_for(blocks, head)
    expected = {n for n in ref if (block_index(n) in blocks) or (head and block_index(n) is None)}
    assert set(names) == expected
    if head:
        assert {EMBED, FINAL_NORM, LM_HEAD} <= set(names)
    got = ckpt.read(names)
    assert ckpt.bytes_read == sum(len(ref[n]) for n in expected)
    assert ckpt.bytes_read < sum(len(b) for b in ref.values())
    for name, (info, data) in got.items():
        assert info.name == name
        assert data == ref[name], name


def test_tied_head_has_no_lm_head(tiny_checkpoint: TinyFactory) -> None:
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3-gqa4-tied"))
    assert ckpt.tied
    assert set(ckpt.names_for(range(0, 0), head=True)) == {EMBED, FINAL_NORM}


def test_adjacent_ranges_are_read_in_one_span(
    tiny_checkpoint: TinyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))
    calls: list[tuple[int, int]] = []
    real_preadv = checkpoint_module.os.preadv

    def counting_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls.append((offset, len(buffers)))
        return real_preadv(fd, buffers, offset)

    monkeypatch.setattr(checkpoint_module.os, "preadv", counting_preadv)
    # transformers writes tensors sorted by name, so one block's tensors are contiguous
    names = ckpt.names_for(range(3, 4), head=False)
    got = ckpt.read(names)
    assert calls == [(min(ckpt.tensors[n].start for n in names), len(names))]
    assert ckpt.bytes_read == ckpt.manifest().block_bytes[3] == sum(len(b) for _, b in got.values())


def test_short_reads_are_resumed_simulated_kernel(
    tiny_checkpoint: TinyFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kernel returning at most 1000 bytes per read (as Linux does past 2 GiB), simulated by
    handing the real preadv a truncated first buffer; the bytes must still be exact."""
    folder = tiny_checkpoint("llama-mha-untied")
    ckpt = Checkpoint.open(folder)
    real_preadv = checkpoint_module.os.preadv
    calls = 0

    def short_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        nonlocal calls
        calls += 1
        return real_preadv(fd, [buffers[0][:1000]], offset)

    monkeypatch.setattr(checkpoint_module.os, "preadv", short_preadv)
    names = ckpt.names_for(range(0, 5), head=True)
    got = ckpt.read(names)
    ref = _reference(folder)
    assert all(bytes(data) == ref[name] for name, (_, data) in got.items())
    assert calls >= ckpt.bytes_read // 1000


def test_generation_config_template_and_special_tokens(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    shutil.copytree(tiny_checkpoint("llama-gqa3-tied"), folder)
    (folder / "tokenizer.json").write_text("{}")
    tok = {"bos_token": {"content": "<s>"}, "eos_token": "</s>", "chat_template": "from-config"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    gen = json.loads((folder / "generation_config.json").read_text()) | {"eos_token_id": [2, 7]}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    ckpt = Checkpoint.open(folder)
    assert ckpt.tokenizer_file == folder / "tokenizer.json"
    assert ckpt.chat_template == "from-config"
    assert ckpt.generation_config["eos_token_id"] == [2, 7]
    st = ckpt.special_tokens
    assert (st.bos, st.eos, st.pad, st.bos_id, st.eos_ids, st.pad_id) == ("<s>", "</s>", None, 1, (2, 7), 0)
    (folder / "chat_template.jinja").write_text("from-jinja")  # wins, as in transformers
    assert Checkpoint.open(folder).chat_template == "from-jinja"
    tok["chat_template"] = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    (folder / "chat_template.jinja").unlink()
    (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    assert Checkpoint.open(folder).chat_template == "d"


# --- bad input -------------------------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _write_raw(file: Path, header: dict[str, object], data: bytes) -> None:
    raw = json.dumps(header).encode()
    file.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _expect(folder: Path, *fragments: str) -> None:
    with pytest.raises(CheckpointError) as info:
        Checkpoint.open(folder)
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_missing_folder(tmp_path: Path) -> None:
    _expect(tmp_path / "nope", str(tmp_path / "nope"), "no such model folder")


def test_missing_config(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    (folder / "config.json").unlink()
    _expect(folder, "config.json", "missing")


def test_config_not_json(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    (folder / "config.json").write_text("{not json")
    _expect(folder, "config.json", "not valid JSON")


def test_unknown_architecture(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg |= {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}
    (folder / "config.json").write_text(json.dumps(cfg))
    _expect(folder, "config.json", "unknown architecture", "gpt2")


def test_no_safetensors(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    (folder / "model.safetensors").unlink()
    _expect(folder, str(folder), "no safetensors")


def test_index_names_missing_shard(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied", sharded=True), tmp_path / "m")
    shard = sorted(folder.glob("model-*.safetensors"))[1]
    shard.unlink()
    _expect(folder, "model.safetensors.index.json", shard.name, "missing")


def test_index_maps_tensor_to_wrong_shard(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied", sharded=True), tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    name = next(n for n, s in index["weight_map"].items() if s == shards[0])
    index["weight_map"][name] = shards[1]
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect(folder, "model.safetensors.index.json", name, shards[1])


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        (b"\x10\x00", "shorter than the 8-byte header length"),
        (struct.pack("<Q", 10**6) + b"{}", "header length 1000000 is beyond the file's 10 bytes"),
        (struct.pack("<Q", 6) + b"{nope}", "not JSON"),
        (struct.pack("<Q", 2) + b"[]", "expected a JSON object"),
        (struct.pack("<Q", 20) + b'{"a": {"dtype": "F32"}}'[:20], "corrupt header"),
    ],
)
def test_corrupt_header(tiny_checkpoint: TinyFactory, tmp_path: Path, content: bytes, fragment: str) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    (folder / "model.safetensors").write_bytes(content)
    _expect(folder, "model.safetensors", fragment)


def test_truncated_data(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    file = folder / "model.safetensors"
    file.write_bytes(file.read_bytes()[:-100])
    _expect(folder, "model.safetensors", "past the file's", "truncated")


def _rewrite_header(folder: Path, edit: Callable[[dict[str, dict[str, object]]], None]) -> None:
    """Re-write model.safetensors with an edited header and the same data section."""
    file = folder / "model.safetensors"
    raw = file.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    _write_raw(file, header, raw[8 + n :])


def test_overlapping_ranges(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")

    def overlap(header: dict[str, dict[str, object]]) -> None:
        a, b = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]
        size = header[b]["data_offsets"][1] - header[b]["data_offsets"][0]  # type: ignore[index]
        start = header[a]["data_offsets"][0]  # type: ignore[index]
        header[b]["data_offsets"] = [start, start + size]

    _rewrite_header(folder, overlap)
    _expect(folder, "model.safetensors", "overlap")


def test_unknown_dtype(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    _rewrite_header(folder, lambda h: h[FINAL_NORM].update(dtype="Q4_K"))
    _expect(folder, "model.safetensors", FINAL_NORM, "unknown dtype 'Q4_K'")


def test_size_disagrees_with_shape(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    _rewrite_header(folder, lambda h: h[FINAL_NORM].update(shape=[7]))
    _expect(folder, "model.safetensors", FINAL_NORM, "needs 28 bytes")


def test_missing_embedding_is_named_in_manifest(tmp_path: Path, tiny_checkpoint: TinyFactory) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    tensors = load_file(folder / "model.safetensors")
    del tensors[EMBED]
    save_file(tensors, folder / "model.safetensors")
    with pytest.raises(CheckpointError, match=f"has no {EMBED}"):
        Checkpoint.open(folder).manifest()


def test_bad_block_range_and_unknown_name(tiny_checkpoint: TinyFactory) -> None:
    ckpt = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))
    with pytest.raises(CheckpointError, match=r"block range \[3, 6\).*5 blocks"):
        ckpt.names_for(range(3, 6), head=False)
    missing = "model.layers.9.mlp.up_proj.weight"
    with pytest.raises(CheckpointError, match=re.escape(f"no tensor named {missing!r}")):
        ckpt.read([missing])
    assert ckpt.bytes_read == 0


def test_file_truncated_after_open(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    ckpt = Checkpoint.open(folder)
    last = max(ckpt.tensors.values(), key=lambda t: t.end)
    with open(last.file, "r+b") as f:
        f.truncate(last.end - 10)
    with pytest.raises(CheckpointError, match=r"model\.safetensors: truncated: wanted bytes .* ends after"):
        ckpt.read([last.name])


def test_index_naming_a_file_outside_the_folder(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied", sharded=True), tmp_path / "m")
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "../elsewhere.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    _expect(folder, "model.safetensors.index.json", "'../elsewhere.safetensors' is not a file name inside")


def _with_config(tiny_checkpoint: TinyFactory, tmp_path: Path, **changes: object) -> Path:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(cfg | changes))
    return folder


def test_fewer_layers_in_the_config_than_the_checkpoint_holds_is_refused(
    tiny_checkpoint: TinyFactory, tmp_path: Path
) -> None:
    """Before, `kafila run` loaded only the config's blocks and answered, silently wrong."""
    n = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied")).n_blocks
    folder = _with_config(tiny_checkpoint, tmp_path, num_hidden_layers=n - 1)
    _expect(folder, f"model.layers.{n - 1}.", f"past config.json's num_hidden_layers={n - 1}")


def test_a_whole_model_missing_tensors_the_config_describes_is_refused_but_a_shard_is_not(
    tiny_checkpoint: TinyFactory, tmp_path: Path
) -> None:
    n = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied")).n_blocks
    folder = _with_config(tiny_checkpoint, tmp_path, num_hidden_layers=n + 2)
    with pytest.raises(
        CheckpointError, match=rf"tensor\(s\) that config.json describes are not in .* model.layers.{n}\."
    ):
        Checkpoint.open(folder, complete=True)
    assert Checkpoint.open(folder).n_blocks == n + 2  # a member's shard holds only its own blocks


def test_a_tensor_shape_other_than_the_config_gives_is_refused(
    tiny_checkpoint: TinyFactory, tmp_path: Path
) -> None:
    vocab = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied")).config.vocab_size
    folder = _with_config(tiny_checkpoint, tmp_path, vocab_size=vocab - 1)
    _expect(folder, "tensor model.embed_tokens.weight has shape", f"config.json gives [{vocab - 1}, ")


def test_packed_entries_of_no_formats_shapes_are_refused_naming_the_tensor(
    tiny_checkpoint: TinyFactory, tmp_path: Path
) -> None:
    """A U8 matrix whose scales give it 20 bytes per scale (no packed format has that) is refused
    with the folder, the tensor and the shapes, not taken for some format."""
    import numpy as np

    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    file = folder / "model.safetensors"
    tensors = load_file(file)
    name = "model.layers.0.mlp.down_proj.weight"
    out = tensors[name].shape[0]
    tensors[name] = np.zeros((out, 40), np.uint8)
    tensors[name.removesuffix("weight") + "scales"] = np.zeros((out, 2), np.float16)
    save_file(tensors, str(file))
    _expect(folder, str(folder), f"tensor {name}", "[.., 40] + scales [.., 2]", "match no packed format")


def test_a_listed_bos_token_id_takes_the_first(tiny_checkpoint: TinyFactory, tmp_path: Path) -> None:
    folder = _copy(tiny_checkpoint("llama-gqa3-tied"), tmp_path / "m")
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": [1, 2]}))
    assert Checkpoint.open(folder).special_tokens.bos_id == 1  # a TypeError traceback before
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": "one"}))
    _expect(folder, "a token id in generation_config.json or config.json")


@pytest.mark.parametrize(
    ("changes", "fragment"),
    [
        ({"num_attention_heads": 0}, "num_attention_heads must be a whole number >= 1, got 0"),
        ({"vocab_size": -5}, "vocab_size must be a whole number >= 1, got -5"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers must be a whole number >= 1, got 2.5"),
        ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
        ({"rms_norm_eps": -1e-5}, "rms_norm_eps must be a finite number > 0"),
        ({"rope_theta": 0}, "rope_theta must be a finite number > 0"),
        ({"num_key_value_heads": 5}, "is not a multiple of num_key_value_heads 5"),
        ({"eos_token_id": "x"}, "config.json: invalid literal for int()"),
        ({"rope_scaling": "linear"}, "rope_scaling must be an object, got 'linear'"),
        ({"hidden_act": "gelu"}, "hidden_act is 'gelu'; Kafila runs only 'silu'"),
        ({"mlp_bias": True}, "mlp_bias is True; Kafila runs only False"),
        (
            {"rope_scaling": {"rope_type": "llama3", "factor": 8.0}},
            "rope_scaling.low_freq_factor (llama3) must be",
        ),
        (
            {"rope_scaling": {"type": "linear", "factor": 0}},
            "rope_scaling.factor (linear) must be a finite number > 0",
        ),
        (
            {"rope_scaling": {"rope_type": "freq_factors", "freq_factors": [1.0, 0.0]}},
            "rope_scaling.freq_factors must be a list of finite numbers > 0",
        ),
    ],
)
def test_config_values_that_cannot_describe_a_model_are_named(
    tiny_checkpoint: TinyFactory, tmp_path: Path, changes: dict[str, object], fragment: str
) -> None:
    """Before, these ran into ZeroDivisionError or torch shape errors, or ran as if another value."""
    _expect(_with_config(tiny_checkpoint, tmp_path, **changes), fragment)
