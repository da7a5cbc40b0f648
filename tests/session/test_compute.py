"""The model thread's step functions on wire frames (kafila.session.compute)."""

from __future__ import annotations

import numpy as np
import pytest

from kafila.engine.stage import Stage, StageError
from kafila.models.checkpoint import Checkpoint
from kafila.proto import tensor as t
from kafila.session import compute


@pytest.fixture(scope="module")
def head(tiny_checkpoint) -> Stage:
    ckpt = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))
    return Stage.load(ckpt, range(0, 2), True, backend="torch", dtype="fp32", context=32)


def frame(dtype: t.DType, rows: int, hidden: int) -> t.Hidden:
    data = np.zeros((rows, hidden), np.float32 if dtype is t.DType.F32 else np.uint16).tobytes()
    return t.Hidden(0, dtype, (rows, hidden), (t.Entry(7, 0, rows),), data, 0, (10,))


def test_a_returning_frame_in_another_dtype_is_refused_at_the_head(head: Stage) -> None:
    """What the last member sends back reaches the head's logits: bf16 bytes read as fp32 would
    be half a row of wrong numbers, so both step functions refuse them by name."""
    hidden = head.model.config.hidden_size
    logits, _ = compute.head_logits(head, frame(t.DType.F32, 3, hidden), [7])
    assert logits.shape == (1, head.model.config.vocab_size)
    with pytest.raises(StageError, match=r"\[0, 2\) computes in F32 but received hidden states in BF16"):
        compute.head_logits(head, frame(t.DType.BF16, 3, hidden), [7])
    with pytest.raises(StageError, match="computes in F32 but received hidden states in BF16"):
        compute.stage_step(head, [frame(t.DType.BF16, 3, hidden)])
