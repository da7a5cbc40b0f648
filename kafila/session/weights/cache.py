"""The member's local weight cache: content-addressed tensor blobs and per-shard model folders.

Layout under `registry.cache_dir()` (see docs/weights.md):

    blobs/<kk>/<key>.safetensors        one tensor as a one-tensor safetensors file; <key> is
                                        `blob_key(name, dtype, shape, sha256 of the data bytes)`
    blobs/hashes/<path digest>.json     a blob's digest with its (size, mtime_ns, inode) when it hashed right
    weights/<ckpt16>/files/<name>       the checkpoint's small files (config.json, tokenizer.json, ...)
    weights/<ckpt16>/shard-<a>-<b>[-head]/
        config.json, tokenizer*.json... symlinks into files/
        <key>.safetensors               symlinks into blobs/
        model.safetensors.index.json    {"weight_map": {tensor name: "<key>.safetensors"}}

A shard folder is an ordinary sharded Hugging Face folder, so `Checkpoint.open` reads it and
`Stage.load` loads it unchanged. Every file is written to a temporary name in its own folder and
renamed into place, so a crash leaves either the whole file or nothing.

`HashCache` keeps the host's per-tensor sha256 digests next to the file's size, mtime and inode,
so a host hashes a checkpoint once, not once per session.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import struct
import tempfile
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from kafila.models.cache import cache_dir
from kafila.models.checkpoint import INDEX_FILE, CheckpointError, TensorInfo, open_weights, read_header
from kafila.models.weight_file import file_stamp
from kafila.obs.log import get_logger

HASH_CHUNK = 8 << 20  # bytes hashed per read


log = get_logger("kafila.weights")


def blob_key(name: str, dtype: str, shape: Iterable[int], sha256: str) -> str:
    """The content address of one tensor: its name, dtype, shape and the sha256 of its bytes."""
    text = f"{name}\0{dtype}\0{','.join(str(int(d)) for d in shape)}\0{sha256}"
    return hashlib.sha256(text.encode()).hexdigest()


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


# read once, at import: setting the umask to read it is not safe once store threads write. Files
# and folders of the cache get the permissions any file would (mkstemp/mkdtemp make them 0600/0700:
# a cache shared by the users of one machine was unreadable to all but the first).
UMASK = _umask()


def part_beside(path: Path) -> tuple[int, str]:
    """A new `.part` file beside `path` (the name BlobStore.sweep removes when it is left behind),
    with the permissions any file gets: its descriptor and path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
    os.fchmod(fd, 0o666 & ~UMASK)
    return fd, tmp


