"""The fused CPU decode step (kafila.models.torch.decode_cpu) against the torch block code.

Two stages of the same tiny model, one taking the fused path and one forced onto torch's ops,
prefill three requests of different lengths and then decode them together at different positions
(and in a batch of one): the hidden states agree to 1e-5 of their scale at every step, and a
request decodes bit-identically alone or batched on the fused path.
"""

from __future__ import annotations

import numpy as np
import pytest

from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from tests.tiny_models import SHAPES

PROMPTS = {"a": [5, 17, 200, 33], "b": [9, 1, 250, 64, 7, 99, 128], "c": [42]}


def _stage(path, fused: bool) -> Stage:
    ckpt = Checkpoint.open(path)
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend="torch", dtype="fp32", context=32, concurrency=3
    )
    assert stage.model.fused_decode  # fp32 on the CPU takes the fused path by default
    stage.model.fused_decode = fused
    return stage


def _decode(stage: Stage, steps: int, together: bool) -> dict[str, list[np.ndarray]]:
    """Prefill every prompt, then `steps` greedy decode steps; hidden rows per request per step."""
    out: dict[str, list[np.ndarray]] = {rid: [] for rid in PROMPTS}
    last, pos = {}, {}
    for rid, prompt in PROMPTS.items():
        stage.open(rid)
        [h] = stage.forward([(rid, 0, stage.embed(prompt))])
        last[rid], pos[rid] = int(stage.logits(h[-1:]).argmax()), len(prompt)
    for _ in range(steps):
        groups = [list(PROMPTS)] if together else [[rid] for rid in PROMPTS]
        for group in groups:
            hidden = stage.forward([(rid, pos[rid], stage.embed([last[rid]])) for rid in group])
            for rid, h in zip(group, hidden, strict=True):
                out[rid].append(np.asarray(h).copy())
                last[rid], pos[rid] = int(stage.logits(h).argmax()), pos[rid] + 1
    for rid in PROMPTS:
        stage.close(rid)
    return out


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_fused_decode_matches_the_torch_block_code(tiny_checkpoint, shape: str) -> None:
    path = tiny_checkpoint(shape)
    fused = _decode(_stage(path, fused=True), steps=6, together=True)
    torch_ops = _decode(_stage(path, fused=False), steps=6, together=True)
    for rid in PROMPTS:
        for ours, ref in zip(fused[rid], torch_ops[rid], strict=True):
            scale = np.abs(ref).max()  # hidden states grow through the blocks (here up to ~30)
            assert scale > 0.1
            np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * scale)


def test_fused_decode_is_bit_identical_alone_or_batched(tiny_checkpoint) -> None:
    path = tiny_checkpoint("qwen3-gqa2-untied")
    batched = _decode(_stage(path, fused=True), steps=5, together=True)
    alone = _decode(_stage(path, fused=True), steps=5, together=False)
    for rid in PROMPTS:
        for a, b in zip(batched[rid], alone[rid], strict=True):
            assert np.array_equal(a, b)
