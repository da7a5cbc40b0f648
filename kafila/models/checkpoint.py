"""A Hugging Face model folder, read from its safetensors headers (no tensor bytes until asked).

Layout read (see docs/engine-checkpoints.md):

    config.json                      -> ModelConfig (required)
    model.safetensors                -> tensors, or
    model.safetensors.index.json     -> {"weight_map": {name: shard file}} plus the shards
    generation_config.json           -> dict (optional)
    tokenizer.json                   -> path only (optional; kafila.engine.tokenizer reads it)
    tokenizer_config.json            -> bos/eos/pad, chat_template (optional)
    chat_template.jinja              -> chat template (optional; wins over tokenizer_config's, as in
                                        transformers)

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the data;
offsets are relative to byte 8 + N. `TensorInfo.start/end` are absolute offsets in the file, so a
block range is read with a few `pread`s and nothing else (`Checkpoint.read`, `bytes_read`).
"""

from __future__ import annotations

import json
import math
import os
import struct
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kafila.models.config import ConfigError, ModelConfig
from kafila.models.manifest import (
    DTYPE_BYTES,
    LM_HEAD,
    Manifest,
    TensorSpec,
    block_index,
    build_manifest,
    logical_shape,
    packed_format,
    session_format,
    specs_from_config,
    stage_tensors,
)
from kafila.models.weight_file import (
    PlainFile,
    SourceChanged,
    WeightFile,
    inplace_index,
    is_weight_file,
)

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# A header larger than this is corrupt, not a model (safetensors itself caps it at 100 MB).
MAX_HEADER_BYTES = 100_000_000


class CheckpointError(ValueError):
    """The folder is not a checkpoint Kafila can read; the message names the file and the problem."""


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: str  # safetensors dtype string: "F32", "BF16", ...
    shape: tuple[int, ...]
    file: Path
    start: int  # absolute byte offset of the first data byte in `file`
    end: int  # absolute offset one past the last data byte

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def spec(self) -> TensorSpec:
        return TensorSpec(self.name, self.dtype, self.shape)


@dataclass(frozen=True)
class SpecialTokens:
    """Special tokens as the folder names them: strings from tokenizer_config.json, ids from
    generation_config.json (preferred) or config.json. Any of them may be absent."""

    bos: str | None = None
    eos: str | None = None
    pad: str | None = None
    bos_id: int | None = None
    eos_ids: tuple[int, ...] = ()
    pad_id: int | None = None


