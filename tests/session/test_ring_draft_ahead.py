"""Drafting ahead around a ring of three real stages of a tiny model, joined in memory: the head
sends the next step while one is in the ring, the answer stays the one plain decoding gives,
and steps ahead that a miss voids leave every stage's cache as plain decoding needs it."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila.api.service import Sampling
from kafila.engine.draft import DraftPolicy
from kafila.engine.draft_model import DraftModel
from kafila.engine.sampler import SamplingParams
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from tests.session.ringkit import build_ring
from tests.session.test_ring_speculative import PROMPT, SPLITS, answer, plain
from tests.tiny_models import SHAPES, make_tiny

CHEAP_ROWS = DraftPolicy(row_share=0.0)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("qwen3-gqa4-tied"))


@pytest.mark.parametrize("ahead", [1, 2])
@pytest.mark.parametrize(
    "sampling",
    [
        Sampling(max_tokens=40),
        Sampling(temperature=0.05, seed=5, max_tokens=40),
        Sampling(temperature=1.0, top_p=0.95, seed=5, max_tokens=40),
    ],
    ids=["greedy", "seeded-cool", "seeded-hot"],
)
async def test_steps_sent_ahead_over_simulated_hop_delays_give_the_plain_answer(
    ckpt: Checkpoint, sampling: Sampling, ahead: int
) -> None:
    params = SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed, max_tokens=40
    )
    expected = plain(ckpt, params)
    # hops held 20 ms each way (simulated), so a step ahead is drafted before its predecessor is back
    ring = build_ring(ckpt, SPLITS, context=64, draft=DraftPolicy(row_share=0.0, ahead=ahead), hop_s=0.02)
    try:
        got = await answer(await ring.head.submit(PROMPT, sampling))
        again = await answer(await ring.head.submit(PROMPT, sampling))
        head = ring.head
    finally:
        await ring.stop()
    assert got == expected and again == expected
    assert head.drafted_ahead > 0
    if sampling.temperature < 1:  # the prompt repeats: some guesses far ahead hold
        assert head.drafted_ahead > head.voided_ahead
    circuits, _, kept = head.last_request
    assert circuits == 39 - kept  # every kept draft token saved a circuit, ahead or not


async def test_steps_ahead_voided_by_misses_leave_every_cache_as_plain_decoding_needs(
    ckpt: Checkpoint, tmp_path: Path
) -> None:
    """A draft model of other weights (the same shapes and vocabulary, another seed) drafts
    tokens the served model often rejects: steps sent ahead on them are voided, the stages write
    over their positions, and this answer and the next are the plain ones."""
    folder = tmp_path / "other"
    make_tiny(folder, "qwen3", seed=1, **SHAPES["qwen3-gqa4-tied"])
    other = Checkpoint.open(folder)
    drafter = DraftModel(Stage.load(other, range(other.n_blocks), True, "torch", "fp32", context=64), "other")
    expected = plain(ckpt, SamplingParams(max_tokens=40))
    policy = DraftPolicy(row_share=0.0, min_gain=-1.0, prior_accept=0.9, decay=0.5, ahead=1)
    ring = build_ring(ckpt, SPLITS, context=64, draft=policy, drafter=drafter)
    try:
        got = await answer(await ring.head.submit(PROMPT, Sampling(max_tokens=40)))
        again = await answer(await ring.head.submit(PROMPT[3:], Sampling(max_tokens=30)))
        head = ring.head
    finally:
        await ring.stop()
    assert got == expected
    assert again == plain_of(ckpt, PROMPT[3:], 30)
    assert head.voided_ahead > 0 and head.voided_rows >= head.voided_ahead


def plain_of(ckpt: Checkpoint, prompt: list[int], n: int) -> list[int]:
    from kafila.engine.generate import generate

    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, "torch", "fp32", context=64)
    return list(
        generate(stage, prompt, SamplingParams(max_tokens=n), eos_ids=tuple(ckpt.config.eos_token_id or ()))
    )
