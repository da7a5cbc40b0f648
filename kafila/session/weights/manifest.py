"""The weight protocol and a checkpoint's manifest: what a member may fetch from the host, exactly.

A member fetches exactly its tensors from the host's safetensors files (kafila.session.weights.server
serves them, kafila.session.weights.fetch fetches them).

Over a session Channel (kafila.session.channel; an authenticated QUIC link or an in-process pair):

    member -> host   CONTROL  weights.get_manifest
    host -> member   CONTROL  weights.preparing {hashed, total}   (every few seconds while it hashes)
    host -> member   CONTROL  weights.manifest {checkpoint, max_request, files, headers, tensors}
    member -> host   FETCH_REQUEST {fetch_id, file, offset, length}     (several in flight)
    host -> member   FETCH_DATA fetch_id | bytes     or   ERROR {request_id: fetch_id, code, message}
    member -> host   CONTROL  weights.done {bytes, tensors}

The host answers only files of its checkpoint, only ranges inside a safetensors header, inside
tensor data, or inside one of the small files (config.json, tokenizer.json, ...), at most
`max_request` bytes each; reads run on a worker thread. The member checks every safetensors header
it fetched against the manifest (names, dtypes, shapes, byte ranges), every response's size, and
every tensor's sha256 before caching it (kafila.session.weights.cache), then builds a shard folder that
`Checkpoint.open` / `Stage.load` read unchanged. See docs/weights.md.

    server = WeightServer(folder)                       # host, once per session
    await server.serve(channel)                         # per member, until it says done
    shard = await fetch_shard(channel, range(4, 9), head=False)   # member
    stage = Stage.load(Checkpoint.open(shard.path), range(4, 9), False)
"""

from __future__ import annotations

import hashlib
import json
import math
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kafila.models.checkpoint import MAX_HEADER_BYTES, Checkpoint, CheckpointError, open_weights
from kafila.models.manifest import DTYPE_BYTES
from kafila.session.weights.cache import (
    HashCache,
    blob_key,
    cache_root,
)

OP_GET_MANIFEST = "weights.get_manifest"


OP_MANIFEST = "weights.manifest"


OP_PREPARING = "weights.preparing"  # the host is still hashing: {hashed, total} tensor bytes


OP_DONE = "weights.done"


# Small files a member needs besides tensors (those present are offered, whole).
SMALL_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)


U32_MAX = (1 << 32) - 1  # FETCH_DATA carries the fetch id as a u32
MAX_SMALL_FILE = 64 << 20  # a "small" file larger than this is not offered


DEFAULT_MAX_REQUEST = 1 << 20  # bytes per FETCH_REQUEST the host accepts (window x this = bytes queued)


class WeightsError(RuntimeError):
    """The fetch failed (refused, truncated, corrupt, or a checkpoint mismatch); the text says which."""


class FetchRefused(ValueError):
    """A host-side refusal of one FETCH_REQUEST (becomes an ERROR reply)."""


@dataclass(frozen=True)
class TensorEntry:
    name: str
    file: str  # safetensors file name inside the checkpoint folder
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offsets in `file`
    end: int
    sha256: str

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def key(self) -> str:
        return blob_key(self.name, self.dtype, self.shape, self.sha256)


