"""A checkpoint's safetensors file as the loader and the weight server read it: by byte range.

Most are plain files. A folder converted from a GGUF holds `model.safetensors` as an index
instead (`model.safetensors.gguf.json`, kafila.models.gguf_inplace): the same bytes, made from the
GGUF where it lies when they are read. Both are a `WeightFile` (`kafila.models.checkpoint.
open_weights` opens either), so Checkpoint.read, the host's manifest and the weight server read
tensors one way:

    with open_weights(folder / "model.safetensors") as f:
        head = f.pread(0, 8)
        f.read_into([memoryview(buf)], start)

`stamp()` is what says the bytes changed without reading them (size, mtime_ns, inode of the file,
or of the GGUF and the index), of what the path names now: a file kept open (the weight server's)
still tells that it was written or replaced since; `digests()` the sha256 of each tensor where
the file already knows them (the index, which hashed them when it was made), else None.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import TracebackType
from typing import Protocol

INPLACE_SUFFIX = ".gguf.json"  # model.safetensors made from a GGUF: model.safetensors.gguf.json

# Linux caps one read at 0x7ffff000 bytes and one vectored read at IOV_MAX (1024) buffers.
_IOV_MAX = 1024


class SourceChanged(OSError):
    """The bytes a file stands for changed or are gone since it was described (a GGUF replaced or
    removed under its index); the message names the file and what changed."""


def inplace_index(path: Path) -> Path:
    """The index that stands for safetensors file `path` where it is made from a GGUF."""
    return path.with_name(path.name + INPLACE_SUFFIX)


def is_weight_file(path: Path) -> bool:
    """Whether `path` is a safetensors file a checkpoint may read: on disk, or an index's."""
    return path.is_file() or inplace_index(path).is_file()


def file_stamp(st: os.stat_result) -> list[int]:
    """What tells a file's contents changed without reading them: size, mtime_ns, inode."""
    return [st.st_size, st.st_mtime_ns, st.st_ino]


class WeightFile(Protocol):
    path: Path  # the safetensors file's path (an index's stands beside it)

    def size(self) -> int: ...

    def stamp(self) -> list[int]: ...

    def read_into(self, views: list[memoryview], offset: int) -> int: ...

    def pread(self, offset: int, length: int) -> bytes: ...

    def digests(self) -> dict[str, str] | None: ...

    def close(self) -> None: ...

    def __enter__(self) -> WeightFile: ...

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None: ...


class PlainFile:
    """A safetensors file on disk, read with `pread`s on one descriptor."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)

    def size(self) -> int:
        return os.fstat(self.fd).st_size

    def stamp(self) -> list[int]:
        return file_stamp(os.stat(self.path))  # the path's: a file put in its place shows its inode

    def read_into(self, views: list[memoryview], offset: int) -> int:
        """Fill `views` from `offset` in order (short reads resumed); bytes read until EOF."""
        pending = [v for v in views if len(v)]
        total = 0
        while pending:
            if hasattr(os, "preadv"):
                n = os.preadv(self.fd, pending[:_IOV_MAX], offset)
            else:  # no vectored reads on this platform
                n = os.readv(self.fd, pending[:1]) if os.lseek(self.fd, offset, os.SEEK_SET) == offset else 0
            if n <= 0:
                break
            offset += n
            total += n
            while n and pending:
                if n >= len(pending[0]):
                    n -= len(pending.pop(0))
                else:
                    pending[0], n = pending[0][n:], 0
        return total

    def pread(self, offset: int, length: int) -> bytes:
        buf = bytearray(length)
        got = self.read_into([memoryview(buf)], offset)
        return bytes(buf[:got])

    def digests(self) -> dict[str, str] | None:
        return None

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> PlainFile:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
