"""A stage: blocks [a, b) of one model (and the head on the head stage) with their KV caches.

    stage = Stage.load(ckpt, range(0, 15), head=True, backend="torch", dtype="fp32",
                       context=2048, concurrency=4)
    stage.open("r1")
    h = stage.embed([1, 2, 3])                      # head only: token ids -> hidden [T, H]
    [out] = stage.forward([("r1", 0, h)])           # every request's rows through blocks [a, b)
    logits = stage.logits(out[-1])                  # head only: final norm + unembedding -> [V]
    stage.close("r1")

Hidden states are backend arrays; `to_bytes`/`from_bytes` turn them into raw row-major bytes in
`wire_dtype` for the ring. The stage is backend-neutral: the model class comes from the Backend.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kafila.engine.backend import Backend, checkpoint_dtype, resolve
from kafila.engine.captured import decode_path
from kafila.engine.pace import FULL_SPEED, Pace
from kafila.models.manifest import LM_HEAD, QUANT_FORMATS, block_index
from kafila.models.span import Span
from kafila.obs.log import get_logger

log = get_logger(__name__)

RequestId = int | str
Item = tuple[RequestId, int, Any]  # (request id, first position, hidden [T, H])


class StageError(RuntimeError):
    """A request the stage cannot run; the message names the request and the numbers."""


class ContextFullError(StageError):
    """A request's positions would go past the declared context."""


class SlotsFullError(StageError):
    """Every KV-cache slot is taken (the declared concurrency is reached)."""


@dataclass(frozen=True)
class Entry:
    """`n_tokens` rows of a stacked step that belong to request `rid`, first at `start`."""

    rid: RequestId
    start: int
    n_tokens: int


class _Weights(Mapping[str, Any]):
    """Tensors read from the checkpoint on first access, one ranged read each, never kept here:
    the model fuses and casts as it loads, so peak memory stays near one copy of the stage."""

    def __init__(self, ckpt: Any, backend: Backend, names: Sequence[str]) -> None:
        self.ckpt, self.backend, self.names = ckpt, backend, set(names)
        self.read_names: set[str] = set()
        self.bytes_read = 0

    def __getitem__(self, name: str) -> Any:
        if name not in self.names:
            raise KeyError(name)
        info, data = self.ckpt.read([name])[name]
        self.read_names.add(name)
        self.bytes_read += len(data)
        return self.backend.tensor(info.dtype, info.shape, data)

    def __contains__(self, name: object) -> bool:  # without reading (Mapping's default would)
        return name in self.names

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


