"""Reference checks shared by the torch and MLX model tests: transformers is the oracle.

`check_against_transformers(path, backend)` runs a prompt through a Stage holding the whole model
(prefill in two chunks, then single-token decode steps) and compares every position's logits with
transformers' in fp32, then generates 32 greedy tokens and checks each is transformers' argmax.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import transformers

from kafila.engine.generate import generate
from kafila.engine.sampler import SamplingParams
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint

PROMPT = [1, 17, 200, 33, 5, 250, 64, 7, 99, 128, 3, 42, 11]


def reference_logits(path: Path, ids: list[int]) -> np.ndarray:
    """transformers' logits [T, V] in fp32 for a whole sequence."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def engine_logits(stage: Stage, ids: list[int], prefill: int) -> np.ndarray:
    """Our logits [T, V]: ids[:prefill] in two chunks, then one token per step."""
    stage.open("ref")
    half = prefill // 2
    rows = [stage.forward([("ref", 0, stage.embed(ids[:half]))])[0]]
    rows += stage.forward([("ref", half, stage.embed(ids[half:prefill]))])
    for pos in range(prefill, len(ids)):
        rows += stage.forward([("ref", pos, stage.embed([ids[pos]]))])
    stage.close("ref")
    return np.concatenate([stage.logits(r) for r in rows])


def check_against_transformers(path: Path, backend: str) -> None:
    ckpt = Checkpoint.open(path)
    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, backend=backend, dtype="fp32", context=64)
    ours = engine_logits(stage, PROMPT, prefill=9)
    tokens = list(generate(stage, PROMPT, SamplingParams(max_tokens=32)))
    assert len(tokens) == 32
    ref = reference_logits(path, PROMPT + tokens[:-1])  # one forward checks both
    assert np.abs(ref).max() > 1.0  # unit-scale logits, so 1e-4 is a real bound
    np.testing.assert_allclose(ours, ref[: len(PROMPT)], rtol=0, atol=1e-4)
    assert tokens == ref[len(PROMPT) - 1 :].argmax(-1).tolist()  # each greedy token is transformers' argmax
