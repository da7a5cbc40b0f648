"""Stage: exact splits, batched steps, KV-cache slots, byte-counted loading, clear errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kafila.engine.stage import ContextFullError, SlotsFullError, Stage, StageError
from kafila.models.checkpoint import Checkpoint

PROMPT = [5, 9, 1, 77, 120, 3, 64, 18, 250, 31, 8]
SPLITS = {
    1: [(0, 5)],
    2: [(0, 3), (3, 5)],
    3: [(0, 1), (1, 4), (4, 5)],
    5: [(0, 1), (1, 2), (2, 3), (3, 4), (4, 5)],
}


def _chain(stages: list[Stage], rid: str, start: int, ids: list[int], wire: bool) -> np.ndarray:
    """One step through a chain of stages (first one is the head); logits of the last row."""
    head = stages[0]
    h = head.embed(ids)
    for s in stages:
        if wire:  # what a ring link carries: raw bytes in the wire dtype
            h = s.from_bytes(head.to_bytes(h), tuple(h.shape))
        [h] = s.forward([(rid, start, h)])
    return head.logits(h[-1])


def _decode_run(stages: list[Stage], wire: bool = False, steps: int = 6) -> list[np.ndarray]:
    """Prefill PROMPT in two chunks, then `steps` greedy decode steps; every step's logits."""
    for s in stages:
        s.open("r")
    out = [_chain(stages, "r", 0, PROMPT[:4], wire), _chain(stages, "r", 4, PROMPT[4:], wire)]
    pos = len(PROMPT)
    for _ in range(steps):
        out.append(_chain(stages, "r", pos, [int(out[-1].argmax())], wire))
        pos += 1
    for s in stages:
        s.close("r")
    return out


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))


def _load(ckpt: Checkpoint, blocks: range, head: bool, **kw) -> Stage:
    return Stage.load(ckpt, blocks, head, backend="torch", dtype=kw.pop("dtype", "fp32"), context=32, **kw)


@pytest.mark.parametrize("n_stages", sorted(SPLITS))
@pytest.mark.parametrize("wire", [False, True], ids=["arrays", "bytes"])
def test_chained_stages_give_exactly_the_full_models_logits(
    ckpt: Checkpoint, n_stages: int, wire: bool
) -> None:
    full = _decode_run([_load(ckpt, range(5), True)])
    split = [_load(ckpt, range(a, b), i == 0) for i, (a, b) in enumerate(SPLITS[n_stages])]
    for ours, want in zip(_decode_run(split, wire), full, strict=True):
        assert np.array_equal(ours, want)


def test_stage_reads_exactly_its_tensors_bytes(ckpt: Checkpoint) -> None:
    before = ckpt.bytes_read
    stage = _load(ckpt, range(1, 3), False)
    names = ckpt.names_for(range(1, 3), False)
    assert stage.bytes_loaded == sum(ckpt.tensors[n].nbytes for n in names)
    assert ckpt.bytes_read - before == stage.bytes_loaded
    assert stage.bytes_loaded == sum(ckpt.manifest().block_bytes[1:3])


def test_head_stage_of_an_untied_model_reads_each_tensor_once(tiny_checkpoint) -> None:
    untied = Checkpoint.open(tiny_checkpoint("llama-mha-untied"))
    stage = _load(untied, range(0, 2), True)
    names = untied.names_for(range(0, 2), True)
    assert "lm_head.weight" in names
    assert stage.bytes_loaded == untied.bytes_read == sum(untied.tensors[n].nbytes for n in names)


def test_batched_decode_at_different_positions_equals_one_by_one(ckpt: Checkpoint) -> None:
    prompts = {"a": PROMPT[:3], "b": PROMPT, "c": PROMPT[2:9]}
    alone: dict[str, np.ndarray] = {}
    solo = _load(ckpt, range(5), True)
    for rid, ids in prompts.items():
        solo.open(rid)
        solo.forward([(rid, 0, solo.embed(ids))])
        [h] = solo.forward([(rid, len(ids), solo.embed([42]))])
        alone[rid] = solo.logits(h[-1])
        solo.close(rid)

    batch = _load(ckpt, range(5), True, concurrency=3)
    for rid in prompts:  # then prefill of all three in one mixed step
        batch.open(rid)
    batch.forward([(rid, 0, batch.embed(ids)) for rid, ids in prompts.items()])
    items = [(rid, len(ids), batch.embed([42])) for rid, ids in prompts.items()]
    out = batch.forward(items)  # three decode steps at positions 3, 11, 7 as one computation
    logits = batch.logits(torch.cat([h[-1:] for h in out]))
    for row, rid in zip(logits, prompts, strict=True):
        np.testing.assert_allclose(row, alone[rid], rtol=0, atol=1e-4)
        assert row.argmax() == alone[rid].argmax()


