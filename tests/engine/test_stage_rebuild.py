"""Stage.rebuild: a stage moved to a new block range keeps the blocks (and head) it holds, reads
only the others, and computes exactly what a stage freshly loaded for that range computes."""

from __future__ import annotations

import numpy as np
import pytest

from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from tests.engine.test_stage import _decode_run as _run  # prefill, then greedy steps: logits


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))


def _load(ckpt: Checkpoint, blocks: range, head: bool, quant: str = "none") -> Stage:
    return Stage.load(ckpt, blocks, head, backend="torch", dtype="fp32", context=32, quant=quant)


def _rebuild(old: Stage, ckpt: Checkpoint, blocks: range, head: bool, quant: str = "none") -> Stage:
    return old.rebuild(ckpt, blocks, head, context=32, concurrency=1, quant=quant)


def _block_bytes(ckpt: Checkpoint, blocks: range) -> int:
    return sum(ckpt.manifest().block_bytes[blocks.start : blocks.stop])


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_rebuilt_member_stage_equals_a_fresh_one_and_reads_only_the_block_it_lacks(
    ckpt: Checkpoint, quant: str
) -> None:
    old = _load(ckpt, range(2, 5), False, quant)  # blocks 2, 3, 4
    old.open("x")  # a request of the old epoch: the new stage's cache starts empty anyway
    before = ckpt.bytes_read
    new = _rebuild(old, ckpt, range(1, 3), False, quant)  # keeps 2, reads 1, drops 3 and 4
    assert new.bytes_loaded == ckpt.bytes_read - before == _block_bytes(ckpt, range(1, 2))
    assert new.model.blocks[1] is old.model.blocks[0]  # block 2 moved, not read again
    assert new.open_requests == [] and new.blocks == range(1, 3)
    head, tail = _load(ckpt, range(0, 1), True, quant), _load(ckpt, range(3, 5), False, quant)
    fresh = _load(ckpt, range(1, 3), False, quant)
    for ours, want in zip(_run([head, new, tail]), _run([head, fresh, tail]), strict=True):
        assert np.array_equal(ours, want)


@pytest.mark.parametrize("quant", ["none", "int8"])
def test_rebuilt_head_stage_keeps_its_head_and_reads_only_new_blocks(ckpt: Checkpoint, quant: str) -> None:
    old = _load(ckpt, range(0, 2), True, quant)
    before = ckpt.bytes_read
    new = _rebuild(old, ckpt, range(0, 4), True, quant)  # a lost member's blocks 2, 3 come here
    assert new.bytes_loaded == ckpt.bytes_read - before == _block_bytes(ckpt, range(2, 4))
    assert new.model.embed_w is old.model.embed_w
    assert all(a is b for a, b in zip(new.model.blocks[:2], old.model.blocks, strict=True))
    tail = _load(ckpt, range(4, 5), False, quant)
    fresh = _load(ckpt, range(0, 4), True, quant)
    for ours, want in zip(_run([new, tail]), _run([fresh, tail]), strict=True):
        assert np.array_equal(ours, want)


def test_shrinking_a_head_stage_reads_nothing(ckpt: Checkpoint) -> None:
    old = _load(ckpt, range(0, 3), True)
    before = ckpt.bytes_read
    new = _rebuild(old, ckpt, range(0, 1), True)
    assert new.bytes_loaded == 0 and ckpt.bytes_read == before
    assert len(new.model.blocks) == 1 and new.kv_bytes * 3 == old.kv_bytes  # a cache for one block


def test_a_rebuild_in_another_weight_format_reads_every_tensor(ckpt: Checkpoint) -> None:
    old = _load(ckpt, range(2, 5), False, "none")
    new = _rebuild(old, ckpt, range(2, 4), False, "int8")  # float blocks cannot serve as int8
    assert new.bytes_loaded == _block_bytes(ckpt, range(2, 4))
    assert new.model.blocks[0] is not old.model.blocks[0]
    head, tail = _load(ckpt, range(0, 2), True, "int8"), _load(ckpt, range(4, 5), False, "int8")
    fresh = _load(ckpt, range(2, 4), False, "int8")
    for ours, want in zip(_run([head, new, tail]), _run([head, fresh, tail]), strict=True):
        assert np.array_equal(ours, want)
