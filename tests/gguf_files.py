"""Small GGUF files written as llama.cpp writes them, for the GGUF and Ollama-store tests.

`write_gguf` draws seeded float32 weights (std 2/sqrt(fan_in) in the blocks, 1.0 in the embedding,
LOGIT_STD/sqrt(hidden) in the head, so greedy paths have wide margins), quantizes each tensor with
gguf.quants into the type `types` names for it (by GGUF leaf name, e.g. "attn_q", or by full name,
e.g. "blk.1.ffn_down"), permutes a Llama's q/k rows as llama.cpp's converter does, and writes the
file with gguf.GGUFWriter with a real tokenizer's metadata (`qwen3_tokenizer_meta` from Qwen3's
tokenizer.json, or the default model's GGUF metadata). Rows are multiples of 256.

`float_folder` writes the Hugging Face F32 folder of the same model from the file's dequantized
values (gguf.quants), the float reference the engine's logits are compared with.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

LOGIT_STD = 32.0


@dataclass(frozen=True)
class Shape:
    arch: str = "qwen3"
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 512
    context: int = 2048


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's converter's row order for a Llama q/k matrix (HF rotate-half -> interleaved)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tensor_shapes(s: Shape, vocab: int, tied: bool) -> dict[str, tuple[int, ...]]:
    q, kv = s.heads * s.head_dim, s.kv_heads * s.head_dim
    out: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (vocab, s.hidden),
        "output_norm.weight": (s.hidden,),
    }
    if not tied:
        out["output.weight"] = (vocab, s.hidden)
    for i in range(s.layers):
        b = f"blk.{i}."
        out |= {
            b + "attn_norm.weight": (s.hidden,),
            b + "ffn_norm.weight": (s.hidden,),
            b + "attn_q.weight": (q, s.hidden),
            b + "attn_k.weight": (kv, s.hidden),
            b + "attn_v.weight": (kv, s.hidden),
            b + "attn_output.weight": (s.hidden, q),
            b + "ffn_gate.weight": (s.ffn, s.hidden),
            b + "ffn_up.weight": (s.ffn, s.hidden),
            b + "ffn_down.weight": (s.hidden, s.ffn),
        }
        if s.arch == "qwen3":
            out |= {b + "attn_q_norm.weight": (s.head_dim,), b + "attn_k_norm.weight": (s.head_dim,)}
    return out


def _draw(rng: np.random.Generator, name: str, shape: tuple[int, ...], hidden: int) -> np.ndarray:
    if len(shape) == 1:
        return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32)
    if name == "token_embd.weight":
        std = 1.0
    elif name == "output.weight":
        std = LOGIT_STD / hidden**0.5
    else:
        std = 2.0 / shape[1] ** 0.5
    return (std * rng.standard_normal(shape)).astype(np.float32)


def _type_of(name: str, types: dict[str, str]) -> str:
    stem = name.removesuffix(".weight")
    leaf = stem.split(".")[-1]
    return types.get(stem) or types.get(leaf) or "F32"


def write_gguf(
    path: Path,
    shape: Shape,
    tokenizer: dict[str, Any],
    types: dict[str, str],
    *,
    tied: bool = False,
    seed: int = 0,
    arch: str | None = None,
    rope_freqs: np.ndarray | None = None,
) -> Path:
    """A GGUF of `shape` with the tokenizer metadata `tokenizer` (tokenizer.ggml.* and
    tokenizer.chat_template), each tensor in the type `types` names (default F32), and `rope_freqs`
    (Llama 3.1's frequency factors) as llama.cpp's converter writes them, an F32 tensor."""
    import gguf

    arch = arch or shape.arch
    vocab = len(tokenizer["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_uint32(f"{arch}.block_count", shape.layers)
    w.add_uint32(f"{arch}.context_length", shape.context)
    w.add_uint32(f"{arch}.embedding_length", shape.hidden)
    w.add_uint32(f"{arch}.feed_forward_length", shape.ffn)
    w.add_uint32(f"{arch}.attention.head_count", shape.heads)
    w.add_uint32(f"{arch}.attention.head_count_kv", shape.kv_heads)
    w.add_uint32(f"{arch}.attention.key_length", shape.head_dim)
    w.add_uint32(f"{arch}.attention.value_length", shape.head_dim)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_float32(f"{arch}.rope.freq_base", 1_000_000.0)
    w.add_uint32(f"{arch}.vocab_size", vocab)
    _add_tokenizer(w, tokenizer)
    for name, dims in tensor_shapes(shape, vocab, tied).items():
        values = _draw(rng, name, dims, shape.hidden)
        if shape.arch == "llama" and name.endswith(("attn_q.weight", "attn_k.weight")):
            n_head = shape.heads if "attn_q" in name else shape.kv_heads
            values = permute_qk(values, n_head)
        kind = gguf.GGMLQuantizationType[_type_of(name, types)]
        if kind in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            w.add_tensor(name, gguf.quants.quantize(values, kind))
        else:  # the blocks' bytes [rows, row bytes]; the writer derives the shape from the type
            w.add_tensor(name, _blocks(values, kind, rng), raw_dtype=kind)
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", np.asarray(rope_freqs, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# byte offsets of the float16 scale fields in a block of the K-quants gguf.quants cannot quantize
K_SCALES = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}
SCALE_FIELDS = {**K_SCALES, "Q5_1": (0, 2)}  # where each type's float16 scales lie in its block


def _blocks(values: np.ndarray, kind: Any, rng: np.random.Generator) -> np.ndarray:
    """gguf.quants' blocks of `values`; for a K-quant, which gguf.quants dequantizes but does not
    quantize, `random_blocks` of the values' spread; for another type it cannot quantize (a file
    Kafila must refuse), random bytes of the type's size."""
    import gguf

    try:
        return np.asarray(gguf.quants.quantize(values, kind))
    except NotImplementedError:
        rows, cols = values.shape
        if kind.name in K_SCALES:
            return random_blocks(kind.name, (rows, cols), rng, float(values.std()))
        block, size = gguf.GGML_QUANT_SIZES[kind]
        return rng.integers(0, 256, (rows, cols // block * size), dtype=np.uint8)


def random_blocks(kind: str, shape: tuple[int, int], rng: np.random.Generator, std: float) -> np.ndarray:
    """Blocks [rows, row bytes] of K-quant (or Q5_1) `kind` for a matrix `shape`: random levels and
    6/8-bit scales (every byte pattern is a valid block), the float16 scales d (and dmin) drawn from a
    1.5x range and then multiplied together so the values' standard deviation is about `std`."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    fields = SCALE_FIELDS[kind]
    draws = [rng.uniform(1.0, 1.5, raw.shape[:2]) for _ in fields]
    for at, d in zip(fields, draws, strict=True):
        raw[..., at : at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    spread = float(np.asarray(gguf.quants.dequantize(raw.reshape(rows, -1), qtype)).std())
    for at, d in zip(fields, draws, strict=True):
        raw[..., at : at + 2] = (d * std / spread).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def _add_tokenizer(w: Any, meta: dict[str, Any]) -> None:
    w.add_tokenizer_model(meta["tokenizer.ggml.model"])
    if meta.get("tokenizer.ggml.pre"):
        w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
    w.add_token_list(meta["tokenizer.ggml.tokens"])
    w.add_token_types(meta["tokenizer.ggml.token_type"])
    if meta.get("tokenizer.ggml.scores") is not None:  # a SentencePiece vocabulary's
        w.add_token_scores(meta["tokenizer.ggml.scores"])
    w.add_token_merges(meta["tokenizer.ggml.merges"])
    for key in ("bos", "eos", "padding", "unknown"):
        if meta.get(f"tokenizer.ggml.{key}_token_id") is not None:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", int(meta[f"tokenizer.ggml.{key}_token_id"]))
    w.add_bool("tokenizer.ggml.add_bos_token", bool(meta.get("tokenizer.ggml.add_bos_token", False)))
    if meta.get("tokenizer.chat_template"):
        w.add_string("tokenizer.chat_template", meta["tokenizer.chat_template"])


def qwen3_tokenizer_meta(folder: Path) -> dict[str, Any]:
    """tokenizer.ggml.* as llama.cpp's converter writes them for Qwen3's tokenizer.json: tokens by
    id, added special tokens CONTROL (3), other added tokens USER_DEFINED (4), merges "a b"."""
    tok = json.loads((folder / "tokenizer.json").read_text())
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocab: dict[str, int] = dict(tok["model"]["vocab"])
    kinds: dict[int, int] = {}
    for added in tok["added_tokens"]:
        vocab[added["content"]] = added["id"]
        kinds[added["id"]] = 3 if added["special"] else 4
    tokens = [""] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        tokens[i] = t
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    by_text = {t: i for i, t in enumerate(tokens)}
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "qwen2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [kinds.get(i, 1) for i in range(len(tokens))],
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": by_text["<|endoftext|>"],
        "tokenizer.ggml.eos_token_id": by_text["<|im_end|>"],
        "tokenizer.ggml.padding_token_id": by_text["<|endoftext|>"],
        "tokenizer.ggml.add_bos_token": False,
        "tokenizer.chat_template": config.get("chat_template"),
    }


def served_values(ckpt: Any, name: str) -> np.ndarray:
    """Tensor `name` of a converted folder (a Checkpoint) as float32: a packed matrix dequantized,
    floats widened."""
    from kafila.models.quant import dequantize, format_of, from_entries

    base = name.removesuffix("weight")
    names = [n for n in (name, base + "scales", base + "mins", base + "high") if n in ckpt.tensors]
    raw = ckpt.read(names)

    def array(n: str) -> np.ndarray:
        info, data = raw[n]
        kind = {"F32": np.float32, "F16": np.float16, "I8": np.int8, "U8": np.uint8}[info.dtype]
        return np.frombuffer(bytes(data), dtype=kind).reshape(info.shape)

    if len(names) == 1:
        return array(name).astype(np.float32)
    mins, high = (array(base + n) if base + n in raw else None for n in ("mins", "high"))
    data, scales = array(name), array(base + "scales")
    return dequantize(from_entries(format_of(data, scales, mins, high), data, scales, mins, high))


def float_folder(gguf_file: Path, out: Path, served: Path | None = None) -> Path:
    """The Hugging Face F32 folder of a GGUF model (every tensor dequantized by gguf.quants; or,
    given the folder it was `served` as, the values served there): the float reference."""
    from kafila.models import gguf_convert
    from kafila.models.checkpoint import Checkpoint

    if served is None:
        return gguf_convert.float_folder(gguf_file, out)
    ckpt = Checkpoint.open(served)
    return gguf_convert.float_folder(gguf_file, out, lambda name, _: served_values(ckpt, name))


def greedy_ids(folder: Path, prompt: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt` from one process holding the whole checkpoint at `folder`."""
    from kafila.engine.stage import Stage
    from kafila.models.checkpoint import Checkpoint

    ckpt = Checkpoint.open(folder)
    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, backend="torch", dtype="fp32", context=64)
    stage.open("r")
    [h] = stage.forward([("r", 0, stage.embed(prompt))])
    ids = [int(stage.logits(h[-1]).argmax())]
    for pos in range(len(prompt), len(prompt) + n - 1):
        [h] = stage.forward([("r", pos, stage.embed(ids[-1:]))])
        ids.append(int(stage.logits(h[-1]).argmax()))
    return ids
