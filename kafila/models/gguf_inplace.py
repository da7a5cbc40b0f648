"""`model.safetensors` of a converted GGUF, made from the GGUF where it lies: no copy of the weights.

A converted folder (kafila.models.gguf_convert) holds `model.safetensors.gguf.json` in place of
`model.safetensors`: the GGUF's path and (size, mtime_ns, inode), the safetensors header the copy
would have, and for every tensor its byte range in that file, its sha256 and its `Recipe`: where
its source bytes lie in the GGUF (offset, ggml type, shape), the form it is served in (int8, q4k, a
float dtype) and the row order that puts back a Llama's q/k rows. `InPlaceFile` reads any byte
range of that file by making the rows it covers from the GGUF (memory-mapped): repacking a kept
type (Q8_0, Q4_1, Q4_0, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K) costs a copy of its bytes, requantizing one
(Q3_K, Q2_K to q4) is done again each time its rows are read (at a member's load and for
each range a fetching member asks for; nothing is cached on disk; the entries of a matrix its read
did not ask for are kept for the next read, a loader's of its scales and mins). Every step works
row by row,
so rows made alone are the rows of the whole matrix: the bytes are the copy's, byte for byte
(kafila.models.gguf_index writes the index, and that copy), and so are the digests the index
holds.

The GGUF must stay the one the index describes: an `InPlaceFile` opened on a GGUF whose size,
mtime or inode changed, or that is gone (Ollama pulled another version, `ollama rm`), raises
SourceChanged naming it, and each read checks that again before and after making its bytes.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
import json
import mmap
import os
import struct
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from kafila.models import gguf_types as types
from kafila.models.manifest import DTYPE_BYTES, NP_DTYPES, PACKED_DTYPES, TensorSpec, packed_specs
from kafila.models.weight_file import SourceChanged, file_stamp, inplace_index

INDEX_VERSION = 1


@dataclass(frozen=True)
class Recipe:
    """How the entries of one GGUF tensor are made from its bytes: `target` a packed format
    (manifest.LAYOUTS: the matrix, its scales and the siblings the format has) or the float dtype it
    is served in (F32 widens a type kept as stored otherwise); `unpermute`: the head count whose q/k
    rows are put back (Llama)."""

    name: str  # the served (Hugging Face) name
    source: str  # the GGUF tensor's name
    shape: tuple[int, ...]  # numpy order, outermost first
    ggml_type: int
    start: int  # absolute offset of its bytes in the GGUF
    nbytes: int
    target: str
    unpermute: int | None = None

    @property
    def packed(self) -> bool:
        return self.target in PACKED_DTYPES

    @property
    def requantized(self) -> bool:
        return self.packed and types.how(self.ggml_type, self.target) == "requantized"

    @property
    def n_rows(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1

    def specs(self) -> list[TensorSpec]:
        if self.packed:
            return packed_specs(self.name, self.target, self.shape)
        return [TensorSpec(self.name, self.target, self.shape)]

    def make(
        self, raw: np.ndarray, a: int, b: int, measure: bool = False
    ) -> tuple[dict[str, np.ndarray], types.Requantized | None]:
        """Rows [a, b) of each entry from the tensor's stored bytes `raw` (uint8), and what
        requantizing them changed (with `measure`; None where nothing was requantized)."""
        rows = np.asarray(raw, dtype=np.uint8).reshape(self.n_rows, -1)
        if self.unpermute is not None:
            part = rows[types.unpermute_qk(np.arange(self.n_rows), self.unpermute)[a:b]]
        else:
            part = rows[a:b]
        shape = (b - a, *self.shape[1:]) if len(self.shape) > 1 else self.shape
        if self.packed:
            packed, error = types.serve(part, self.ggml_type, (b - a, self.shape[1]), self.target, measure)
            return packed.entries(self.name), error
        if self.target == "F32" and self.ggml_type != types.F32:
            return {self.name: types.widen(part, self.ggml_type, shape)}, None
        return {self.name: types.float_entry(part, self.ggml_type, shape)}, None

    def to_json(self) -> list[Any]:
        return [
            self.name, self.source, list(self.shape), self.ggml_type, self.start, self.nbytes,
            self.target, self.unpermute,
        ]  # fmt: skip

    @classmethod
    def from_json(cls, d: list[Any]) -> Recipe:
        name, source, shape, kind, start, nbytes, target, unpermute = d
        return cls(
            str(name), str(source), tuple(int(x) for x in shape), int(kind), int(start), int(nbytes),
            str(target), None if unpermute is None else int(unpermute),
        )  # fmt: skip


def entry_bytes(spec: TensorSpec, a: np.ndarray, rows: int) -> memoryview:
    """`a` as `spec`'s bytes of `rows` rows (checked against the spec)."""
    a = np.ascontiguousarray(a, dtype=NP_DTYPES[spec.dtype])
    want = (rows, *spec.shape[1:]) if len(spec.shape) > 1 else spec.shape
    if a.shape != tuple(want):
        raise ValueError(f"{spec.name}: made {a.dtype}{list(a.shape)}, header says {spec.dtype}{list(want)}")
    return a.view(np.uint8).reshape(-1).data


