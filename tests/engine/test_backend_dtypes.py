"""Every dtype on every backend, from fp32 and bf16 checkpoints: it runs, and strays from fp32 no
more than transformers does in the same dtype."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch
import transformers

from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint

BACKENDS = ["torch"] + (["mlx"] if importlib.util.find_spec("mlx") else [])
PROMPT = [1, 9, 40, 7, 200, 13]
NEXT = 5


def _logits(ckpt: Checkpoint, backend: str, dtype: str) -> np.ndarray:
    """[2, V]: after the prompt (prefill), then after one decode step."""
    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, backend=backend, dtype=dtype, context=16)
    stage.open("r")
    [h] = stage.forward([("r", 0, stage.embed(PROMPT))])
    [h2] = stage.forward([("r", len(PROMPT), stage.embed([NEXT]))])
    return np.stack([stage.logits(h[-1]), stage.logits(h2[-1])])


def _transformers(ckpt: Checkpoint, dtype: str) -> np.ndarray:
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt.path, dtype=torch_dtype).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[*PROMPT, NEXT]])).logits[0, -2:]
    return logits.float().numpy()


@pytest.mark.parametrize("stored", ["float32", "bfloat16"])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_half_dtypes_stray_from_fp32_no_more_than_transformers(
    tiny_checkpoint, stored: str, dtype: str
) -> None:
    ckpt = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied", dtype=stored))
    ref = _transformers(ckpt, "fp32")
    theirs = np.abs(_transformers(ckpt, dtype) - ref).max()
    assert 0 < theirs < 0.5  # logits are of unit scale; half precision moves them a little
    for backend in BACKENDS:
        ours = np.abs(_logits(ckpt, backend, dtype) - ref).max()
        assert ours <= 2 * theirs, f"{backend} {dtype}: {ours:.4f} vs transformers {theirs:.4f}"
