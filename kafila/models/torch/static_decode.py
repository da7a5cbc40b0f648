"""Decode steps on static buffers, so that a CUDA graph can capture them (kafila.engine.captured).

A captured graph replays the kernels it recorded, on the memory it recorded them with: nothing in
the step may depend on the host (no shape that changes from step to step, no `.item()`, no
allocation sized by the data). So a decode step of n rows runs in a bucket of B >= n rows
(`BUCKETS`) over a window of the first L cached positions (`keys_bucket`), one graph per (B, L):

- inputs live in each bucket's buffers (`StaticInputs`): hidden [B, H], and `index` [2, B] int64
  (positions, then slots), filled by one copy each per step;
- the KV cache is the stage's (`KVCache`, per block [slots, nkv, context, d]); its tensors are views
  into flat buffers with nkv spare rows past the end (`StaticCache`). A padding row (slot = slots)
  writes its keys and values there, so it never touches a request's slot;
- keys and values are written with `index_copy_` at rows computed on the device; attention reads the
  first L positions of each row's slot, masked on the device to the positions <= the row's.

Padding rows read the last slot at position 0 and their outputs are dropped. The block's arithmetic is
`LlamaModel._block`'s, so norms, products, RoPE and the MLP are the eager path's own ops; only
attention is this module's `_StaticAttention`.

Shapes: B = rows of the bucket, L = keys of the window, S = slots, C = context, H = hidden,
d = head_dim, nq/nkv = query/KV heads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kafila.models.span import Span
from kafila.models.torch.llama import KVCache, LlamaModel, _decode_attention

Tensor = torch.Tensor
Step = Callable[[], None]  # one decode step on a bucket's buffers
Capture = Callable[[Step], Step]  # a step -> what replays it

BUCKETS = (1, 2, 4, 8, 16, 32, 64)  # rows of a captured decode step
MIN_KEYS = 64  # the smallest keys window: windows double from here up to the context
WARMUP = 2  # eager runs on the side stream before a capture (cuBLAS picks its kernels there)


class CaptureError(RuntimeError):
    """Recording a bucket's step failed (what `Capture` raised is its cause)."""


def rows_bucket(n: int, buckets: Sequence[int] = BUCKETS) -> int | None:
    """The smallest bucket of at least `n` rows; None past the largest."""
    return next((b for b in buckets if b >= n), None)


def keys_bucket(need: int, context: int) -> int:
    """Keys a step attends over when its furthest row sees `need` positions: the next power of two
    from MIN_KEYS, at most the context (a short request reads no more of the cache than it must)."""
    keys = MIN_KEYS
    while keys < need:
        keys *= 2
    return min(keys, context)


@dataclass
class StaticCache:
    """The KV cache as the model reads it (`cache`, views) and as the static step writes it: per
    block a flat [S nkv C + nkv, d] buffer, whose last nkv rows take the padding rows' writes."""

    cache: KVCache
    flat_k: list[Tensor]
    flat_v: list[Tensor]
    slots: int
    context: int


def new_static_cache(model: LlamaModel, slots: int) -> StaticCache:
    """Zeroed caches for `slots` requests of `model.context` positions, plus the spare rows."""
    c = model.config
    nkv, d, ctx = c.num_key_value_heads, c.head_dim, model.context
    rows = slots * nkv * ctx

    def flat() -> Tensor:
        return torch.zeros((rows + nkv, d), dtype=model.dtype, device=model.device)

    fk, fv = [flat() for _ in model.blocks], [flat() for _ in model.blocks]
    views = [[f[:rows].view(slots, nkv, ctx, d) for f in fs] for fs in (fk, fv)]  # contiguous
    return StaticCache(KVCache(views[0], views[1]), fk, fv, slots, ctx)


class StaticInputs:
    """One bucket's buffers: hidden x [B, H] (updated in place by the step) and index [2, B]
    (positions, slots; a padding row has slot S)."""

    def __init__(self, rows: int, model: LlamaModel) -> None:
        self.rows = rows
        self.x = torch.zeros((rows, model.config.hidden_size), dtype=model.dtype, device=model.device)
        self.index = torch.zeros((2, rows), dtype=torch.long, device=model.device)

    def fill(self, hidden: Tensor, spans: Sequence[Span], pad_slot: int) -> None:
        """The step's rows (hidden [n, H], one span each), then padding rows."""
        n, pad = len(spans), self.rows - len(spans)
        self.x[:n].copy_(hidden)  # to the model's dtype and device
        if pad:  # zeros, not what the last steps left there (a residual growing step after step)
            self.x[n:].zero_()
        host = [[s.start for s in spans] + [0] * pad, [s.slot for s in spans] + [pad_slot] * pad]
        self.index.copy_(torch.tensor(host, dtype=torch.long))

    def park(self, pad_slot: int) -> None:
        """Every row a padding row: a step run now (a warm-up) writes nothing a request reads."""
        self.index[0].fill_(0)
        self.index[1].fill_(pad_slot)