@dataclass(frozen=True)
class _Entry:
    name: str
    start: int
    end: int
    sha256: str
    recipe: int
    spec: TensorSpec

    @property
    def row_bytes(self) -> int:
        rows = self.spec.shape[0] if len(self.spec.shape) > 1 else 1
        return (self.end - self.start) // max(rows, 1)


@dataclass(frozen=True)
class _Index:
    gguf: Path
    stamp: list[int]
    header: bytes
    recipes: list[Recipe]
    entries: list[_Entry]  # by start
    size: int


@functools.lru_cache(maxsize=16)
def _load_index(path: Path, stamp: tuple[int, ...]) -> _Index:
    """An index file parsed (remembered while its stamp holds: every Checkpoint.read opens the file anew)."""
    try:
        d = json.loads(path.read_text(encoding="utf-8"))
        if d.get("version") != INDEX_VERSION:
            raise ValueError(f"index version {d.get('version')!r}, not {INDEX_VERSION}")
        text = str(d["header"])
        header = struct.pack("<Q", len(text.encode())) + text.encode()
        recipes = [Recipe.from_json(r) for r in d["recipes"]]
        specs = {s.name: s for r in recipes for s in r.specs()}
        entries = sorted(
            (_Entry(str(n), int(a), int(b), str(h), int(i), specs[str(n)]) for n, a, b, h, i in d["tensors"]),
            key=lambda e: e.start,
        )
        at = len(header)
        for e in entries:
            if e.start != at or e.end - e.start != e.spec.nbytes() or e.spec.dtype not in DTYPE_BYTES:
                raise ValueError(f"tensor {e.name} at [{e.start}, {e.end}) does not follow byte {at}")
            at = e.end
        return _Index(Path(d["gguf"]), [int(x) for x in d["stamp"]], header, recipes, entries, at)
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise ValueError(f"{path}: not an index of a GGUF's tensors ({exc})") from exc


