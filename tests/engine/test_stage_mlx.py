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


def _mixed_run(ckpt: Checkpoint, dtype: str, head_on: str, rest_on: str, steps: int = 6) -> list[np.ndarray]:
    """A head stage on one backend and the remaining blocks on another, exchanging hidden states
    only as wire bytes (as two members of a session do): every step's logits."""
    head = Stage.load(ckpt, range(0, 2), True, backend=head_on, dtype=dtype, context=32)
    rest = Stage.load(ckpt, range(2, 5), False, backend=rest_on, dtype=dtype, context=32)
    for s in (head, rest):
        s.open("r")

    def step(start: int, ids: list[int]) -> np.ndarray:
        [h] = head.forward([("r", start, head.embed(ids))])  # [T, H] on the head's backend
        shape = (len(ids), ckpt.config.hidden_size)
        [h] = rest.forward([("r", start, rest.from_bytes(head.to_bytes(h), shape))])
        back = head.from_bytes(rest.to_bytes(h), shape)  # the last stage's output returns to the head
        return np.asarray(head.logits(back[-1]), dtype=np.float32)

    out = [step(0, PROMPT[:4]), step(4, PROMPT[4:])]
    for pos in range(len(PROMPT), len(PROMPT) + steps):
        out.append(step(pos, [int(out[-1].argmax())]))
    return out


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_torch_and_mlx_members_exchange_hidden_states_as_bytes(ckpt: Checkpoint, dtype: str) -> None:
    """An Apple member (MLX) next to a CPU or CUDA member (torch): the bytes one backend sends, the
    other reads as the same numbers in the session's dtype, so the mixed ring decodes as a ring of
    either backend alone (different kernels: within rounding, and the same greedy tokens)."""
    torch_only = _mixed_run(ckpt, dtype, "torch", "torch")
    tol = 1e-4 if dtype == "fp32" else 0.05
    for head_on, rest_on in (("torch", "mlx"), ("mlx", "torch")):
        mixed = _mixed_run(ckpt, dtype, head_on, rest_on)
        for ours, want in zip(mixed, torch_only, strict=True):
            np.testing.assert_allclose(ours, want, rtol=0, atol=tol * float(np.abs(want).max()))
            assert ours.argmax() == want.argmax()


def test_mlx_rebuilt_stage_keeps_held_blocks_and_equals_a_fresh_one(ckpt: Checkpoint) -> None:
    old = _load(ckpt, range(0, 3), True)  # head + blocks 0, 1, 2
    before = ckpt.bytes_read
    new = old.rebuild(ckpt, range(0, 4), True, context=32, concurrency=1)  # keeps head, 0-2; reads 3
    assert new.bytes_loaded == ckpt.bytes_read - before == ckpt.manifest().block_bytes[3]
    assert (
        all(a is b for a, b in zip(new.model.blocks[:3], old.model.blocks, strict=True))
        and new.model.embed_w is old.model.embed_w
    )
    tail = _load(ckpt, range(4, 5), False)
    for ours, want in zip(
        _decode_run([new, tail]), _decode_run([_load(ckpt, range(0, 4), True), tail]), strict=True
    ):
        assert np.array_equal(ours, want)