class _StaticAttention:
    """`LlamaModel._block`'s attention for a bucket: built once per step, on the device only."""

    def __init__(self, cache: StaticCache, positions: Tensor, slots: Tensor, keys: int, nkv: int) -> None:
        s, c, dev = cache.slots, cache.context, positions.device
        heads = torch.arange(nkv, device=dev)  # [nkv]
        real = (slots[:, None] * nkv + heads) * c + positions[:, None]  # [B, nkv] flat rows
        spare = s * nkv * c + heads  # [nkv]: the padding rows' rows
        self.write_rows = torch.where(slots[:, None] < s, real, spare).reshape(-1)  # [B nkv]
        self.read_slots = slots.clamp(max=s - 1)  # [B]: padding rows read the last slot
        visible = torch.arange(keys, device=dev)[None, :] <= positions[:, None]  # [B, L]
        bias = torch.zeros(visible.shape, device=dev).masked_fill_(~visible, float("-inf"))
        self.bias = bias[:, None, None, :]  # [B, 1, 1, L]
        self.shape, self.keys = (s, nkv, c), keys

    def attend(self, q: Tensor, k: Tensor, v: Tensor, fk: Tensor, fv: Tensor) -> Tensor:
        """q [B, nq, d], k/v [B, nkv, d], fk/fv a block's flat caches -> [B, nq d]; writes k/v first."""
        b, nq, d = q.shape
        s, nkv, c = self.shape
        fk.index_copy_(0, self.write_rows, k.reshape(b * nkv, d))
        fv.index_copy_(0, self.write_rows, v.reshape(b * nkv, d))
        window = slice(0, self.keys)
        keys = fk[: s * nkv * c].view(s, nkv, c, d)[:, :, window].index_select(0, self.read_slots)
        vals = fv[: s * nkv * c].view(s, nkv, c, d)[:, :, window].index_select(0, self.read_slots)
        qg = q.view(b, nkv, nq // nkv, d)  # [B, nkv, g, d] against [B, nkv, L, d]
        return _decode_attention(qg, keys, vals, self.bias).reshape(b, nq * d)


def static_step(model: LlamaModel, cache: StaticCache, x: Tensor, index: Tensor, keys: int) -> None:
    """Every local block on x [B, H] in place: row r at position index[0, r] of slot index[1, r],
    attending over the first `keys` positions. No host sync, no data-dependent shape."""
    positions, slots = index[0], index[1]
    attention = _StaticAttention(cache, positions, slots, keys, model.config.num_key_value_heads)
    cos, sin = model.cos[positions, None], model.sin[positions, None]  # [B, 1, d]
    for blk, fk, fv in zip(model.blocks, cache.flat_k, cache.flat_v, strict=True):
        model._block(blk, x, cos, sin, attention, fk, fv)


def run_eagerly(step: Step) -> Step:
    """No capture: the step itself runs each time (on the CPU, and to test the buffers)."""
    return step


class CudaGraphCapture:
    """Records a step as a CUDA graph: WARMUP runs on a side stream first, then the capture, into a
    memory pool shared by every bucket's graph (they never run at the same time, and each keeps
    its output in its bucket's own buffer). The capture is thread-local: another thread of the
    process (another stage's model thread) may use the card meanwhile."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: list[torch.cuda.CUDAGraph] = []

    def __call__(self, step: Step) -> Step:
        side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]  # torch leaves it untyped
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(WARMUP):
                step()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            step()
        self.graphs.append(graph)
        return graph.replay


class StaticDecoder:
    """A model's decode steps through per-bucket buffers, each (rows, keys) bucket recorded by
    `capture` the first time it runs (`run_eagerly`, or a `CudaGraphCapture` on a card)."""

    def __init__(
        self, model: LlamaModel, slots: int, capture: Capture = run_eagerly, buckets: Sequence[int] = BUCKETS
    ) -> None:
        self.model, self.capture = model, capture
        self.static = new_static_cache(model, slots)
        self.cache = self.static.cache
        top = rows_bucket(slots, buckets) or max(buckets)  # no bucket past what `slots` rows need
        self.buckets = tuple(b for b in buckets if b <= top)
        self._inputs: dict[int, StaticInputs] = {}
        self._steps: dict[tuple[int, int], Step] = {}

    @property
    def recorded(self) -> list[tuple[int, int]]:
        """(rows, keys) of the buckets recorded so far."""
        return sorted(self._steps)

    def takes(self, spans: Sequence[Span]) -> bool:
        """Whether a step of these spans runs here: decode rows only, within the largest bucket."""
        return bool(spans) and all(s.length == 1 for s in spans) and len(spans) <= self.buckets[-1]

    @torch.inference_mode()
    def forward(self, hidden: Tensor, spans: Sequence[Span]) -> Tensor:
        """Decode rows hidden [n, H] (one per span) -> hidden [n, H] after every local block: a copy,
        as the buffers belong to the next step. CaptureError where the bucket cannot be recorded."""
        rows = rows_bucket(len(spans), self.buckets)
        assert rows is not None and self.takes(spans), "a step StaticDecoder.takes() refused"
        keys = keys_bucket(max(s.start for s in spans) + 1, self.static.context)
        step = self._steps.get((rows, keys)) or self._record(rows, keys)
        inputs = self._inputs[rows]
        inputs.fill(hidden, spans, self.static.slots)
        step()
        return inputs.x[: len(spans)].clone()

    def _record(self, rows: int, keys: int) -> Step:
        inputs = self._inputs.get(rows) or self._inputs.setdefault(rows, StaticInputs(rows, self.model))
        inputs.park(self.static.slots)  # the warm-up runs write the spare rows only
        step = functools.partial(static_step, self.model, self.static, inputs.x, inputs.index, keys)
        try:
            recorded = self.capture(step)
        except Exception as exc:  # whatever the capture raised: the caller falls back to eager
            raise CaptureError(f"recording the decode step of {rows} rows over {keys} keys: {exc}") from exc
        self._steps[(rows, keys)] = recorded
        return recorded
