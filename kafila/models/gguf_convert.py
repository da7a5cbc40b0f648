"""A Llama or Qwen3 GGUF file (llama.cpp, LM Studio, Ollama) as a packed Hugging Face folder.

`ensure_gguf(FILE)` converts once into `<cache>/gguf/<stem>-<key>/` (the key names the file's path,
size and modification time, so an edited file converts again) and returns the folder, which every
command then reads as any model folder (kafila.models.checkpoint):

- config.json from the GGUF metadata (`{arch}.block_count`, `.embedding_length`, ...), with
  `quantization_config` where any matrix is packed: a packed checkpoint keeps its float matrices as
  stored (kafila.models.manifest);
- model.safetensors as its index, model.safetensors.gguf.json (kafila.models.gguf_inplace: the bytes
  are made from the GGUF where it lies when they are read; `convert(inplace=False)` writes the file
  itself, the copy they equal): every tensor in its own type (kafila.models.gguf_types): float
  tensors as stored, Q8_0/Q4_1/Q4_0 repacked into int8/q4 entries, Q5_0/Q5_1 into q5 and Q4_K, Q5_K,
  Q6_K into q4k, q5k, q6k ones with their values unchanged, the other quantized types (Q3_K, Q2_K)
  requantized into q4, which `convert` prints on the
  console with the error it measured (one line per type: the tensors, their bytes in the file and
  served); a quantized tensor the engine cannot pack (in a fused product with a float one) is
  widened to F32 and said the same way. llama.cpp's converter permutes the rows of a Llama's q/k
  projections for its interleaved RoPE; they are put back (Qwen3 GGUFs keep Hugging Face's order);
- tokenizer.json and tokenizer_config.json (chat template, special tokens) from `tokenizer.ggml.*`:
  byte-level BPE with the pre-tokenizer llama.cpp names in `tokenizer.ggml.pre`, or a SentencePiece
  vocabulary with its scores (kafila.models.gguf_sentencepiece).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kafila.models import gguf_index
from kafila.models import gguf_types as types
from kafila.models.cache import cache_dir
from kafila.models.default import (
    GGUFFile,
    GGUFTensor,
    generation_config,
    hf_name,
    opt_int,
    tokenizer_config,
)
from kafila.models.gguf_inplace import Recipe
from kafila.models.gguf_sentencepiece import add_bos, sentencepiece_tokenizer
from kafila.models.manifest import session_format
from kafila.obs.log import get_logger

log = get_logger(__name__)

CONVERTER_VERSION = 4  # a folder made by another version converts again (4: Q4_K, Q5_K as stored)
SOURCE_FILE = "kafila_source.json"
REQUEST_DEFAULTS = "kafila_request_defaults"  # generation_config.json's key for a model's request defaults
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}
_QWEN3_NAMES = {
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
# the fused products a block computes: their matrices must share one format
_GROUPS = (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), ("mlp.gate_proj", "mlp.up_proj"))

Say = Callable[[str], None]


class GGUFError(ValueError):
    """A GGUF file Kafila cannot serve; the message names the file and what it holds."""


def is_gguf(text: str) -> bool:
    """Whether a --model value names a GGUF file (by its suffix; the file must exist)."""
    return text.lower().endswith(".gguf") and Path(text).expanduser().is_file()


def gguf_root() -> Path:
    return cache_dir() / "gguf"


def folder_for(file: Path, defaults: dict[str, Any] | None = None) -> Path:
    """The cache folder of a GGUF file (and of an Ollama model's request defaults with it)."""
    st = file.stat()
    extra = json.dumps(defaults, sort_keys=True) if defaults else ""
    key = f"{file.resolve()}:{st.st_size}:{st.st_mtime_ns}{extra}"
    key = hashlib.sha256(key.encode()).hexdigest()[:12]
    return gguf_root() / f"{file.name.removesuffix('.gguf').removesuffix('.GGUF')}-{key}"


def ensure_gguf(
    file: Path, progress: bool = True, say: Say | None = None, defaults: dict[str, Any] | None = None
) -> Path:
    """The folder a GGUF file converts to, converted now unless it already was. `defaults`: request
    defaults (an Ollama model's params: temperature, top_p, stop) that generation_config.json
    carries as `REQUEST_DEFAULTS` (kafila.engine.tokenizer.Tokenizer.request_defaults)."""
    file = Path(file).expanduser().resolve()
    folder = folder_for(file, defaults)
    if _is_converted(folder, file):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        convert(file, tmp, progress=progress, say=say, defaults=defaults)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)
        if folder.exists():  # a stale or half-checked conversion: replaced whole
            shutil.rmtree(folder, ignore_errors=True)
        try:
            tmp.rename(folder)
        except OSError:
            if not _is_converted(folder, file):  # another process got there first with the same bytes
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info(
        "gguf converted", file=str(file), folder=str(folder), seconds=round(time.monotonic() - started, 1)
    )
    return folder