@dataclass(eq=False)
class Checkpoint:
    """A model folder; `read` may be called from several threads (bytes_read stays exact)."""

    path: Path
    config: ModelConfig
    tensors: dict[str, TensorInfo] = field(repr=False)
    generation_config: dict[str, Any] = field(default_factory=dict, repr=False)
    tokenizer_file: Path | None = None
    tokenizer_config: dict[str, Any] = field(default_factory=dict, repr=False)
    chat_template: str | None = field(default=None, repr=False)
    special_tokens: SpecialTokens = field(default_factory=SpecialTokens)
    bytes_read: int = 0  # tensor-data bytes read by `read` since open
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike[str], complete: bool = False) -> Checkpoint:
        """The model folder at `path`, its tensors checked against config.json (shapes, no block
        past num_hidden_layers); with `complete` (a whole model, not a member's shard) also that
        every tensor config.json describes is here."""
        folder = Path(path).expanduser().resolve()
        if not folder.is_dir():
            raise CheckpointError(f"{folder}: no such model folder")
        config = _read_config(folder)
        tensors = _read_tensors(folder)
        generation = _read_json(folder / "generation_config.json") or {}
        tok_config = _read_json(folder / "tokenizer_config.json") or {}
        tokenizer_file = folder / "tokenizer.json"
        _check_tensors(folder, config, tensors, complete)
        return cls(
            path=folder,
            config=config,
            tensors=tensors,
            generation_config=generation,
            tokenizer_file=tokenizer_file if tokenizer_file.is_file() else None,
            tokenizer_config=tok_config,
            chat_template=_read_chat_template(folder, tok_config),
            special_tokens=_special_tokens(config, generation, tok_config),
        )

    @property
    def n_blocks(self) -> int:
        return self.config.num_hidden_layers

    @property
    def tied(self) -> bool:
        return LM_HEAD not in self.tensors

    @property
    def stored_dtype(self) -> str:
        """The safetensors dtype that holds most of the tensor bytes ("F32", "BF16", ...): the
        checkpoint's precision, also in a member's shard, which holds only some tensors."""
        by_dtype: dict[str, int] = {}
        for t in self.tensors.values():
            by_dtype[t.dtype] = by_dtype.get(t.dtype, 0) + t.nbytes
        return max(by_dtype, key=lambda d: by_dtype[d]) if by_dtype else "F32"

    @property
    def stored_format(self) -> str:
        """The weight format most of the blocks' matrices are stored in: "none" (floats), "int8"
        or "q4" (a packed checkpoint, kafila.models.quant)."""
        return _format_of(self)

    def specs(self) -> list[TensorSpec]:
        return [t.spec for t in self.tensors.values()]

    def manifest(self, dtype: str | None = None, quant: str | None = None) -> Manifest:
        """Byte sizes from the headers; `dtype` ("BF16", "F32", ...) prices floats as if cast,
        `quant` ("none", "int8", "q4") prices the weights in that format (exact bytes)."""
        try:
            return build_manifest(self.specs(), self.config, dtype, quant)
        except (ValueError, KeyError) as exc:
            raise CheckpointError(f"{self.path}: {exc}") from exc

    def names_for(self, blocks: range, head: bool) -> list[str]:
        """Tensor names of blocks [a, b) and, with `head`, embedding, final norm and lm_head
        (when untied), in file order."""
        if blocks.step != 1 or blocks.start < 0 or blocks.stop > self.n_blocks or blocks.start > blocks.stop:
            raise CheckpointError(
                f"{self.path}: block range [{blocks.start}, {blocks.stop}) step {blocks.step} "
                f"is not inside the model's {self.n_blocks} blocks"
            )
        names = stage_tensors(self.tensors, blocks, head)
        return sorted(names, key=lambda n: (str(self.tensors[n].file), self.tensors[n].start))

    def read(self, names: list[str] | tuple[str, ...] | set[str]) -> dict[str, tuple[TensorInfo, bytearray]]:
        """The raw bytes of exactly these tensors, each in its own writable buffer (no copies: a run
        of adjacent ranges in a file is read with one vectored read straight into the buffers)."""
        missing = [n for n in names if n not in self.tensors]
        if missing:
            raise CheckpointError(f"{self.path}: no tensor named {missing[0]!r} ({len(missing)} missing)")
        by_file: dict[Path, list[TensorInfo]] = {}
        for name in set(names):
            info = self.tensors[name]
            by_file.setdefault(info.file, []).append(info)
        out: dict[str, tuple[TensorInfo, bytearray]] = {}
        for file, infos in by_file.items():
            infos.sort(key=lambda t: t.start)
            try:
                f = open_weights(file)
            except SourceChanged as exc:
                raise CheckpointError(str(exc)) from exc
            with f:
                for span in _coalesce(infos):
                    buffers = [bytearray(t.nbytes) for t in span]
                    got = f.read_into([memoryview(b) for b in buffers], span[0].start)
                    with self._lock:
                        self.bytes_read += got
                    if got != span[-1].end - span[0].start:
                        raise CheckpointError(
                            f"{file}: truncated: wanted bytes [{span[0].start}, {span[-1].end}), "
                            f"the file ends after {got} of them"
                        )
                    out.update({t.name: (t, b) for t, b in zip(span, buffers, strict=True)})
        return out


def open_weights(path: Path) -> WeightFile:
    """A checkpoint's safetensors file to read by range: the file, or where an index made from a
    GGUF stands for it, the bytes made from that GGUF (kafila.models.gguf_inplace; SourceChanged
    when the GGUF is not the one it describes)."""
    if not path.is_file() and inplace_index(path).is_file():
        from kafila.models.gguf_inplace import InPlaceFile

        return InPlaceFile(path)
    return PlainFile(path)


def _coalesce(infos: list[TensorInfo]) -> list[list[TensorInfo]]:
    """Tensors sorted by start -> runs whose byte ranges touch (one read each)."""
    spans: list[list[TensorInfo]] = []
    for info in infos:
        if spans and spans[-1][-1].end == info.start:
            spans[-1].append(info)
        else:
            spans.append([info])
    return spans


