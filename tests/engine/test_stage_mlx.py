"""The same Stage on MLX (mlx[cpu] on Linux): splits chain exactly, batched decode = one by one."""

from __future__ import annotations

import numpy as np
import pytest

from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from tests.engine.test_stage import PROMPT, _decode_run

mx = pytest.importorskip("mlx.core", reason="mlx is not installed (pip install 'kafila[mlx]')")


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("qwen3-gqa2-untied"))


def _load(ckpt: Checkpoint, blocks: range, head: bool, concurrency: int = 1) -> Stage:
    return Stage.load(ckpt, blocks, head, backend="mlx", dtype="fp32", context=32, concurrency=concurrency)


def test_mlx_stages_chained_through_bytes_give_the_full_models_logits(ckpt: Checkpoint) -> None:
    full = _decode_run([_load(ckpt, range(5), True)])
    split = [_load(ckpt, range(0, 2), True), _load(ckpt, range(2, 5), False)]
    for ours, want in zip(_decode_run(split, wire=True), full, strict=True):
        np.testing.assert_array_equal(ours, want)


def test_mlx_batched_decode_equals_one_by_one(ckpt: Checkpoint) -> None:
    prompts = {"a": PROMPT[:3], "b": PROMPT}
    stage = _load(ckpt, range(5), True, concurrency=2)
    alone = {}
    for rid, ids in prompts.items():
        stage.open(rid)
        stage.forward([(rid, 0, stage.embed(ids))])
        [h] = stage.forward([(rid, len(ids), stage.embed([42]))])
        alone[rid] = stage.logits(h[-1])
        stage.close(rid)
        stage.open(rid)
        stage.forward([(rid, 0, stage.embed(ids))])
    out = stage.forward([(rid, len(ids), stage.embed([42])) for rid, ids in prompts.items()])
    logits = stage.logits(mx.concatenate([h[-1:] for h in out]))
    for row, rid in zip(logits, prompts, strict=True):
        np.testing.assert_allclose(row, alone[rid], rtol=0, atol=1e-4)
