"""Which array library runs a stage, on which device, in which dtype.

`resolve("auto")` picks MLX on Apple Silicon (Metal), torch on CUDA when a GPU is present, else
torch on the CPU; `resolve("mlx")` also works on Linux through `mlx[cpu]`. A Backend turns
checkpoint bytes into arrays, builds the architecture's model class, and converts hidden states to
and from wire bytes. torch and MLX are imported only when a backend that needs them is resolved.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kafila.engine import DTYPES
from kafila.engine.system import usable_cpus

# user-facing dtype name -> safetensors/wire dtype name
_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
_STORED = {v: k for k, v in DTYPES.items()}  # "F32" -> "fp32"
# OpenMP threads sleep as soon as a parallel region ends instead of spinning. A member shares its
# machine (a laptop, other processes): spinning workers then steal the core the model thread needs
# between two matmuls, and a decode step measured 2-3x slower on a loaded 2-core machine. Export
# OMP_WAIT_POLICY=ACTIVE on a dedicated machine to keep spinning.
OMP_WAIT_POLICY = "PASSIVE"
# ...but not at once: a compiled decode step (kafila.models.torch.decode_cpu) opens five parallel
# regions per block, microseconds apart, and a worker that went to sleep after one must be woken
# for the next. Spinning 20000 rounds (tens of microseconds) first bridges those gaps and still
# sleeps between steps: measured fp32 decode 36.3 against 27.9 tok/s, bf16 47.8 against 44.7.
GOMP_SPINCOUNT = "20000"


def configure_openmp() -> None:
    """Set the OpenMP wait settings above unless the environment already has them. OpenMP reads
    them once, when torch or numba first loads it, so call this before either is imported."""
    os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)
    os.environ.setdefault("GOMP_SPINCOUNT", GOMP_SPINCOUNT)


# bf16 travels as raw uint16; I8/U8: packed weights (kafila.models.quant)
_NP = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "I8": np.int8, "U8": np.uint8}


class BackendError(ValueError):
    """A backend or dtype that this machine cannot provide; the message says why."""


def normalize_dtype(dtype: str) -> str:
    d = _ALIASES.get(dtype.lower(), dtype.lower())
    if d not in DTYPES:
        raise BackendError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    return d


def checkpoint_dtype(requested: str, stored: str) -> str:
    """The dtype a stage of a checkpoint stored in `stored` ("F32", "BF16", "F16") computes in:
    `requested` itself, or for "auto" the checkpoint's own precision ("BF16" -> "bf16", "F16" ->
    "fp16", anything else -> "fp32"). The answer depends on the checkpoint alone, not the device, so
    the members of a session (CPUs, CUDA cards, Apple GPUs) all compute and send hidden states in
    one dtype, and `kafila run` computes in the same one."""
    if requested != "auto":
        return normalize_dtype(requested)
    return _STORED.get(stored, "fp32")


def is_apple_silicon() -> bool:
    return platform.system() == "Darwin" and platform.machine() == "arm64"


def resolve(name: str = "auto", dtype: str = "auto") -> Backend:
    """A backend by name ("auto", "torch", "mlx") with a dtype ("auto", "fp32", "bf16", "fp16").
    dtype "auto" without a checkpoint (the device probe) is bf16 on a GPU (CUDA or Metal) and fp32
    on a CPU; a stage resolves "auto" from its checkpoint first (`checkpoint_dtype`)."""
    if name == "auto":
        name = "mlx" if is_apple_silicon() and importlib.util.find_spec("mlx") is not None else "torch"
    if name == "torch":
        return TorchBackend.create(dtype)
    if name == "mlx":
        return MlxBackend.create(dtype)
    raise BackendError(f"unknown backend {name!r}; choose auto, torch or mlx")


@dataclass(frozen=True)
class Backend:
    name: str  # "torch" | "mlx"
    device: str  # "cpu" | "cuda" | "gpu"
    dtype: str  # "fp32" | "bf16" | "fp16"

    @property
    def wire_dtype(self) -> str:
        """dtype of hidden states on the wire, as safetensors names it ("F32", "BF16", "F16")."""
        return DTYPES[self.dtype]

    def __str__(self) -> str:
        return f"{self.name}/{self.device}/{self.dtype}"

    # the array-library specific part, implemented below
    def model_class(self, model_type: str) -> Any:
        raise NotImplementedError

    def model_kwargs(self) -> dict[str, Any]:
        raise NotImplementedError

    def tensor(self, dtype: str, shape: Sequence[int], data: bytes) -> Any:
        """Checkpoint bytes (safetensors `dtype`, row-major) -> an array on this backend."""
        raise NotImplementedError

    def ids(self, token_ids: Sequence[int]) -> Any:
        raise NotImplementedError

    def numpy(self, array: Any) -> np.ndarray:
        """An array as float32 numpy (logits for the sampler)."""
        raise NotImplementedError

    def concat(self, arrays: Sequence[Any]) -> Any:
        raise NotImplementedError

    def to_bytes(self, hidden: Any) -> bytes:
        """Hidden states [T, H] -> raw row-major bytes in `wire_dtype`."""
        raise NotImplementedError

    def from_bytes(self, data: bytes, shape: Sequence[int]) -> Any:
        """Raw bytes in `wire_dtype` -> hidden states of `shape`."""
        raise NotImplementedError


def _np_view(dtype: str, shape: Sequence[int], data: bytes) -> np.ndarray:
    if dtype not in _NP:
        raise BackendError(f"tensor dtype {dtype} is not a float Kafila can run (F32, F16, BF16)")
    return np.frombuffer(data, dtype=_NP[dtype]).reshape(tuple(shape))


class TorchBackend(Backend):
    @classmethod
    def create(cls, dtype: str) -> TorchBackend:
        if importlib.util.find_spec("torch") is None:
            raise BackendError("backend torch: torch is not installed (pip install 'kafila[torch]')")
        if "torch" not in sys.modules:  # read by OpenMP once, when torch loads
            configure_openmp()
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
        if device == "cpu":  # as many threads as the probe measured with: affinity capped by a CFS quota
            torch.set_num_threads(usable_cpus())
            if "numba" not in sys.modules:  # the few-row kernel's pool, read once when numba loads
                os.environ.setdefault("NUMBA_NUM_THREADS", str(usable_cpus()))
        d = ("bf16" if device == "cuda" else "fp32") if dtype == "auto" else normalize_dtype(dtype)
        return cls("torch", device, d)

    @property
    def torch_dtype(self) -> Any:
        import torch

        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.dtype]

    def model_class(self, model_type: str) -> Any:
        from kafila.models.torch import llama, qwen3

        return {"llama": llama.LlamaModel, "qwen3": qwen3.Qwen3Model}[model_type]

    def model_kwargs(self) -> dict[str, Any]:
        return {"dtype": self.torch_dtype, "device": self.device}

    def tensor(self, dtype: str, shape: Sequence[int], data: bytes) -> Any:
        import torch

        kinds = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
        wanted = (kinds | {"I8": torch.int8, "U8": torch.uint8}).get(dtype)  # packed weights: I8, U8
        if wanted is None:
            raise BackendError(f"tensor dtype {dtype} is not one Kafila can run (F32, F16, BF16, I8, U8)")
        with warnings.catch_warnings():  # weights are never written: a read-only buffer is fine
            warnings.simplefilter("ignore", UserWarning)
            t = torch.frombuffer(data, dtype=wanted) if data else torch.empty(0, dtype=wanted)
        return t.reshape(tuple(shape))

    def ids(self, token_ids: Sequence[int]) -> Any:
        import torch

        return torch.tensor(list(token_ids), dtype=torch.long, device=self.device)

    def numpy(self, array: Any) -> np.ndarray:
        return array.detach().float().cpu().numpy()

    def concat(self, arrays: Sequence[Any]) -> Any:
        import torch

        return torch.cat(list(arrays)) if len(arrays) > 1 else arrays[0]

    def to_bytes(self, hidden: Any) -> bytes:
        import torch

        h = hidden.detach().to(self.torch_dtype).contiguous().cpu()
        return h.view(torch.uint8).numpy().tobytes() if h.numel() else b""

    def from_bytes(self, data: bytes, shape: Sequence[int]) -> Any:
        return self.tensor(self.wire_dtype, shape, data).to(self.device, copy=True)


class MlxBackend(Backend):
    @classmethod
    def create(cls, dtype: str) -> MlxBackend:
        if importlib.util.find_spec("mlx") is None:
            raise BackendError("backend mlx: mlx is not installed (pip install 'kafila[mlx]')")
        try:
            import mlx.core as mx
        except (ImportError, OSError) as exc:  # plain `mlx` on Linux lacks libmlx.so
            raise BackendError(
                f"backend mlx: cannot import mlx ({exc}); on Linux install 'mlx[cpu]'"
            ) from exc
        device = "gpu" if mx.default_device() == mx.gpu else "cpu"
        d = ("bf16" if device == "gpu" else "fp32") if dtype == "auto" else normalize_dtype(dtype)
        return cls("mlx", device, d)

    @property
    def mx_dtype(self) -> Any:
        import mlx.core as mx

        return {"fp32": mx.float32, "bf16": mx.bfloat16, "fp16": mx.float16}[self.dtype]

    def model_class(self, model_type: str) -> Any:
        from kafila.models.mlx import llama, qwen3

        return {"llama": llama.LlamaModel, "qwen3": qwen3.Qwen3Model}[model_type]

    def model_kwargs(self) -> dict[str, Any]:
        return {"dtype": self.mx_dtype}

    def tensor(self, dtype: str, shape: Sequence[int], data: bytes) -> Any:
        import mlx.core as mx

        arr = mx.array(_np_view(dtype, shape, data))
        return arr.view(mx.bfloat16) if dtype == "BF16" else arr

    def ids(self, token_ids: Sequence[int]) -> Any:
        import mlx.core as mx

        return mx.array(list(token_ids), dtype=mx.int32)

    def numpy(self, array: Any) -> np.ndarray:
        import mlx.core as mx

        return np.array(array.astype(mx.float32))

    def concat(self, arrays: Sequence[Any]) -> Any:
        import mlx.core as mx

        return mx.concatenate(list(arrays)) if len(arrays) > 1 else arrays[0]

    def to_bytes(self, hidden: Any) -> bytes:
        import mlx.core as mx

        h = hidden.astype(self.mx_dtype)
        if self.dtype == "bf16":
            h = h.view(mx.uint16)
        return np.array(h).tobytes()

    def from_bytes(self, data: bytes, shape: Sequence[int]) -> Any:
        return self.tensor(self.wire_dtype, shape, data)
