"""Which code runs a stage's decode steps, and the fallback to torch's ops one by one.

    path = decode_path(model, backend, slots, mode="auto")
    path.cache                                  # the KV cache the stage holds
    out = path.forward(hidden, spans)           # hidden [N, H] -> [N, H] after the stage's blocks

Modes (`Stage.load(decode=...)`, else $KAFILA_DECODE, else "auto"):
- "eager": the model's own `forward`, kernel by kernel (torch on the CPU: the compiled decode_cpu path).
- "graph": decode steps of up to 64 rows replayed as CUDA graphs, one per (rows, keys) bucket,
  recorded the first time a bucket runs (kafila.models.torch.static_decode). On a card one decode
  step of a stage is then one launch, where eager pays the dispatch of ~25 kernels per block.
- "static": the same static buffers and step, run without capture (the CPU-testable heart of "graph").
- "auto": "graph" for torch on a CUDA card, "eager" elsewhere.

Prefill chunks, steps of more rows than the largest bucket, and everything after a capture that
raised take the eager path on the same cache; each such fallback is logged once per stage.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any, Protocol

from kafila.models.span import Span
from kafila.obs.log import get_logger

log = get_logger(__name__)

MODES = ("auto", "eager", "static", "graph")
DECODE_ENV = "KAFILA_DECODE"


class DecodePath(Protocol):
    name: str  # the mode in force: "eager", "static" or "graph"
    cache: Any  # the model's KV cache

    def forward(self, hidden: Any, spans: Sequence[Span]) -> Any: ...


def resolve_mode(mode: str, backend: Any) -> str:
    """`mode` (or $KAFILA_DECODE for "auto") as "eager", "static" or "graph" for this backend."""
    if mode == "auto":
        mode = os.environ.get(DECODE_ENV) or "auto"
        source = f"${DECODE_ENV}"
    else:
        source = "decode mode"
    if mode not in MODES:
        raise ValueError(f"{source} {mode!r} is not one of {', '.join(MODES)}")
    if mode == "auto":
        return "graph" if (backend.name, backend.device) == ("torch", "cuda") else "eager"
    return mode


class EagerDecode:
    """The model's own forward on its own cache."""

    name = "eager"

    def __init__(self, model: Any, slots: int) -> None:
        self.model, self.cache = model, model.new_cache(slots)

    def forward(self, hidden: Any, spans: Sequence[Span]) -> Any:
        return self.model.forward(hidden, spans, self.cache)


class StaticDecode:
    """Decode steps through `StaticDecoder` (captured or not), the rest through the model's forward
    on the same cache; a capture that raises turns the stage eager for good."""

    def __init__(self, decoder: Any, mode: str, where: str) -> None:
        self.decoder, self.name, self.where = decoder, mode, where
        self.cache = decoder.cache
        self._said: set[str] = set()

    def forward(self, hidden: Any, spans: Sequence[Span]) -> Any:
        from kafila.models.torch.static_decode import CaptureError

        if self.name != "eager" and self.decoder.takes(spans):
            try:
                return self.decoder.forward(hidden, spans)
            except CaptureError as exc:
                self.name = "eager"
                log.warning("decode_capture_failed", stage=self.where, error=str(exc), now="eager")
        elif self.name != "eager" and all(s.length == 1 for s in spans):
            self._once("decode_outside_buckets", rows=len(spans), largest=self.decoder.buckets[-1])
        return self.decoder.model.forward(hidden, spans, self.cache)

    def _once(self, event: str, **fields: Any) -> None:
        if event not in self._said:
            self._said.add(event)
            log.info(event, stage=self.where, path="eager", **fields)


def decode_path(model: Any, backend: Any, slots: int, mode: str = "auto", where: str = "") -> DecodePath:
    """The decode path of `model` (a stage's blocks, with `slots` KV-cache slots) in `mode`;
    "graph" where no CUDA card is, or for a model without torch blocks, is eager with a log event."""
    want = resolve_mode(mode, backend)
    if want == "eager":
        return EagerDecode(model, slots)
    if backend.name != "torch" or not getattr(model, "blocks", None):
        reason = "not a torch model" if backend.name != "torch" else "no blocks"
        log.info("decode_static_unavailable", stage=where, wanted=want, reason=reason, path="eager")
        return EagerDecode(model, slots)
    from kafila.models.torch import static_decode

    if want == "graph" and backend.device != "cuda":
        log.info("decode_graphs_unavailable", stage=where, reason=f"device {backend.device}", path="eager")
        return EagerDecode(model, slots)
    capture = static_decode.CudaGraphCapture(model.device) if want == "graph" else static_decode.run_eagerly
    return StaticDecode(static_decode.StaticDecoder(model, slots, capture), want, where)