def test_prefill_chunk_and_decode_mix_in_one_step(ckpt: Checkpoint) -> None:
    stage = _load(ckpt, range(5), True, concurrency=2)
    stage.open("old")
    stage.forward([("old", 0, stage.embed(PROMPT))])
    stage.open("new")
    out = stage.forward([("old", len(PROMPT), stage.embed([7])), ("new", 0, stage.embed(PROMPT[:6]))])
    ref = _load(ckpt, range(5), True)
    ref.open("new")
    [want] = ref.forward([("new", 0, ref.embed(PROMPT[:6]))])
    np.testing.assert_allclose(stage.logits(out[1][-1]), ref.logits(want[-1]), rtol=0, atol=1e-4)
    assert stage.length("old") == len(PROMPT) + 1 and stage.length("new") == 6


def test_closed_slot_is_reused_and_full_slots_are_refused(ckpt: Checkpoint) -> None:
    stage = _load(ckpt, range(0, 2), True, concurrency=2)
    stage.open("a")
    stage.open("b")
    with pytest.raises(SlotsFullError, match=r"all 2 KV-cache slots are in use.*'c'"):
        stage.open("c")
    stage.close("a")
    stage.open("c")
    assert sorted(stage.open_requests) == ["b", "c"]
    assert stage.length("c") == 0


def test_prompt_longer_than_context_is_a_clear_error(ckpt: Checkpoint) -> None:
    stage = _load(ckpt, range(5), True)
    stage.open("r")
    long = list(range(40))
    with pytest.raises(ContextFullError, match=r"positions \[0, 40\) exceed the context of 32 tokens"):
        stage.forward([("r", 0, stage.embed(long))])
    assert stage.length("r") == 0


def test_steps_must_be_contiguous_and_requests_open(ckpt: Checkpoint) -> None:
    stage = _load(ckpt, range(5), True)
    with pytest.raises(StageError, match="'x' is not open"):
        stage.forward([("x", 0, stage.embed([1]))])
    stage.open("r")
    with pytest.raises(StageError, match="starts at position 3, but 0 positions are cached"):
        stage.forward([("r", 3, stage.embed([1]))])


def test_only_the_head_stage_embeds_and_unembeds(ckpt: Checkpoint) -> None:
    middle = _load(ckpt, range(2, 4), False)
    with pytest.raises(StageError, match=r"embed\(\) runs on the head stage"):
        middle.embed([1])
    with pytest.raises(StageError, match=r"logits\(\) runs on the head stage"):
        middle.logits(torch.zeros(96))


def test_bf16_stage_round_trips_hidden_bytes_and_tracks_fp32(ckpt: Checkpoint) -> None:
    stage = _load(ckpt, range(5), True, dtype="bf16")
    assert (
        stage.wire_dtype == "BF16" and stage.kv_bytes == 2 * 5 * 2 * 32 * 16 * 2
    )  # k+v, blocks, kv heads, ctx, d
    h = stage.embed(PROMPT)
    data = stage.to_bytes(h)
    assert len(data) == len(PROMPT) * 96 * 2
    assert torch.equal(stage.from_bytes(data, (len(PROMPT), 96)), h)
    stage.open("r")
    [out] = stage.forward([("r", 0, h)])
    fp32 = _load(ckpt, range(5), True)
    fp32.open("r")
    [ref] = fp32.forward([("r", 0, fp32.embed(PROMPT))])
    assert stage.logits(out[-1]).argmax() == fp32.logits(ref[-1]).argmax()


@pytest.mark.parametrize(("stored", "computes"), [("float32", "fp32"), ("bfloat16", "bf16")])
def test_auto_dtype_keeps_the_checkpoints_precision(tiny_checkpoint, stored: str, computes: str) -> None:
    """On this CPU as on a GPU: a bf16 checkpoint computes in bf16 (half the memory of fp32), an
    fp32 one in fp32, so `kafila run` and every member of a session agree."""
    ck = Checkpoint.open(tiny_checkpoint("llama-gqa3-tied", dtype=stored))
    stage = Stage.load(ck, range(2), True, backend="torch", dtype="auto", context=32)
    assert stage.backend.dtype == computes


@pytest.mark.slow
def test_real_model_split_in_two_gives_exactly_the_full_models_logits(smollm2_path) -> None:
    real = Checkpoint.open(smollm2_path)
    n = real.n_blocks

    def load(blocks: range, head: bool) -> Stage:
        return Stage.load(real, blocks, head, backend="torch", dtype="fp32", context=32)

    full = _decode_run([load(range(n), True)], steps=3)
    split = _decode_run([load(range(0, n // 2), True), load(range(n // 2, n), False)], wire=True, steps=3)
    for ours, want in zip(split, full, strict=True):
        assert np.array_equal(ours, want)