def _is_converted(folder: Path, file: Path) -> bool:
    from kafila.models.checkpoint import Checkpoint

    try:
        meta = json.loads((folder / SOURCE_FILE).read_text())
        Checkpoint.open(folder, complete=True)
    except (OSError, ValueError):
        return False
    return (
        isinstance(meta, dict)
        and meta.get("converter") == CONVERTER_VERSION
        and meta.get("gguf") == str(file)
        and meta.get("numpy") == np.__version__
    )


def convert(
    file: Path,
    out: Path,
    progress: bool = True,
    say: Say | None = None,
    defaults: dict[str, Any] | None = None,
    inplace: bool = True,
) -> dict[str, Any]:
    """Write the folder for GGUF `file` into `out` (which exists); returns its config.json. With
    `inplace`, model.safetensors is its index (kafila.models.gguf_inplace: the tensors are made
    from `file` when read); else the file itself, the copy the index's bytes equal."""
    from kafila.models import quantize

    gf = GGUFFile.open(file)
    config = model_config(gf.meta, file, rope_freqs(gf))
    recipes, widened = _recipes(gf, config)
    for line in widened_lines(file, widened):
        (say or _stderr)(line)
    kinds = [session_format(r.target) for r in recipes if r.packed and r.name.endswith("_proj.weight")]
    if kinds:
        fmt = max(set(kinds), key=kinds.count)
        config[quantize.QUANT_CONFIG] = {"quant_method": "kafila", "format": fmt, "group_size": 32}
    config["tie_word_embeddings"] = all(r.name != "lm_head.weight" for r in recipes)
    write = gguf_index.write_index if inplace else gguf_index.write_copy
    errors = write(out / "model.safetensors", file, recipes, progress, desc=f"reading {file.name}")
    requantized = [
        Requant(
            r.name, GGUFTensor(r.source, r.shape, r.ggml_type, r.start, r.nbytes), r.target, errors[r.name]
        )
        for r in recipes
        if r.requantized
    ]
    for line in requantized_lines(file, requantized):
        (say or _stderr)(line)
    _write_json(out / "config.json", config)
    _write_json(out / "generation_config.json", generation_config(gf.meta) | _defaults(defaults))
    write_tokenizer(gf.meta, out, file)
    _write_json(out / SOURCE_FILE, _source(file) | {"inplace": inplace})
    return config


def _source(file: Path) -> dict[str, Any]:
    """What a converted folder says of its source: the GGUF, its size, and the converter and numpy
    that made its bytes (a requantized tensor is remade at each read: the same code must make it)."""
    return {
        "converter": CONVERTER_VERSION,
        "gguf": str(file),
        "gguf_bytes": file.stat().st_size,
        "numpy": np.__version__,
    }


def _defaults(defaults: dict[str, Any] | None) -> dict[str, Any]:
    return {REQUEST_DEFAULTS: defaults} if defaults else {}


def _stderr(line: str) -> None:
    print(line, file=sys.stderr)


# --- config -----------------------------------------------------------------------------------


ROPE_FREQS = "rope_freqs.weight"  # Llama 3.1+: the factors llama.cpp divides each frequency by


def rope_freqs(gf: GGUFFile) -> list[float] | None:
    """A file's RoPE frequency factors (its `rope_freqs.weight`, float32), or None."""
    for t in gf.tensors:
        if t.name == ROPE_FREQS:
            if t.ggml_type != types.F32:
                raise GGUFError(f"{gf.path}: {ROPE_FREQS} is {types.type_name(t.ggml_type)}, not F32")
            return [float(v) for v in types.float_entry(gf.raw(t), t.ggml_type, t.shape).reshape(-1)]
    return None


