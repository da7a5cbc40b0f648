"""Backend choice and the wire conversion of hidden states."""

from __future__ import annotations

import numpy as np
import pytest

from kafila.engine import backend as backend_mod
from kafila.engine.backend import BackendError, checkpoint_dtype, resolve


def test_auto_is_torch_cpu_fp32_off_apple_silicon_without_cuda(monkeypatch) -> None:
    monkeypatch.setattr(backend_mod, "is_apple_silicon", lambda: False)
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    be = resolve("auto")
    assert (be.name, be.device, be.dtype) == ("torch", "cpu", "fp32")


def test_auto_picks_mlx_on_apple_silicon(monkeypatch) -> None:
    pytest.importorskip("mlx.core")
    monkeypatch.setattr(backend_mod, "is_apple_silicon", lambda: True)
    assert resolve("auto", "bf16").name == "mlx"


def test_auto_dtype_is_the_checkpoints_own_on_every_device() -> None:
    """A session's members (CPU, CUDA, Apple) must compute in one dtype: "auto" reads the
    checkpoint, never the device. A named dtype is taken as asked."""
    assert [checkpoint_dtype("auto", s) for s in ("F32", "BF16", "F16", "F64")] == [
        "fp32",
        "bf16",
        "fp16",
        "fp32",
    ]
    assert checkpoint_dtype("bf16", "F32") == "bf16" and checkpoint_dtype("float32", "BF16") == "fp32"
    with pytest.raises(BackendError, match="unknown dtype 'int4'"):
        checkpoint_dtype("int4", "F32")


def test_unknown_backend_and_dtype_are_named() -> None:
    with pytest.raises(BackendError, match="unknown backend 'tpu'"):
        resolve("tpu")
    with pytest.raises(BackendError, match="unknown dtype 'int4'"):
        resolve("torch", "int4")


@pytest.mark.parametrize("name", ["torch", "mlx"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp16"])
def test_hidden_states_round_trip_through_wire_bytes(name: str, dtype: str) -> None:
    if name == "mlx":
        pytest.importorskip("mlx.core")
    be = resolve(name, dtype)
    values = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    data = values.astype(np.float16).tobytes() if dtype == "fp16" else None
    if dtype == "fp32":
        data = values.tobytes()
    if dtype == "bf16":  # bf16 is the top half of fp32
        data = (values.view(np.uint32) >> 16).astype(np.uint16).tobytes()
    hidden = be.from_bytes(data, (3, 4))
    assert be.to_bytes(hidden) == data
    np.testing.assert_allclose(be.numpy(hidden), values, atol=0.02)


def test_torch_cpu_runs_as_many_threads_as_the_probe_measured_with() -> None:
    import torch

    from kafila.engine.backend import TorchBackend
    from kafila.engine.system import usable_cpus

    torch.set_num_threads(max(1, usable_cpus() * 2 + 1))
    backend = TorchBackend.create("fp32")
    if backend.device == "cpu":
        assert torch.get_num_threads() == usable_cpus()
