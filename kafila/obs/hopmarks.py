"""Timestamps of each hidden-state frame's way through a member: where a hop's time goes.

Off unless the environment variable KAFILA_HOP_MARKS names a folder. Then every process appends
lines `TAG REQUEST:POSITION:ROWS NS` to FOLDER/PID.marks: the frame's first entry and
`time.perf_counter_ns()`, which on Linux is CLOCK_MONOTONIC, one clock for every process of a
machine, so marks of the members of a local fleet line up. `benchmarks/hop_costs.py` reads them.
A disabled mark costs one test; an enabled one an f-string and a list append under a lock (a
write every `FLUSH_EVERY` marks and at exit).

The tags, in the order a decode step meets them (docs/benchmarks.md, "Where a hop's time goes"):

- every member, for the frame it receives: `read` (when the latest batch of socket reads before
  the frame was decoded began: the one that completed the frame, unless another datagram, such as
  an ACK, was read in between), `decoded` (the link delivered it and it is a message again),
  `submit` (handed to the model thread), `start` / `end` (the model thread's compute), `back`
  (the event loop has the result), `send` (the loop gives the output to its link), `encoded`,
  `sent` (after `sendto`);
- the head, for the step it starts: `submit`, `start`, `end`, `back`, `send`, `encoded`, `sent`;
  for the frame that comes back: `read`, `decoded`, `l_submit`, `l_start`, `l_end` (the logits) and
  `sampled` (the tokens sampled, on the model thread). A decode step that the model thread runs
  right after sampling the tokens it carries (RingHead) has its `submit` there too.
"""

from __future__ import annotations

import atexit
import os
import threading
import time
from collections.abc import Sequence
from typing import Protocol

ENV = "KAFILA_HOP_MARKS"
FLUSH_EVERY = 256
FOLDER = os.environ.get(ENV) or None
_lines: list[str] = []
_lock = threading.Lock()  # the event loop and the model thread both mark


class _Entry(Protocol):  # read-only, as kafila.proto.tensor.Entry and kafila.engine.stage.Entry are
    @property
    def request_id(self) -> int: ...

    @property
    def position(self) -> int: ...

    @property
    def n_tokens(self) -> int: ...


def mark(tag: str, entries: Sequence[_Entry], ns: int | None = None) -> None:
    """Record `tag` for the frame whose first entry is `entries[0]`, now or at `ns`."""
    if FOLDER is None or not entries:
        return
    e = entries[0]
    at = time.perf_counter_ns() if ns is None else ns
    with _lock:
        _lines.append(f"{tag} {e.request_id}:{e.position}:{e.n_tokens} {at}\n")
        if len(_lines) >= FLUSH_EVERY:
            _write()


def flush() -> None:
    with _lock:
        _write()


def _write() -> None:
    if FOLDER is None or not _lines:
        return
    with open(os.path.join(FOLDER, f"{os.getpid()}.marks"), "a") as f:
        f.writelines(_lines)
    _lines.clear()


atexit.register(flush)