def model_config(meta: dict[str, Any], file: Path, freq_factors: list[float] | None = None) -> dict[str, Any]:
    """config.json's fields from the GGUF metadata of a llama or qwen3 file, and its RoPE frequency
    factors (`rope_freqs`) where it has them."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise GGUFError(
            f"{file}: GGUF architecture {arch!r}: Kafila serves {' and '.join(ARCHITECTURES)} GGUFs"
        )

    def key(name: str, default: Any = None) -> Any:
        v = meta.get(f"{arch}.{name}", default)
        if v is None:
            raise GGUFError(f"{file}: GGUF metadata has no {arch}.{name}")
        return v

    heads, hidden = int(key("attention.head_count")), int(key("embedding_length"))
    tokens = meta.get("tokenizer.ggml.tokens") or []
    heads_dim = int(key("attention.key_length", hidden // heads))
    scaling = _rope_scaling(meta, arch, file, freq_factors, heads_dim)
    return {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": int(key("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(key("attention.head_count_kv", heads)),
        "head_dim": heads_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(key("context_length")),
        # stored as float32 (9.9999997e-06): written as the float32 it is
        "rms_norm_eps": float(f"{float(key('attention.layer_norm_rms_epsilon')):.7g}"),
        "rope_theta": float(key("rope.freq_base", 10000.0)),
        "rope_scaling": scaling,
        "tie_word_embeddings": True,
        "vocab_size": int(meta.get(f"{arch}.vocab_size") or len(tokens)),
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": opt_int(meta, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": opt_int(meta, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": opt_int(meta, "tokenizer.ggml.padding_token_id"),
        "torch_dtype": "float32",
    }


def _rope_scaling(
    meta: dict[str, Any], arch: str, file: Path, factors: list[float] | None, head_dim: int
) -> dict[str, Any] | None:
    """config.json's rope_scaling: the frequency factors (Llama 3.1+, which llama.cpp's converter
    writes as a tensor and no metadata), or a linear factor from `{arch}.rope.scaling.*`."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind not in (None, "none", "linear"):
        raise GGUFError(f"{file}: RoPE scaling {kind!r} in the GGUF metadata: Kafila reads linear scaling")
    if factors is not None:
        if len(factors) != head_dim // 2 or kind == "linear":
            raise GGUFError(
                f"{file}: {len(factors)} RoPE frequency factors for a head of {head_dim}"
                + (" beside linear scaling" if kind == "linear" else f" (want {head_dim // 2})")
            )
        return {"rope_type": "freq_factors", "freq_factors": factors}
    if kind == "linear":
        factor = float(meta.get(f"{arch}.rope.scaling.factor") or 1.0)
        return {"rope_type": "linear", "factor": factor} if factor != 1.0 else None
    return None


# --- tensors ----------------------------------------------------------------------------------


def tensor_name(gguf_name: str, arch: str) -> str:
    """A GGUF tensor's Hugging Face name (Llama names, plus Qwen3's q/k norms)."""
    prefix, _, rest = gguf_name.partition(".")
    index, _, leaf = rest.partition(".")
    if arch == "qwen3" and prefix == "blk" and leaf in _QWEN3_NAMES:
        return f"model.layers.{int(index)}.{_QWEN3_NAMES[leaf]}"
    return hf_name(gguf_name)


Widened = list[tuple[str, GGUFTensor, str]]  # (name, tensor, why) of tensors widened to F32


@dataclass
class Requant:
    """A tensor requantized into a packed format, and (once written) what that changed."""

    name: str
    tensor: GGUFTensor
    fmt: str
    error: types.Requantized | None = None


def _recipes(gf: GGUFFile, config: dict[str, Any]) -> tuple[list[Recipe], Widened]:
    """How every tensor is served (kafila.models.Recipe), and those widened to F32."""
    arch = config["model_type"]
    named: dict[str, GGUFTensor] = {}
    for t in gf.tensors:
        if t.name == ROPE_FREQS:  # config.json's rope_scaling
            continue
        types.check_readable(t.ggml_type, t.name)
        try:
            named[tensor_name(t.name, arch)] = t
        except ValueError as exc:
            raise GGUFError(f"{gf.path}: {exc}") from exc
    fmt = _formats(named)
    recipes: list[Recipe] = []
    widened: Widened = []
    for name, t in named.items():
        target = fmt[name]
        if target == "F32" and t.ggml_type != types.F32:
            why = "mixed" if len(t.shape) == 2 and t.ggml_type in types.PACKED else "type"
            widened.append((name, t, why))
        recipes.append(
            Recipe(name, t.name, t.shape, t.ggml_type, t.start, t.nbytes, target, _heads(name, config))
        )
    return recipes, widened