class Stage:
    """Blocks [a, b) (+ the head) with per-request KV caches preallocated for `concurrency` requests
    of up to `context` positions each.

    Threading: one thread owns a Stage. Its methods are not thread-safe and its arrays (torch
    tensors, MLX arrays) must only be touched by that thread; an asyncio shell runs them on one
    dedicated executor thread and exchanges bytes (`to_bytes`/`from_bytes`) with the network.
    """

    def __init__(
        self,
        model: Any,
        backend: Backend,
        blocks: range,
        head: bool,
        context: int,
        concurrency: int,
        bytes_loaded: int = 0,
        pace: Pace = FULL_SPEED,
        decode: str = "auto",
    ) -> None:
        self.model, self.backend, self.blocks, self.head = model, backend, blocks, head
        self.pace = pace  # an emulated slower device: the shell idles after each computation
        self.context, self.concurrency, self.bytes_loaded = context, concurrency, bytes_loaded
        where = f"[{blocks.start}, {blocks.stop})"  # decode steps: kafila.engine.captured (eager, graph)
        self.decode = decode_path(model, backend, concurrency, decode, where)
        self.cache = self.decode.cache
        self._slots: dict[RequestId, int] = {}
        self._length: dict[RequestId, int] = {}
        self._free = list(range(concurrency - 1, -1, -1))

    @classmethod
    def load(
        cls,
        ckpt: Any,
        blocks: range,
        head: bool,
        backend: Backend | str = "auto",
        dtype: str = "auto",
        context: int = 2048,
        concurrency: int = 1,
        pace: Pace = FULL_SPEED,
        decode: str = "auto",
        quant: str = "auto",
    ) -> Stage:
        """Read exactly blocks [a, b) (and the head's tensors) from a kafila Checkpoint. `quant`
        is the weight format ("none", "int8", "q4"; "auto": the checkpoint's own, `resolve_quant`)."""
        be = backend
        if isinstance(be, str):  # dtype "auto": the checkpoint's own precision
            be = resolve(be, checkpoint_dtype(dtype, ckpt.stored_dtype))
        fmt = resolve_quant(quant, ckpt.stored_format)
        return cls._build(ckpt, be, fmt, blocks, head, context, concurrency, pace, decode, None)

    def rebuild(
        self,
        ckpt: Any,
        blocks: range,
        head: bool,
        context: int,
        concurrency: int,
        pace: Pace = FULL_SPEED,
        decode: str = "auto",
        quant: str = "auto",
    ) -> Stage:
        """A stage of blocks [a, b) (and the head) for the next plan epoch, on this stage's backend:
        the blocks (and head) this stage holds are moved over as they are in memory, only the others
        are read from `ckpt`; blocks it no longer serves are left to go with this stage. The KV
        cache is new and empty (`context` x `concurrency`): requests are prefilled again. Where this
        stage's weights cannot be reused (another format or model) every tensor is read, as `load`.

        Run it on the thread that owns this stage; this stage must not be used afterwards (its
        block objects now belong to the new one too)."""
        fmt = resolve_quant(quant, ckpt.stored_format)
        same = fmt == getattr(self.model, "quant", None) and ckpt.config == self.config
        if not same:
            log.info("stage_not_reused", quant=fmt, held_quant=getattr(self.model, "quant", None))
        reuse = self.model if same else None
        be = self.backend
        return type(self)._build(ckpt, be, fmt, blocks, head, context, concurrency, pace, decode, reuse)

    @classmethod
    def _build(
        cls,
        ckpt: Any,
        be: Backend,
        fmt: str,
        blocks: range,
        head: bool,
        context: int,
        concurrency: int,
        pace: Pace,
        decode: str,
        reuse: Any | None,
    ) -> Stage:
        """The model of blocks [a, b) (+ head) on `be` in format `fmt`, taking from `reuse` (a model
        of the same class, format and config) the blocks and head it holds, reading the rest."""
        if context < 1 or concurrency < 1:
            raise StageError(f"context ({context}) and concurrency ({concurrency}) must be at least 1")
        held = reuse.blocks_range if reuse is not None else range(0)  # blocks moved, not read
        held_head = reuse is not None and bool(reuse.has_head)
        names = [n for n in ckpt.names_for(blocks, head) if not _held(n, held, held_head)]
        weights = _Weights(ckpt, be, names)
        model_cls = be.model_class(ckpt.config.model_type)
        kwargs = be.model_kwargs() | ({"quant": fmt} if fmt != "none" or ckpt.stored_format != "none" else {})
        if reuse is not None:
            kwargs["reuse"] = reuse
        model = model_cls(ckpt.config, weights, blocks, head, context=context, **kwargs)
        unread = weights.names - weights.read_names - {LM_HEAD}
        if unread:
            raise StageError(
                f"checkpoint tensors not used by the {ckpt.config.model_type} model: {sorted(unread)[:3]}"
            )
        stage = cls(model, be, blocks, head, context, concurrency, weights.bytes_read, pace, decode)
        kept = [i for i in blocks if i in held]
        log.info(
            "stage_loaded",
            blocks=f"[{blocks.start}, {blocks.stop})",
            head=head,
            backend=str(be),
            quant=fmt,
            weight_bytes=weights.bytes_read,
            kv_bytes=stage.kv_bytes,
            context=context,
            concurrency=concurrency,
            decode=stage.decode.name,
            blocks_reused=len(kept),
            head_reused=head and held_head,
        )
        return stage

    # -- requests --------------------------------------------------------------------------------

    def open(self, rid: RequestId) -> None:
        """Give request `rid` a KV-cache slot (positions start at 0)."""
        if rid in self._slots:
            raise StageError(f"request {rid!r} is already open on this stage")
        if not self._free:
            raise SlotsFullError(
                f"stage blocks [{self.blocks.start}, {self.blocks.stop}): all {self.concurrency} KV-cache "
                f"slots are in use (declared concurrency {self.concurrency}); cannot open request {rid!r}"
            )
        self._slots[rid] = self._free.pop()
        self._length[rid] = 0

    def close(self, rid: RequestId) -> None:
        """Free `rid`'s slot (unknown ids are ignored, so closing twice is harmless)."""
        slot = self._slots.pop(rid, None)
        self._length.pop(rid, None)
        if slot is not None:
            self._free.append(slot)

    def length(self, rid: RequestId) -> int:
        """Positions of `rid` held in the KV cache."""
        return self._length[self._known(rid)]

    @property
    def open_requests(self) -> list[RequestId]:
        return list(self._slots)

    @property
    def config(self) -> Any:
        """The model's ModelConfig (hidden_size, vocab_size, ...)."""
        return self.model.config

    @property
    def kv_bytes(self) -> int:
        return int(self.cache.nbytes)

    @property
    def kv_bytes_used(self) -> int:
        """KV-cache bytes that hold cached positions of open requests: the cache is allocated for
        `context` positions of `concurrency` requests, so each cached position takes that share."""
        positions = sum(dict(self._length).values())  # (a copy: read from a scrape's thread too)
        return self.kv_bytes * positions // max(1, self.context * self.concurrency)

    @property
    def batch_rows(self) -> int | None:
        """Most rows one step may hold with each request's result the same as alone (the CPU
        kernels' limit, kafila.models.torch.llama.KERNEL_ROWS); None: no bound below a chunk."""
        rows = getattr(self.model, "batch_rows", None)
        return int(rows) if rows is not None else None

    def prefill_path(self, starts: Sequence[int]) -> object:
        """Which of the model's code paths a prefill step of chunks beginning at positions `starts`
        takes (kafila.models.torch.llama.LlamaModel.prefill_path; one path for models without
        one). Chunks that take different paths alone must not share a step: their bits would
        change."""
        path = getattr(self.model, "prefill_path", None)
        return path(starts) if path is not None else None

    @property
    def wire_dtype(self) -> str:
        return self.backend.wire_dtype

    def check_fits(self, rid: RequestId, start: int, n_tokens: int) -> None:
        """Raise a clear error unless `n_tokens` rows at `start` fit `rid`'s cache."""
        have = self._length[self._known(rid)]
        if start < 0 or start > have:
            raise StageError(
                f"request {rid!r}: step starts at position {start}, but {have} positions are cached"
            )
        if start + n_tokens > self.context:
            raise ContextFullError(
                f"request {rid!r}: positions [{start}, {start + n_tokens}) exceed the context of "
                f"{self.context} tokens declared for this stage"
            )

    def _known(self, rid: RequestId) -> RequestId:
        if rid not in self._slots:
            raise StageError(f"request {rid!r} is not open on this stage")
        return rid

    # -- compute ---------------------------------------------------------------------------------

    def embed(self, token_ids: Sequence[int]) -> Any:
        """Token ids [T] -> hidden [T, H] (head stage only)."""
        self._need_head("embed")
        return self.model.embed(self.backend.ids(token_ids))

    def forward(self, items: Sequence[Item], rowwise: bool = False) -> list[Any]:
        """Items (rid, start, hidden [T, H]) -> each item's hidden [T, H] after blocks [a, b).
        All items run as one batched computation (decode steps and prefill chunks may mix);
        `rowwise`: as decode rows (`step`)."""
        entries = [Entry(rid, start, int(h.shape[0])) for rid, start, h in items]
        out = self.step(self.backend.concat([h for _, _, h in items]), entries, rowwise)
        rows, offset = [], 0
        for e in entries:
            rows.append(out[offset : offset + e.n_tokens])
            offset += e.n_tokens
        return rows

    def step(self, hidden: Any, entries: Sequence[Entry], rowwise: bool = False) -> Any:
        """Stacked hidden [N, H] whose rows belong to `entries` in order -> hidden [N, H].

        `rowwise`: every row is a decode row of its own (one Span per position; a row attends to
        the rows of its request before it in the step), as a verification step of several
        positions runs (kafila.engine.speculative): on the CPU kernels each row then has the bits
        a one-row decode step gives it. An entry may start before the positions cached for its
        request: those after its start are dropped (a rejected draft's) and written again."""
        seen: set[RequestId] = set()
        for e in entries:
            if e.rid in seen:
                raise StageError(f"request {e.rid!r} appears twice in one step")
            seen.add(e.rid)
            self.check_fits(e.rid, e.start, e.n_tokens)
        if sum(e.n_tokens for e in entries) != hidden.shape[0]:
            raise StageError(
                f"entries cover {sum(e.n_tokens for e in entries)} rows, hidden has {hidden.shape[0]}"
            )
        if rowwise:
            spans = [Span(self._slots[e.rid], e.start + i, 1) for e in entries for i in range(e.n_tokens)]
        else:
            spans = [Span(self._slots[e.rid], e.start, e.n_tokens) for e in entries]
        out = self.decode.forward(hidden, spans)
        for e in entries:
            self._length[e.rid] = e.start + e.n_tokens
        return out

    def logits(self, hidden_last: Any) -> np.ndarray:
        """Final norm + unembedding: hidden [H] -> logits [V], or [B, H] -> [B, V] (float32 numpy)."""
        self._need_head("logits")
        one = len(hidden_last.shape) == 1
        out = self.backend.numpy(self.model.logits(hidden_last[None] if one else hidden_last))
        return out[0] if one else out

    def _need_head(self, what: str) -> None:
        if not self.head:
            raise StageError(
                f"{what}() runs on the head stage; this stage holds blocks "
                f"[{self.blocks.start}, {self.blocks.stop}) without the head"
            )

    # -- wire ------------------------------------------------------------------------------------

    def to_bytes(self, hidden: Any) -> bytes:
        """hidden [T, H] -> raw row-major bytes in `wire_dtype`."""
        return self.backend.to_bytes(hidden)

    def from_bytes(self, data: bytes, shape: Sequence[int]) -> Any:
        """Raw bytes in `wire_dtype` of `shape` ([T, H]) -> hidden on this stage's backend."""
        return self.backend.from_bytes(data, shape)


def _held(name: str, blocks: range, head: bool) -> bool:
    """Whether tensor `name` belongs to a held block in `blocks` or (`head`) to the held head."""
    i = block_index(name)
    return head if i is None else i in blocks


def resolve_quant(requested: str, stored: str) -> str:
    """The weight format a stage computes with: `requested` ("none", "int8", "q4"), or for "auto"
    the checkpoint's own (`stored`: "none" for floats). Like the dtype, it depends on the checkpoint
    alone, so every member of a session resolves the same format."""
    if requested == "auto":
        return stored
    if requested not in QUANT_FORMATS:
        raise StageError(f"unknown weight format {requested!r}; choose auto, {', '.join(QUANT_FORMATS)}")
    if stored != "none" and requested not in ("none", stored):  # its packed matrices would stay as stored
        raise StageError(
            f"the checkpoint's weights are packed in {stored}: serve them as {stored} (or auto) or widened "
            f"to floats (none), not repacked in {requested}; `kafila models --quantize {requested}` of "
            "the float folder writes a folder in that format"
        )
    return requested