@dataclass(frozen=True)
class WeightManifest:
    """What a host offers: its checkpoint id (the digest of its safetensors headers), the request
    size limit, small files (size, sha256), header lengths and every tensor with its sha256."""

    checkpoint: str
    max_request: int
    files: dict[str, tuple[int, str]]  # small file -> (size, sha256)
    headers: dict[str, int]  # safetensors file -> header bytes (8 + N)
    tensors: dict[str, TensorEntry]
    n_blocks: int

    def to_json(self) -> dict[str, Any]:
        return {
            "checkpoint": self.checkpoint,
            "max_request": self.max_request,
            "n_blocks": self.n_blocks,
            "files": {k: list(v) for k, v in self.files.items()},
            "headers": self.headers,
            "tensors": [
                [e.name, e.file, e.dtype, list(e.shape), e.start, e.end, e.sha256]
                for e in self.tensors.values()
            ],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> WeightManifest:
        try:
            tensors = {}
            for name, file, dtype, shape, start, end, sha in d["tensors"]:
                tensors[str(name)] = TensorEntry(
                    str(name),
                    str(file),
                    str(dtype),
                    tuple(int(x) for x in shape),
                    int(start),
                    int(end),
                    str(sha),
                )
            files = {str(k): (int(v[0]), str(v[1])) for k, v in d["files"].items()}
            headers = {str(k): int(v) for k, v in d["headers"].items()}
            m = cls(str(d["checkpoint"]), int(d["max_request"]), files, headers, tensors, int(d["n_blocks"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsError(f"host sent a malformed weights manifest: {exc!r}") from None
        if m.max_request < 1 or any(Path(f).name != f or f in (".", "..") for f in [*files, *headers]):
            raise WeightsError("host sent a weights manifest with a bad file name or request size")
        return m


def headers_digest(headers: dict[str, bytes]) -> str:
    """The checkpoint id: sha256 over each safetensors file's name and header bytes, by name."""
    h = hashlib.sha256()
    for name in sorted(headers):
        raw = headers[name]
        h.update(name.encode() + b"\0" + struct.pack("<Q", len(raw)) + raw)
    return h.hexdigest()


def checkpoint_id(folder: Path) -> str:
    """The id of the checkpoint in `folder` (its headers' digest, as `describe` gives it)."""
    ckpt = Checkpoint.open(folder, complete=True)
    return headers_digest(read_headers(ckpt.path, sorted({i.file.name for i in ckpt.tensors.values()})))


def parse_header(file: str, raw: bytes) -> dict[str, tuple[str, tuple[int, ...], int, int]]:
    """Header bytes (8-byte length + JSON) -> {name: (dtype, shape, start, end)}, absolute offsets,
    with the same checks as Checkpoint (known dtype, byte count = numel * itemsize)."""
    if len(raw) < 8 or struct.unpack_from("<Q", raw)[0] != len(raw) - 8 or len(raw) - 8 > MAX_HEADER_BYTES:
        raise WeightsError(f"{file}: header of {len(raw)} bytes does not match its length prefix")
    try:
        header = json.loads(raw[8:].decode("utf-8"))
        header.pop("__metadata__", None)
        out = {}
        for name, e in header.items():
            dtype, shape, (a, b) = e["dtype"], tuple(int(x) for x in e["shape"]), e["data_offsets"]
            if dtype not in DTYPE_BYTES or int(b) - int(a) != math.prod(shape) * DTYPE_BYTES[dtype] or a < 0:
                raise WeightsError(f"{file}: tensor {name} {dtype}{list(shape)} has byte range [{a}, {b})")
            out[name] = (dtype, shape, len(raw) + int(a), len(raw) + int(b))
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, TypeError, ValueError) as exc:
        raise WeightsError(f"{file}: corrupt safetensors header: {exc!r}") from None
    return out


def read_headers(folder: Path, files: Sequence[str]) -> dict[str, bytes]:
    out = {}
    for name in files:
        with open_weights(folder / name) as f:
            head = f.pread(0, 8)
            if len(head) < 8:
                raise CheckpointError(f"{folder / name}: shorter than a safetensors header")
            (n,) = struct.unpack("<Q", head)
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"{folder / name}: header length {n} is corrupt")
            out[name] = head + f.pread(8, n)
    return out


def describe(
    folder: Path,
    max_request: int = DEFAULT_MAX_REQUEST,
    cache: Path | None = None,
    on_hashed: Callable[[int, int], None] | None = None,
) -> WeightManifest:
    """The host's manifest of a checkpoint folder (blocking: hashes tensors not hashed before).
    `on_hashed(done, total)` hears the tensor bytes known so far (remembered or hashed) after each."""
    ckpt = Checkpoint.open(folder, complete=True)
    hashes = HashCache(cache_root(cache) / "weights" / "hashes")
    by_file: dict[Path, list[Any]] = {}
    for info in ckpt.tensors.values():
        by_file.setdefault(info.file, []).append(info)
    total = sum(i.end - i.start for i in ckpt.tensors.values())
    done = 0

    def hashed(n: int) -> None:
        nonlocal done
        done += n
        if on_hashed is not None:
            on_hashed(done, total)

    tensors = {}
    for file, infos in sorted(by_file.items()):
        digests = hashes.digests(file, infos, hashed)
        for i in infos:
            tensors[i.name] = TensorEntry(
                i.name, file.name, i.dtype, i.shape, i.start, i.end, digests[i.name]
            )
    header_bytes = read_headers(ckpt.path, sorted(f.name for f in by_file))
    files = {}
    for name in SMALL_FILES:
        p = ckpt.path / name
        if p.is_file() and p.stat().st_size <= MAX_SMALL_FILE:
            data = p.read_bytes()
            files[name] = (len(data), hashlib.sha256(data).hexdigest())
    return WeightManifest(
        checkpoint=headers_digest(header_bytes),
        max_request=max_request,
        files=files,
        headers={k: len(v) for k, v in header_bytes.items()},
        tensors=tensors,
        n_blocks=ckpt.n_blocks,
    )


def runs(spans: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted [start, end) spans -> maximal runs of touching spans."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        elif b > a:
            out.append((a, b))
    return out