def _check_tensors(folder: Path, config: ModelConfig, tensors: dict[str, TensorInfo], complete: bool) -> None:
    """Refuse a checkpoint whose tensors are not the model config.json describes: a block past
    num_hidden_layers (a smaller count would run the model short, silently wrong), a shape other
    than the config's sizes give, or (`complete`) a tensor the config names that is missing."""
    want = {s.name: s.shape for s in specs_from_config(config)}
    specs = {n: t.spec for n, t in tensors.items()}
    for name, info in tensors.items():
        i = block_index(name)
        if i is not None and i >= config.num_hidden_layers:
            raise CheckpointError(
                f"{folder}: tensor {name} is past config.json's num_hidden_layers={config.num_hidden_layers}"
            )
        shape = want.get(name)
        try:
            has_shape = logical_shape(info.spec, specs)
        except ValueError as exc:  # packed entries of no format's shapes
            raise CheckpointError(f"{folder}: tensor {name}: {exc}") from exc
        if shape is not None and tuple(has_shape) != tuple(shape):
            has, given = list(has_shape), list(shape)
            raise CheckpointError(f"{folder}: tensor {name} has shape {has}; config.json gives {given}")
    missing = [n for n in want if n not in tensors] if complete else []
    if missing:
        raise CheckpointError(
            f"{folder}: {len(missing)} tensor(s) that config.json describes are not in the checkpoint, "
            f"e.g. {', '.join(missing[:3])}"
        )


def _format_of(ckpt: Checkpoint) -> str:
    """The stored format of a member's shard without the head (its blocks' matrices). A packed
    checkpoint whose config.json names its format (`quantization_config`) is that format in every
    shard: a file of mixed types (a GGUF's) holds other formats in some blocks, and every member
    must resolve the session's format alike."""
    named = ckpt.config.raw.get("quantization_config")
    if isinstance(named, dict) and named.get("format") in ("int8", "q4"):
        return str(named["format"])
    specs = {s.name: s for s in ckpt.specs()}
    formats = [session_format(packed_format(n, specs)) for n in specs if n.endswith("_proj.weight")]
    return max(set(formats), key=formats.count) if formats else "none"


def _read_json(file: Path) -> dict[str, Any] | None:
    if not file.is_file():
        return None
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{file}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(data).__name__}")
    return data


def _read_config(folder: Path) -> ModelConfig:
    file = folder / "config.json"
    data = _read_json(file)
    if data is None:
        raise CheckpointError(f"{file}: missing (a Hugging Face model folder has config.json)")
    try:
        return ModelConfig.from_dict(data)
    except (ConfigError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{file}: {exc}") from exc


def _read_tensors(folder: Path) -> dict[str, TensorInfo]:
    index_file = folder / INDEX_FILE
    if index_file.is_file():
        return _read_sharded(folder, index_file)
    single = folder / SINGLE_FILE
    if is_weight_file(single):
        return read_header(single)
    raise CheckpointError(f"{folder}: no safetensors weights (neither {SINGLE_FILE} nor {INDEX_FILE})")


def _read_sharded(folder: Path, index_file: Path) -> dict[str, TensorInfo]:
    index = _read_json(index_file) or {}
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file}: no weight_map")
    tensors: dict[str, TensorInfo] = {}
    for shard in sorted(set(weight_map.values())):
        if not isinstance(shard, str) or Path(shard).name != shard or shard in (".", ".."):
            raise CheckpointError(f"{index_file}: shard {shard!r} is not a file name inside {folder}")
        file = folder / shard
        if not file.is_file():
            raise CheckpointError(f"{index_file}: names shard {shard!r}, which is missing from {folder}")
        for name, info in read_header(file).items():
            if name in tensors:
                raise CheckpointError(f"{file}: tensor {name} is also in {tensors[name].file.name}")
            tensors[name] = info
    for name, shard in weight_map.items():
        if name not in tensors or tensors[name].file.name != Path(shard).name:
            raise CheckpointError(f"{index_file}: maps {name} to {shard}, whose header has no such tensor")
    return tensors


