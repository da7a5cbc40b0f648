"""The probe's workloads on one array library (torch CPU/CUDA or MLX): each `make_*` allocates
what it needs and returns a zero-argument callable that runs once and waits for the device.

torch and MLX are imported inside the methods, so importing this module is cheap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from kafila.engine.captured import decode_path
from kafila.models.config import ModelConfig
from kafila.models.manifest import (
    GROUP,
    LM_HEAD,
    MINS,
    TensorSpec,
    block_index,
    linear_format,
    packed_specs,
    priced,
    specs_from_config,
)
from kafila.models.span import Span

Run = Callable[[], object]
TINY = 64  # width of the dispatch-overhead chain: it reads a few KB, far below any cache


@dataclass(frozen=True)
class Ops:
    backend: Any  # kafila.engine.backend.Backend
    quant: str = "none"  # the session's weight format: the synthetic blocks and head are packed in it

    def _model_kwargs(self, config: ModelConfig) -> dict[str, Any]:
        """The model's keyword arguments: the backend's, and the weight format where it applies
        (every matrix's inputs in groups of 32; the dispatch chain's tiny widths may not be)."""
        kwargs: dict[str, Any] = self.backend.model_kwargs()
        if self.quant != "none" and _groups_fit(config):
            kwargs["quant"] = self.quant
        return kwargs

    @property
    def is_torch(self) -> bool:
        return self.backend.name == "torch"

    # -- array helpers --------------------------------------------------------------------------

    def _zeros(self, shape: tuple[int, ...]) -> Any:
        if self.is_torch:
            import torch

            return torch.zeros(shape, dtype=self.backend.torch_dtype, device=self.backend.device)
        import mlx.core as mx

        a = mx.zeros(shape, dtype=self.backend.mx_dtype)
        mx.eval(a)
        return a

    def _random(self, shape: tuple[int, ...], scale: float) -> Any:
        if self.is_torch:
            import torch

            t = torch.empty(shape, dtype=self.backend.torch_dtype, device=self.backend.device)
            return t.uniform_(-scale, scale)
        import mlx.core as mx

        a = mx.random.uniform(-scale, scale, shape).astype(self.backend.mx_dtype)
        mx.eval(a)
        return a

    def _done(self, value: Any) -> Any:
        """Wait for the device: a CUDA sync, an MLX eval; torch CPU is synchronous."""
        if self.is_torch:
            if self.backend.device == "cuda":
                import torch

                torch.cuda.synchronize()
            return value
        import mlx.core as mx

        mx.eval(value)
        return value

    def element_size(self) -> int:
        return {"fp32": 4, "bf16": 2, "fp16": 2}[self.backend.dtype]

    # -- workloads ------------------------------------------------------------------------------

    def make_buffer(self, nbytes: int, width: int = 4096) -> Any:
        """A [rows, width] matrix of about `nbytes` (zeros: no denormals, values do not matter)."""
        return self._zeros((max(1, nbytes // self.element_size() // width), width))

    def nbytes(self, buf: Any) -> int:
        return int(buf.shape[0] * buf.shape[1] * self.element_size())

    def make_stream(self, buf: Any) -> Run:
        """A reduction over the whole buffer: every byte is read once per call."""
        return lambda: self._done(buf.sum())

    def make_matvec(self, buf: Any) -> Run:
        """A decode-shaped matrix-vector product streaming the same buffer once per call."""
        x = self._random((1, buf.shape[1]), 1.0)
        if self.is_torch:
            import torch.nn.functional as F

            return lambda: self._done(F.linear(x, buf))
        return lambda: self._done(x @ buf.T)

    def make_dispatch(self) -> Run:
        """A tiny op chain that reads ~nothing, ending in a host read as a decode step does:
        embedding row, norm, projection, activation, residual, softmax, argmax -> host."""
        table, proj = self._random((256, TINY), 1.0), self._random((TINY, TINY), 0.1)
        norm = self._random((TINY,), 1.0)
        if self.is_torch:
            import torch
            import torch.nn.functional as F

            ids = torch.tensor([7], device=self.backend.device)

            def run_torch() -> int:
                h = F.embedding(ids, table)  # [1, TINY]
                h = F.rms_norm(h, (TINY,), norm, 1e-6)
                h = h + F.silu(F.linear(h, proj))
                return int(torch.softmax(h.float(), dim=-1).argmax())

            return run_torch
        import mlx.core as mx

        rows = mx.array([7])

        def run_mlx() -> int:
            h = table[rows]  # [1, TINY]
            h = mx.fast.rms_norm(h, norm, 1e-6)
            z = h @ proj.T
            h = h + z * mx.sigmoid(z)
            token = mx.argmax(mx.softmax(h.astype(mx.float32), axis=-1)).item()  # an unsigned index
            assert isinstance(token, int)
            return token

        return run_mlx

    def make_matmul(self, n: int) -> tuple[Run, float]:
        """An n x n matmul: 2 n^3 floating-point operations per call."""
        a, b = self._random((n, n), 1.0), self._random((n, n), 1.0)
        return (lambda: self._done(a @ b)), 2.0 * n**3

    def make_block(self, config: ModelConfig, position: int, blocks: int = 2) -> Run:
        """A stage's decode step (one token) through `blocks` distinct transformer blocks with this
        model's shapes and random weights, in one call of the engine's own model code, as a ring
        member runs its stage (`block_bytes` says what one block weighs)."""
        cls = self.backend.model_class(config.model_type)
        specs = specs_from_config(replace(config, num_hidden_layers=blocks), "F32")
        weights = self._weights([s for s in specs if block_index(s.name) is not None], config)
        model = cls(config, weights, range(blocks), False, context=position + 1, **self._model_kwargs(config))
        path = decode_path(model, self.backend, 1, where="probe")  # what a stage runs: a CUDA graph on a card
        x = self._random((1, config.hidden_size), 1.0)  # [1, H]
        span = [Span(slot=0, start=position, length=1)]
        return lambda: self._done(path.forward(x, span))  # -> [1, H]

    def block_bytes(self, config: ModelConfig) -> int:
        """Weight bytes of one transformer block of this model in this backend's dtype and the
        session's weight format (kafila.models.manifest.priced: what the model holds)."""
        specs = [s for s in specs_from_config(config, "F32") if block_index(s.name) == 0]
        dtype = {4: "F32", 2: "BF16"}.get(self.element_size(), "F32")
        quant = self.quant if _groups_fit(config) else "none"
        return sum(priced(specs, dtype, quant).values())

    def make_head(self, config: ModelConfig) -> tuple[Run, int]:
        """The head's share of a decode step: final norm and unembedding of one row ([1, H] ->
        logits [1, V]) with this model's vocabulary, random weights, the engine's own code.
        Returns (run, bytes the unembedding reads)."""
        specs = [s for s in specs_from_config(config, "F32") if block_index(s.name) is None]
        weights = self.head_weights(config)
        cls = self.backend.model_class(config.model_type)
        model = cls(config, weights, range(0, 0), True, context=1, **self._model_kwargs(config))
        x = self._random((1, config.hidden_size), 1.0)  # [1, H]
        nbytes = config.vocab_size * config.hidden_size * self.element_size()
        if "quant" in self._model_kwargs(config):  # the unembedding is int8 in a packed session
            sizes = priced([s for s in specs if s.name != "model.norm.weight"], None, self.quant)
            nbytes = sizes["model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"]
        return (lambda: self._done(model.logits(x))), nbytes

    def head_weights(self, config: ModelConfig) -> dict[str, Any]:
        """Random weights for the head's decode step: the final norm and one [V, H] matrix, named
        as the embedding so the model takes it as tied. An untied model's embedding is not read by
        that step (one row of it per token), so it is not allocated: at Qwen3-8B's widths each of
        the two matrices is 1.24 GB in bf16, and both at once killed a member capped at 2.77 GB in
        its probe."""
        specs = [s for s in specs_from_config(config, "F32") if block_index(s.name) is None]
        return self._weights([s for s in specs if s.name != LM_HEAD], config)

    def _weights(self, specs: list[TensorSpec], config: ModelConfig) -> dict[str, Any]:
        """Random weights for `specs`: floats, or in a packed session each matrix made packed
        (its packed entries drawn directly: never a float copy of it, which for Qwen3-8B's
        unembedding in fp32 is 2.5 GB)."""
        quant = self._model_kwargs(config).get("quant", "none")
        out: dict[str, Any] = {}
        for s in specs:
            fmt = linear_format(s.name, quant) if len(s.shape) == 2 else "none"
            if fmt == "none":
                out[s.name] = self._random(s.shape, 0.02)
                continue
            for entry in packed_specs(s.name, fmt, s.shape):
                out[entry.name] = self._packed_random(entry)
        return out

    def _packed_random(self, spec: TensorSpec) -> Any:
        """A packed entry (torch): random levels, or scales and minimums small enough that the
        products stay far from overflow and denormals."""
        import torch

        device = self.backend.device
        if spec.dtype == "I8":
            return torch.randint(-127, 128, spec.shape, dtype=torch.int8, device=device)
        if spec.dtype == "U8":
            return torch.randint(0, 256, spec.shape, dtype=torch.uint8, device=device)
        fill = -0.008 if spec.name.endswith(MINS) else 0.001
        return torch.full(spec.shape, fill, dtype=torch.float16, device=device)

    def make_block_dispatch(self, config: ModelConfig, position: int) -> tuple[Run, int]:
        """One decode step through one block of this model's architecture at tiny shapes (hidden
        width 64, one KV head of width 16, the model's query/KV head ratio), run by the engine's own
        model code: the same op chain as a real block, reading a few KB, so its time is what the
        chain costs to dispatch, which bytes / bandwidth does not see. Returns (run, blocks per call)."""
        blocks = 2
        return self.make_block(tiny_shapes(config), position, blocks), blocks

    def memory_available(self) -> int | None:
        """Device memory free for weights (CUDA free memory; MLX's recommended working set); None
        on a CPU, where system RAM is read instead."""
        if self.is_torch and self.backend.device == "cuda":
            import torch

            return int(torch.cuda.mem_get_info()[0])
        if not self.is_torch and self.backend.device == "gpu":
            import mlx.core as mx

            info = mx.device_info()
            return int(info.get("max_recommended_working_set_size") or info.get("memory_size") or 0) or None
        return None


def _groups_fit(config: ModelConfig) -> bool:
    """Whether every matrix of this config has its inputs in groups of 32 (packable)."""
    widths = (config.hidden_size, config.num_attention_heads * config.head_dim, config.intermediate_size)
    return all(w % GROUP == 0 for w in widths)


def tiny_shapes(config: ModelConfig) -> ModelConfig:
    """`config` with the same architecture and flags but widths small enough that a block's weights
    (~50 KB) cost nothing to read: what is left of a decode step is dispatch."""
    ratio = max(1, config.num_attention_heads // max(1, config.num_key_value_heads))
    head_dim = 16
    return replace(
        config,
        hidden_size=TINY,
        num_attention_heads=ratio,
        num_key_value_heads=1,
        head_dim=head_dim,
        intermediate_size=2 * TINY,
        num_hidden_layers=1,
    )