class InPlaceFile:
    """The safetensors file `path` stands for, made from the GGUF its index names (a WeightFile)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        index_file = inplace_index(path)
        self.index_stamp = file_stamp(os.stat(index_file))
        self.index = _load_index(index_file, tuple(self.index_stamp))
        self.gguf = self.index.gguf
        try:
            self.fd = os.open(self.gguf, os.O_RDONLY)
        except FileNotFoundError:
            raise SourceChanged(self._gone()) from None
        try:
            self._check(file_stamp(os.fstat(self.fd)))
            self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ) if self.index.size else None
        except BaseException:
            os.close(self.fd)
            raise

    def _gone(self) -> str:
        return (
            f"{self.path.parent}: its weights are the GGUF {self.gguf}, which is gone (removed, or "
            "Ollama pulled another version of the model): run the model again to convert what is there now"
        )

    def _check(self, now: list[int]) -> None:
        if now != self.index.stamp:
            raise SourceChanged(
                f"{self.path.parent}: its weights are the GGUF {self.gguf}, which changed since it was "
                f"converted (size, mtime_ns, inode: {self.index.stamp} -> {now}); refusing its bytes: run "
                "the model again to convert what is there now"
            )

    def _check_path(self) -> None:
        """The GGUF at its path is still the one described (not removed, replaced or written)."""
        try:
            self._check(file_stamp(os.stat(self.gguf)))
        except FileNotFoundError:
            raise SourceChanged(self._gone()) from None

    def size(self) -> int:
        return self.index.size

    def stamp(self) -> list[int]:
        """The GGUF's (SourceChanged unless the one at its path is the one described) and the index's
        as it is now (a conversion written over it since it was opened shows)."""
        self._check_path()
        return [*self.index.stamp, *file_stamp(os.stat(inplace_index(self.path)))]

    def digests(self) -> dict[str, str] | None:
        return {e.name: e.sha256 for e in self.index.entries}

    def pread(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        got = self.read_into([memoryview(buf)], offset)
        return bytes(buf[:got])

    def read_into(self, views: list[memoryview], offset: int) -> int:
        """Fill `views` in order with the bytes from `offset` (until the file's end); each recipe
        whose entries the range touches makes the rows they cover, once."""
        self._check_path()
        total = sum(len(v) for v in views)
        end = min(offset + total, self.index.size)
        if end <= offset:
            return 0
        out = _Views(views, offset)
        header = self.index.header
        if offset < len(header):
            out.put(offset, memoryview(header)[offset : min(end, len(header))])
        wanted: dict[int, list[tuple[_Entry, int, int]]] = {}
        for e in self._overlapping(offset, end):
            wanted.setdefault(e.recipe, []).append((e, max(e.start, offset), min(e.end, end)))
        for i, pieces in wanted.items():
            r = self.index.recipes[i]
            a = min((lo - e.start) // e.row_bytes for e, lo, _ in pieces)
            b = max(-(-(hi - e.start) // e.row_bytes) for e, _, hi in pieces)
            key = (str(self.path), *self.index_stamp, i, a, b)
            used = {e.name for e, _, _ in pieces}
            parts = _LEFT.take(key)
            if parts is None or not used <= parts.keys():
                assert self.map is not None
                raw = np.frombuffer(self.map, np.uint8, count=r.nbytes, offset=r.start)
                parts, _ = r.make(raw, a, b)
                del raw
            _LEFT.keep(key, {n: np.array(v) for n, v in parts.items() if n not in used})
            for e, lo, hi in pieces:
                data = entry_bytes(e.spec, parts[e.name], b - a)
                skip = lo - e.start - a * e.row_bytes
                out.put(lo, data[skip : skip + hi - lo])
                del data
            del parts
        self._check_path()
        return end - offset

    def _overlapping(self, a: int, b: int) -> list[_Entry]:
        entries = self.index.entries
        lo, hi = 0, len(entries)
        while lo < hi:  # the first entry ending after a
            mid = (lo + hi) // 2
            if entries[mid].end <= a:
                lo = mid + 1
            else:
                hi = mid
        found = []
        for e in entries[lo:]:
            if e.start >= b:
                break
            found.append(e)
        return found

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # an array made from it lives: it goes with that
                self.map.close()
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> InPlaceFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class _Left:
    """The entries of the last few recipes made that their read did not ask for (a loader reads a
    packed matrix's weight, scales and mins one read each: its rows are made once, not three times).
    Bounded by count; each taken once."""

    def __init__(self, keep: int) -> None:
        self.keep_n = keep
        self.made: OrderedDict[tuple[Any, ...], dict[str, np.ndarray]] = OrderedDict()
        self.lock = threading.Lock()

    def take(self, key: tuple[Any, ...]) -> dict[str, np.ndarray] | None:
        with self.lock:
            return self.made.pop(key, None)

    def keep(self, key: tuple[Any, ...], parts: dict[str, np.ndarray]) -> None:
        if not parts:
            return
        with self.lock:
            self.made[key] = parts
            while len(self.made) > self.keep_n:
                self.made.popitem(last=False)


_LEFT = _Left(4)


class _Views:
    """Buffers filled in order as one range of a file starting at `offset`."""

    def __init__(self, views: list[memoryview], offset: int) -> None:
        self.views = [v.cast("B") if v.format != "B" or v.ndim != 1 else v for v in views]
        self.starts = []
        at = offset
        for v in self.views:
            self.starts.append(at)
            at += len(v)

    def put(self, at: int, data: memoryview) -> None:
        """Bytes `data` at file offset `at`."""
        i = bisect.bisect_right(self.starts, at) - 1
        done = 0
        while done < len(data) and i < len(self.views):
            v, start = self.views[i], self.starts[i]
            skip = at + done - start
            n = min(len(v) - skip, len(data) - done)
            if n > 0:
                v[skip : skip + n] = data[done : done + n]
                done += n
            i += 1
