"""A draft model drafting for a tiny target of the same vocabulary: answers are plain decoding's
(greedy and seeded), the sampled distribution is the target's (chi-square), its cache follows
rejected drafts, and a model of another vocabulary is refused by its numbers."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kafila.engine.draft import DraftPolicy
from kafila.engine.draft_model import DraftModel, DraftModelError, load_draft_model
from kafila.engine.generate import Timings, generate
from kafila.engine.sampler import Sampler, SamplingParams, distribution
from kafila.engine.speculative import verify
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from tests.tiny_models import make_tiny

PROMPT = [4, 8, 15, 16, 23, 42, 7, 9, 11, 3]
# a tiny draft model costs about what the tiny target does, so the policy would stop drafting on
# this machine; these tests check what drafts give, so they draft whatever it costs
DRAFT_EVEN_AT_A_LOSS = DraftPolicy(row_share=0.0, min_gain=-1.0)
CHI2_7DOF_P1E4 = 29.88  # chi-square, 7 degrees of freedom: exceeded with probability 1e-4


def _stage(path: Path, concurrency: int = 1) -> Stage:
    ckpt = Checkpoint.open(path)
    return Stage.load(ckpt, range(ckpt.n_blocks), True, "torch", "fp32", context=64, concurrency=concurrency)


@pytest.fixture(scope="module")
def target(tiny_checkpoint) -> Stage:
    return _stage(tiny_checkpoint("qwen3-gqa4-tied"))


@pytest.fixture(scope="module")
def itself(tiny_checkpoint) -> DraftModel:
    """The target's own checkpoint as its draft model: its drafts are the target's greedy tokens."""
    return DraftModel(_stage(tiny_checkpoint("qwen3-gqa4-tied")), "qwen3-gqa4-tied")


@pytest.fixture(scope="module")
def other(tiny_checkpoint) -> DraftModel:
    """Another model of the same 256-token vocabulary: its drafts are often wrong."""
    return DraftModel(_stage(tiny_checkpoint("qwen3-gqa2-untied")), "qwen3-gqa2-untied")


@pytest.mark.parametrize("which", ["itself", "other"])
@pytest.mark.parametrize(
    "params",
    [SamplingParams(max_tokens=40), SamplingParams(temperature=1.0, top_p=0.95, seed=5, max_tokens=40)],
    ids=["greedy", "seeded"],
)
def test_a_draft_models_answer_is_plain_decodings(
    target: Stage, request: pytest.FixtureRequest, which: str, params: SamplingParams
) -> None:
    drafter: DraftModel = request.getfixturevalue(which)
    expected = list(generate(target, PROMPT, params))
    t = Timings()
    got = list(generate(target, PROMPT, params, timings=t, draft=DRAFT_EVEN_AT_A_LOSS, drafter=drafter))
    assert got == expected and len(got) == 40
    assert t.drafted > 0 and t.steps == 39 - t.accepted  # each kept draft token saved a step
    assert drafter.stage.open_requests == []  # its slot was given back with the target's
    if which == "itself" and params.temperature == 0:
        assert t.accepted == t.drafted  # the target's own greedy tokens: every one kept


def test_a_draft_models_greedy_draft_keeps_the_targets_distribution(target: Stage, other: DraftModel) -> None:
    """Rows of a real verification step (the target fed its token and the draft model's draft):
    the first token sampled has the target's distribution, and the draft's first token is kept
    with the target's probability of it (the standard rule for a point-mass draft)."""
    params = SamplingParams(temperature=1.0, top_k=8, seed=0)
    target.open("chi")
    try:
        [hidden] = target.forward([("chi", 0, target.embed(PROMPT))])
        first = int(np.argmax(target.logits(hidden[-1])))
        draft = other.propose("chi", [*PROMPT, first], 4)
        [rows] = target.forward([("chi", len(PROMPT), target.embed([first, *draft]))], rowwise=True)
        logits = target.logits(rows)
    finally:
        target.close("chi")
        other.close("chi")
    assert len(draft) == 4
    p = distribution(logits[0].astype(np.float64), 1.0, 8, 1.0, 0.0)
    support = np.flatnonzero(p)
    n, counts, kept = 4000, np.zeros(p.shape[0]), 0
    for seed in range(n):
        v = verify(Sampler(SamplingParams(temperature=1.0, top_k=8, seed=seed)), logits, draft)
        counts[v.tokens[0]] += 1
        kept += v.accepted > 0
    assert params.top_k == len(support) == 8
    expected = n * p[support]
    chi2 = float(((counts[support] - expected) ** 2 / expected).sum())
    assert counts.sum() == counts[support].sum() and chi2 < CHI2_7DOF_P1E4, (counts[support] / n, p[support])
    q = p[draft[0]]
    assert abs(kept / n - q) < 4 * np.sqrt(max(q * (1 - q), 1e-4) / n)


def test_a_draft_after_a_rejected_one_is_what_a_fresh_draft_model_proposes(
    tiny_checkpoint, target: Stage
) -> None:
    """Its cache holds its own last draft; a history that took another token is fed again from
    where they part, and a request that lost its slot to another is fed again whole."""
    path = tiny_checkpoint("qwen3-gqa2-untied")
    one = DraftModel(_stage(path), "one")  # one slot: "b" takes "a"'s
    history = [*PROMPT, 5, 6]
    try:
        first = one.propose("a", history, 5)
        rejected = [*history, first[0], (first[1] + 1) % 256]  # kept one, the target's own token next
        again = one.propose("a", rejected, 5)
        one.propose("b", PROMPT, 3)
        back = one.propose("a", [*rejected, again[0]], 4)
    finally:
        for rid in ("a", "b"):
            one.close(rid)
    fresh = DraftModel(_stage(path), "fresh")
    try:
        assert again == fresh.propose("x", rejected, 5)
        assert back == fresh.propose("y", [*rejected, again[0]], 4)
    finally:
        fresh.close("x")
        fresh.close("y")
    assert len(first) == 5 and one.stage.open_requests == []


def test_catching_up_reads_all_but_the_last_token_and_leaves_the_draft_unchanged(
    tiny_checkpoint, target: Stage
) -> None:
    """What the head runs while a prompt's prefill is around the ring: the draft model reads the
    prompt but its last token, so the draft that follows feeds one token and proposes what a
    draft model that never caught up proposes; after a verified step it reads only what it has
    not (here nothing: the kept tokens are its own draft's)."""
    path = tiny_checkpoint("qwen3-gqa2-untied")
    caught, fresh = DraftModel(_stage(path), "caught"), DraftModel(_stage(path), "fresh")
    history = [*PROMPT, 5, 6]
    try:
        caught.catch_up("a", history)
        assert caught.stage.length("a") == len(history) - 1
        draft = caught.propose("a", history, 4)
        assert caught.stage.length("a") == len(history) + 3  # the last token, then its own 3 steps
        assert draft == fresh.propose("x", history, 4)
        kept = [*history, draft[0], draft[1], 77]  # two kept, then the target's own token
        caught.catch_up("a", kept)  # all but 77 read already (its own draft): nothing read
        assert caught.stage.length("a") == len(history) + 3
        caught.catch_up("c", kept)  # a request it never read: all but the last token
        assert caught.stage.length("c") == len(kept) - 1
        assert caught.propose("a", kept, 4) == fresh.propose("y", kept, 4)
        caught.catch_up("b", [3])  # a one-token history: nothing to read before it
        assert "b" not in caught.stage.open_requests
    finally:
        for d, rids in ((caught, "abc"), (fresh, "xy")):
            for rid in rids:
                d.close(rid)


def test_a_draft_model_of_another_vocabulary_is_refused_by_its_numbers(tmp_path: Path, target: Stage) -> None:
    make_tiny(tmp_path / "wide", "qwen3", num_hidden_layers=1, vocab_size=320, hidden_size=32,
              num_attention_heads=2, num_key_value_heads=1, head_dim=16, intermediate_size=48)  # fmt: skip
    with pytest.raises(DraftModelError, match="vocabulary of 320 tokens, the served model 256"):
        load_draft_model(str(tmp_path / "wide"), target)


def test_a_draft_model_with_a_shorter_context_is_refused(tiny_checkpoint, target: Stage) -> None:
    ckpt = Checkpoint.open(tiny_checkpoint("qwen3-gqa2-untied"))
    short = DraftModel(Stage.load(ckpt, range(ckpt.n_blocks), True, "torch", "fp32", context=32), "short")
    with pytest.raises(DraftModelError, match="context of 32 positions is shorter than the served 64"):
        short.check_target(256, target.context)


def test_a_loaded_draft_model_serves_the_targets_context_and_slots(tiny_checkpoint, target: Stage) -> None:
    drafter = load_draft_model(str(tiny_checkpoint("qwen3-gqa2-untied")), target)
    assert (drafter.stage.context, drafter.stage.concurrency) == (target.context, target.concurrency)
    assert drafter.stage.blocks == range(drafter.stage.config.num_hidden_layers) and drafter.stage.head