def _formats(named: dict[str, GGUFTensor]) -> dict[str, str]:
    """Each tensor's served form: a packed format (manifest.LAYOUTS), or a safetensors float dtype."""
    fmt: dict[str, str] = {}
    for name, t in named.items():
        if len(t.shape) == 2 and t.ggml_type in types.PACKED:
            fmt[name] = types.PACKED[t.ggml_type][0]
        else:
            fmt[name] = types.FLOATS.get(t.ggml_type, "F32")
    for name in named:  # fused products: each in its own format, or all widened together
        for group in _GROUPS:
            if not name.endswith(f"{group[0]}.weight"):
                continue
            base = name.removesuffix(f"{group[0]}.weight")
            members = [f"{base}{g}.weight" for g in group if f"{base}{g}.weight" in named]
            kinds = [named[m].ggml_type for m in members]
            if not any(k in types.PACKED for k in kinds):
                continue
            own = types.group_formats(kinds)
            for i, m in enumerate(members):
                fmt[m] = own[i] if own else "F32"
    return fmt


def _heads(name: str, config: dict[str, Any]) -> int | None:
    """The head count whose q/k rows llama.cpp permuted in a Llama matrix (put back), else None."""
    if config["model_type"] != "llama":
        return None
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for proj, n_head in heads.items():
        if name.endswith(f"self_attn.{proj}.weight"):
            return int(n_head)
    return None


def float_folder(
    gguf_file: Path, out: Path, values: Callable[[str, GGUFTensor], np.ndarray] | None = None
) -> Path:
    """The Hugging Face F32 folder of a GGUF model: every tensor's values as gguf.quants
    dequantizes them (a Llama's q/k rows put back), or as `values(hf_name, tensor)` gives them;
    config and tokenizer from the file. The float model of the file's exact values, which the
    tests and the perplexity benchmark compare served formats against."""
    from safetensors.numpy import save_file

    gf = GGUFFile.open(gguf_file)
    config = model_config(gf.meta, gguf_file)
    tensors = {}
    for t in gf.tensors:
        if t.name == "rope_freqs.weight":  # no weight: the config says its scaling
            continue
        name = tensor_name(t.name, config["model_type"])
        if values is None:
            got = np.asarray(gf.dequantize(t), dtype=np.float32).reshape(t.shape)
            if config["model_type"] == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                n_head = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
                got = types.unpermute_qk(got, n_head)
        else:
            got = values(name, t)
        tensors[name] = np.ascontiguousarray(got)
    config["tie_word_embeddings"] = "lm_head.weight" not in tensors
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config))
    write_tokenizer(gf.meta, out, gguf_file)
    return out


def widened_lines(file: Path, widened: list[tuple[str, GGUFTensor, str]]) -> list[str]:
    """One console line per type (and for fused products of mixed types) widened to F32: the
    tensors and the bytes they take in the file and as F32."""
    by: dict[tuple[str, str], list[tuple[str, GGUFTensor]]] = {}
    for name, t, why in widened:
        by.setdefault((types.type_name(t.ggml_type), why), []).append((name, t))
    lines = []
    for (kind, why), items in sorted(by.items()):
        stored = sum(t.nbytes for _, t in items)
        wide = sum(4 * t.numel for _, t in items)
        names = ", ".join(n for n, _ in items[:3]) + (f" and {len(items) - 3} more" if len(items) > 3 else "")
        reason = (
            "is in a fused product with float tensors" if why == "mixed" else "is not a matrix Kafila packs"
        )
        lines.append(
            f"kafila: {file.name}: {kind} {reason}: {len(items)} tensors ({names}) served as F32, "
            f"{stored} bytes in the file -> {wide} bytes ({wide / max(stored, 1):.1f}x)"
        )
    return lines