def read_header(file: Path) -> dict[str, TensorInfo]:
    """Every tensor in one safetensors file with absolute byte ranges, validated against the file size."""
    try:
        with open_weights(file) as f:
            size = f.size()
            head = f.pread(0, 8)
            if len(head) < 8:
                raise CheckpointError(
                    f"{file}: truncated: {size} bytes, shorter than the 8-byte header length"
                )
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES or 8 + n > size:
                raise CheckpointError(
                    f"{file}: corrupt header: header length {n} is beyond the file's {size} bytes"
                )
            raw = f.pread(8, n)
    except SourceChanged as exc:
        raise CheckpointError(str(exc)) from exc
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file}: corrupt header: not JSON ({exc})") from exc
    if not isinstance(header, dict):
        raise CheckpointError(f"{file}: corrupt header: expected a JSON object")
    header.pop("__metadata__", None)
    base = 8 + n
    tensors = {name: _tensor_info(file, name, entry, base) for name, entry in header.items()}
    _check_ranges(file, list(tensors.values()), base, size)
    return tensors


def _tensor_info(file: Path, name: str, entry: Any, base: int) -> TensorInfo:
    try:
        dtype, shape, (begin, end) = entry["dtype"], tuple(entry["shape"]), entry["data_offsets"]
        begin, end, shape = int(begin), int(end), tuple(int(d) for d in shape)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"{file}: corrupt header: tensor {name}: {entry!r}") from exc
    if dtype not in DTYPE_BYTES:
        raise CheckpointError(
            f"{file}: tensor {name} has unknown dtype {dtype!r} (known: {sorted(DTYPE_BYTES)})"
        )
    want = math.prod(shape) * DTYPE_BYTES[dtype]
    if begin < 0 or end - begin != want:
        raise CheckpointError(
            f"{file}: tensor {name} {dtype}{list(shape)} needs {want} bytes, header gives [{begin}, {end})"
        )
    return TensorInfo(name, dtype, shape, file, base + begin, base + end)


def _check_ranges(file: Path, infos: list[TensorInfo], base: int, size: int) -> None:
    prev: TensorInfo | None = None
    for info in sorted(infos, key=lambda t: (t.start, t.end)):
        if info.end > size:
            raise CheckpointError(
                f"{file}: tensor {info.name} ends at byte {info.end}, "
                f"past the file's {size} bytes (truncated?)"
            )
        if prev is not None and info.start < prev.end and info.nbytes and prev.nbytes:
            raise CheckpointError(
                f"{file}: tensors {prev.name} [{prev.start}, {prev.end}) and "
                f"{info.name} [{info.start}, {info.end}) overlap"
            )
        prev = info


def _read_chat_template(folder: Path, tok_config: dict[str, Any]) -> str | None:
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) else None


def token_text(value: Any) -> str | None:
    """tokenizer_config writes a special token as a string or as an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def token_ids(value: Any) -> tuple[int, ...]:
    """A config's token id field: absent, one id, or a list of ids."""
    if value is None:
        return ()
    return tuple(int(v) for v in value) if isinstance(value, list) else (int(value),)


def _special_tokens(config: ModelConfig, generation: dict[str, Any], tok: dict[str, Any]) -> SpecialTokens:
    try:
        return _read_special_tokens(config, generation, tok)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"a token id in generation_config.json or config.json: {exc}") from exc


def _read_special_tokens(
    config: ModelConfig, generation: dict[str, Any], tok: dict[str, Any]
) -> SpecialTokens:
    bos_id = generation.get("bos_token_id", config.bos_token_id)
    if isinstance(bos_id, list):  # some configs list it; the first is the one a prompt starts with
        bos_id = bos_id[0] if bos_id else None
    pad_id = generation.get("pad_token_id", config.raw.get("pad_token_id"))
    eos_ids = token_ids(generation.get("eos_token_id")) or config.eos_token_id
    return SpecialTokens(
        bos=token_text(tok.get("bos_token")),
        eos=token_text(tok.get("eos_token")),
        pad=token_text(tok.get("pad_token")),
        bos_id=None if bos_id is None else int(bos_id),
        eos_ids=eos_ids,
        pad_id=None if isinstance(pad_id, list) or pad_id is None else int(pad_id),
    )