def write_atomic(path: Path, chunks: Iterable[bytes | bytearray | memoryview], durable: bool = True) -> None:
    """Write `chunks` to `path` via a temporary file in the same folder and a rename (`durable`:
    synced to disk first; a cache of something that can be recomputed need not be)."""
    fd, tmp = part_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def one_tensor_header(name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> bytes:
    """8-byte length + JSON header (space-padded to 8 bytes) of a safetensors file holding one tensor."""
    body = json.dumps(
        {name: {"dtype": dtype, "shape": list(shape), "data_offsets": [0, nbytes]}}, separators=(",", ":")
    ).encode()
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


class BlobStore:
    """Content-addressed one-tensor safetensors files under `root` (e.g. cache_dir()/blobs).

    Each blob's digest is remembered in a `HashCache` under `root/hashes` with the (size, mtime_ns,
    inode) the blob had when its bytes were known to hash right (when stored, after the fetched
    bytes were checked). A blob changed on disk since (overwritten in place, copied, restored) is
    hashed again before it is used, and one that no longer hashes right is fetched again."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.hashes = HashCache(self.root / "hashes")

    def path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def has(self, key: str, name: str, dtype: str, shape: tuple[int, ...], nbytes: int, sha256: str) -> bool:
        """True when the blob exists, its header says exactly this tensor and its bytes hash to
        `sha256` (hashed only when the blob changed since it last did)."""
        path = self.path(key)
        if not path.is_file():
            return False
        try:
            info = read_header(path).get(name)
            if info is None or (info.dtype, info.shape, info.nbytes) != (dtype, shape, nbytes):
                return False
            good = self.hashes.digests(path, [info])[name] == sha256
        except (CheckpointError, OSError):
            return False
        if not good:
            log.warning("weights_blob_damaged", blob=str(path), tensor=name, nbytes=nbytes)
        return good

    def sweep(self, before: float) -> int:
        """Remove the `.part` files of writes that ended without their rename (a member killed while
        storing) last modified before `before` (epoch s; a write in progress is seconds old)."""
        removed = 0
        for part in self.root.glob("*/.*.part") if self.root.is_dir() else ():
            with contextlib.suppress(OSError):  # gone meanwhile: another member's sweep
                if part.stat().st_mtime < before:
                    part.unlink()
                    removed += 1
        return removed

    def put(self, key: str, name: str, dtype: str, shape: tuple[int, ...], data: bytes | bytearray) -> Path:
        path = self.path(key)
        write_atomic(path, [one_tensor_header(name, dtype, shape, len(data)), data])
        return path

    def part(self, key: str, name: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> BlobPart:
        """A blob to be written range by range as its bytes arrive (kept by `BlobPart.keep`)."""
        return BlobPart(self.path(key), one_tensor_header(name, dtype, shape, nbytes), nbytes)


class BlobPart:
    """A blob written as its ranges arrive, for a tensor too large to assemble in memory (a 622 MB
    int8 embedding beside a serving stage): a `.part` file beside the blob (the store's sweep
    removes one left behind), the one-tensor header first, each range at its offset, then its
    bytes hashed from the file and the file renamed into place."""

    def __init__(self, path: Path, header: bytes, nbytes: int) -> None:
        fd, tmp = part_beside(path)
        self.path, self.tmp, self.fd = path, Path(tmp), fd
        # held while writing and while closing: a write whose awaiting task was cancelled goes on
        # in its thread, and must not reach the descriptor number once another file has it
        self._lock = threading.Lock()
        self.base, self.nbytes = len(header), nbytes
        try:
            _pwrite_all(fd, header, 0)
            os.ftruncate(fd, self.base + nbytes)
        except BaseException:
            self.discard()
            raise

    def write_at(self, offset: int, data: bytes | memoryview) -> None:
        """The tensor's bytes [offset, offset + len(data))."""
        if offset < 0 or offset + len(data) > self.nbytes:
            raise ValueError(f"range {offset}+{len(data)} outside a {self.nbytes}-byte tensor")
        with self._lock:
            if self.fd < 0:
                raise OSError(f"{self.tmp}: written after it was kept or dropped")
            _pwrite_all(self.fd, data, self.base + offset)

    def sha256(self) -> str:
        """The digest of the tensor's bytes as written (read back through one 1 MiB buffer)."""
        h, at, end = hashlib.sha256(), self.base, self.base + self.nbytes
        buf = bytearray(1 << 20)
        while at < end:
            n = os.preadv(self.fd, [memoryview(buf)[: min(len(buf), end - at)]], at)
            if n <= 0:
                raise OSError(f"{self.tmp}: ends at byte {at} of {end}")
            h.update(memoryview(buf)[:n])
            at += n
        return h.hexdigest()

    def keep(self) -> Path:
        """Synced, closed and renamed to the blob's path."""
        with self._lock:
            os.fsync(self.fd)
            os.close(self.fd)
            self.fd = -1
        os.replace(self.tmp, self.path)
        return self.path

    def discard(self) -> None:
        with self._lock:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        self.tmp.unlink(missing_ok=True)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


@dataclass(frozen=True)
class ShardFolder:
    """Where a shard's folder goes and what it links to."""

    path: Path
    files: dict[str, Path]  # small file name -> its cached copy
    blobs: dict[str, Path]  # tensor name -> its blob


def build_shard_folder(shard: ShardFolder) -> Path:
    """Materialise `shard` (symlinks + index) atomically; an existing folder that says the same is
    kept (so a folder being read is never pulled away), any other is replaced."""
    if _same_shard(shard):
        return shard.path
    shard.path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=shard.path.parent, prefix=f".{shard.path.name}."))
    tmp.chmod(0o777 & ~UMASK)
    try:
        for name, target in shard.files.items():
            (tmp / name).symlink_to(target.resolve())
        weight_map = {}
        for name, blob in sorted(shard.blobs.items()):
            link = blob.name
            if not (tmp / link).exists():
                (tmp / link).symlink_to(blob.resolve())
            weight_map[name] = link
        index = {"metadata": {"kafila_shard": True}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=1, sort_keys=True))
        if shard.path.exists():
            old = shard.path.with_name(f".{shard.path.name}.old.{os.getpid()}")
            os.replace(shard.path, old)
            os.replace(tmp, shard.path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, shard.path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return shard.path


def _same_shard(shard: ShardFolder) -> bool:
    try:
        index = json.loads((shard.path / INDEX_FILE).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(index, dict):  # damaged: rebuilt like a missing one
        return False
    links = {**{n: n for n in shard.files}, **{n: b.name for n, b in shard.blobs.items()}}
    targets = {**shard.files, **shard.blobs}
    return index.get("weight_map") == {n: b.name for n, b in shard.blobs.items()} and all(
        (shard.path / links[n]).resolve() == targets[n].resolve() for n in targets
    )


def sha256_range(fd: int, start: int, end: int) -> str:
    """sha256 of bytes [start, end) of an open file (read in HASH_CHUNK pieces)."""
    h = hashlib.sha256()
    at = start
    while at < end:
        chunk = os.pread(fd, min(HASH_CHUNK, end - at), at)
        if not chunk:
            raise CheckpointError(f"file ends at byte {at}, before the tensor's end {end}")
        h.update(chunk)
        at += len(chunk)
    return h.hexdigest()


class HashCache:
    """Per-file tensor digests, remembered while the file's (size, mtime_ns, inode) stay the same."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    def _entry(self, file: Path) -> Path:
        return self.root / f"{hashlib.sha256(str(file.resolve()).encode()).hexdigest()[:32]}.json"

    def digests(
        self, file: Path, infos: list[TensorInfo], on_bytes: Callable[[int], None] | None = None
    ) -> dict[str, str]:
        """sha256 of each tensor's bytes in `file` (hashing only what is not remembered);
        `on_bytes(n)` hears the bytes of the remembered ones at once, then of each one hashed."""
        said = on_bytes or (lambda n: None)
        with open_weights(file) as f:  # a file made from a GGUF knows its digests (its index's)
            made = f.digests()
        if made is not None:
            said(sum(t.end - t.start for t in infos))
            return {t.name: made[t.name] for t in infos}
        stamp = file_stamp(os.stat(file))
        entry = self._entry(file)
        known: dict[str, str] = {}
        try:
            saved = json.loads(entry.read_text())
        except (OSError, ValueError):
            saved = None
        if isinstance(saved, dict) and saved.get("stamp") == stamp and isinstance(saved.get("sha256"), dict):
            known = {str(k): str(v) for k, v in saved["sha256"].items()}  # else: damaged, hashed again
        missing = [t for t in infos if t.name not in known]
        said(sum(t.end - t.start for t in infos if t.name in known))
        if missing:
            with open(file, "rb") as f:
                for t in missing:
                    known[t.name] = sha256_range(f.fileno(), t.start, t.end)
                    said(t.end - t.start)
            if file_stamp(os.stat(file)) == stamp:  # the file did not change while we hashed it
                self._save(entry, stamp, known)
        return {t.name: known[t.name] for t in infos}

    def remember(self, file: Path, digests: dict[str, str]) -> None:
        """Digests of `file`'s tensors known without reading it (its writer checked them)."""
        self._save(self._entry(file), file_stamp(os.stat(file)), digests)

    def _save(self, entry: Path, stamp: list[int], digests: dict[str, str]) -> None:
        """Remembering is a saving, not a need: not synced to disk, and a cache that cannot be
        written is said, not raised."""
        try:
            write_atomic(entry, [json.dumps({"stamp": stamp, "sha256": digests}).encode()], durable=False)
        except OSError as exc:
            log.warning("hash_cache_not_written", folder=str(self.root), error=str(exc))


def cache_root(cache: Path | None) -> Path:
    if cache is not None:
        return Path(cache)
    return cache_dir()


def cache_problem(cache: Path | None) -> str | None:
    """Why the weight cache cannot be used at all (a file where a folder must be), named before a
    session starts rather than when the weights arrive; None if it may be."""
    root = cache_root(cache)
    for folder in (root, *root.parents):
        if folder.exists() and not folder.is_dir():
            return (
                f"cannot use the weight cache under {root}: {folder} is a file, not a folder; set "
                "KAFILA_CACHE to another folder"
            )
    return None