def requantized_lines(file: Path, requantized: list[Requant]) -> list[str]:
    """One console line per type and format requantized: the tensors, their bytes in the file and
    served, and the error measured against gguf.quants' values (RMS over the values' RMS, the
    largest in steps of its group)."""
    from kafila.models.manifest import packed_bytes

    by: dict[tuple[str, str], list[Requant]] = {}
    for r in requantized:
        by.setdefault((types.type_name(r.tensor.ggml_type), r.fmt), []).append(r)
    lines = []
    for (kind, fmt), items in sorted(by.items()):
        error = types.Requantized()
        for r in items:
            if r.error is not None:
                error.add(r.error)
        stored = sum(r.tensor.nbytes for r in items)
        served = sum(packed_bytes(fmt, r.tensor.shape[0], r.tensor.shape[1]) for r in items)
        more = f" and {len(items) - 3} more" if len(items) > 3 else ""
        names = ", ".join(r.name for r in items[:3]) + more
        lines.append(
            f"kafila: {file.name}: {kind} requantized to {fmt}: {len(items)} tensors ({names}), {stored} "
            f"bytes in the file -> {served} bytes ({served / max(stored, 1):.2f}x); error RMS "
            f"{error.relative_rms:.2%} of the values' RMS, at most {error.worst_steps:.2f} of a step"
        )
    return lines


def _write_json(file: Path, data: dict[str, Any]) -> None:
    file.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


# --- tokenizer --------------------------------------------------------------------------------

_CONTROL, _USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values (1 normal, 5 unused, 6 byte)
# llama.cpp's pre-tokenizer regexes by `tokenizer.ggml.pre` (as the models' own tokenizer.json)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)
_SPLITS = {"qwen2": _QWEN2, "llama-bpe": _LLAMA3, "llama3": _LLAMA3}
PRE_TOKENIZERS = ("smollm", "qwen2", "llama-bpe", "gpt2", "default")


def build_tokenizer(meta: dict[str, Any], file: Path) -> Any:
    """A `tokenizers` Tokenizer from `tokenizer.ggml.*`: byte-level BPE, or a SentencePiece
    vocabulary (kafila.models.gguf_sentencepiece)."""
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
    )

    kind, pre = meta.get("tokenizer.ggml.model"), meta.get("tokenizer.ggml.pre") or "default"
    if kind == "llama":
        try:
            return sentencepiece_tokenizer(meta)
        except ValueError as exc:
            raise GGUFError(f"{file}: {exc}") from exc
    if kind != "gpt2":
        raise GGUFError(
            f"{file}: GGUF tokenizer {kind!r}: Kafila reads byte-level BPE ('gpt2') and SentencePiece "
            "('llama') tokenizers"
        )
    if pre not in PRE_TOKENIZERS and pre not in _SPLITS:
        raise GGUFError(f"{file}: GGUF pre-tokenizer {pre!r}: Kafila reads {', '.join(PRE_TOKENIZERS)}")
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    kinds: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", [])]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(
        add_prefix_space=False, trim_offsets=False, use_regex=pre not in _SPLITS
    )
    if pre in _SPLITS:
        split = pre_tokenizers.Split(Regex(_SPLITS[pre]), behavior="isolated", invert=False)
        tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    elif pre == "smollm":  # each digit alone, then GPT-2's byte-level regex
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        tok.pre_tokenizer = byte_level
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    added = [
        AddedToken(t, special=kind == _CONTROL, normalized=False)
        for t, kind in zip(tokens, kinds, strict=True)
        if kind in (_CONTROL, _USER_DEFINED)
    ]
    tok.add_tokens(added)
    return tok


def write_tokenizer(meta: dict[str, Any], out: Path, file: Path) -> None:
    tokens: list[str] = meta["tokenizer.ggml.tokens"]
    kinds: list[int] = meta.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    build_tokenizer(meta, file).save(str(out / "tokenizer.json"))
    special = [t for t, kind in zip(tokens, kinds, strict=True) if kind == _CONTROL]
    if meta.get("tokenizer.ggml.model") == "llama":  # llama.cpp adds BOS unless the file says not to
        meta = {**meta, "tokenizer.ggml.add_bos_token": add_bos(meta)}
    _write_json(out / "tokenizer_config.json", tokenizer_config(meta, tokens, special))
