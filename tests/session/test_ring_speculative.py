"""Speculative decoding around a ring of three real stages of a tiny model, joined in memory:
the answer is the one a single process gives without drafts, in fewer circuits, and the head's
counters say how many drafted tokens were kept."""

from __future__ import annotations

import asyncio

import pytest

from kafila.api.service import Sampling
from kafila.engine.draft import DraftPolicy
from kafila.engine.draft_model import DraftModel
from kafila.engine.generate import generate
from kafila.engine.sampler import SamplingParams
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from kafila.models.presets import resolve_manifest
from kafila.obs import metrics
from kafila.planner import DeviceReport, Plan, plan
from kafila.planner.decide import with_yield
from kafila.planner.drafting import MIN_CIRCUITS, CircuitYield
from tests.session.ringkit import build_ring

PROMPT = [4, 8, 15, 16, 23, 42, 7, 9] * 2  # the tiny model's greedy answer repeats itself
SPLITS = [(0, 2), (2, 4), (4, 5)]
CHEAP_ROWS = DraftPolicy(row_share=0.0)
GB = 10**9  # draft whatever lookup finds: every path is exercised


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("qwen3-gqa4-tied"))


def plain(ckpt: Checkpoint, params: SamplingParams) -> list[int]:
    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, "torch", "fp32", context=64)
    return list(generate(stage, PROMPT, params, eos_ids=tuple(ckpt.config.eos_token_id or ())))


async def answer(gen) -> list[int]:
    async def events() -> list[int]:
        return [tok async for ev in gen for tok in ev.tokens]

    return await asyncio.wait_for(events(), 120)


def counted() -> tuple[float, float, float]:
    """The head's draft tokens, kept draft tokens and decode circuits so far (whatever session
    labels the registry adds)."""
    names = (
        "kafila_spec_decode_num_draft_tokens_total",
        "kafila_spec_decode_num_accepted_tokens_total",
        "kafila_decode_circuits_total",
    )
    samples = [s for m in metrics.REGISTRY.collect() for s in m.samples]
    a, b, c = (sum(s.value for s in samples if s.name == name) for name in names)
    return a, b, c


@pytest.mark.parametrize(
    "sampling",
    [Sampling(max_tokens=40), Sampling(temperature=1.0, top_p=0.95, seed=5, max_tokens=40)],
    ids=["greedy", "seeded"],
)
async def test_three_members_answer_as_plain_decoding_in_fewer_circuits(
    ckpt: Checkpoint, sampling: Sampling
) -> None:
    params = SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed, max_tokens=40
    )
    expected = plain(ckpt, params)
    ring = build_ring(ckpt, SPLITS, context=64, draft=CHEAP_ROWS)
    before = counted()
    try:
        got = await answer(await ring.head.submit(PROMPT, sampling))
    finally:
        await ring.stop()
    drafted, accepted, circuits = (a - b for a, b in zip(counted(), before, strict=True))
    assert got == expected and len(got) == 40
    assert drafted > 0 and circuits == 39 - accepted  # every kept draft token saved a circuit
    if sampling.temperature == 0:
        assert accepted > 0


async def test_a_simulated_backend_without_row_exact_steps_keeps_the_greedy_answer(ckpt: Checkpoint) -> None:
    """A tie margin as a backend whose batched rows may round differently takes: rows near a tie
    are sampled again alone, the answer stays the plain one."""
    expected = plain(ckpt, SamplingParams(max_tokens=40))
    ring = build_ring(ckpt, SPLITS, context=64, draft=CHEAP_ROWS, tie_margin=0.5)
    try:
        got = await answer(await ring.head.submit(PROMPT, Sampling(max_tokens=40)))
    finally:
        await ring.stop()
    assert got == expected


async def test_a_forwarded_requests_answer_says_how_many_drafted_tokens_it_kept(ckpt: Checkpoint) -> None:
    """The Tokens messages back to the member that asked carry the drafted and kept counts (the
    API's usage.completion_tokens_details reads them)."""
    expected = plain(ckpt, SamplingParams(max_tokens=40))
    ring = build_ring(ckpt, SPLITS, context=64, draft=CHEAP_ROWS)
    before = counted()
    try:
        events = [ev async for ev in await ring.members[0].submit(PROMPT, Sampling(max_tokens=40))]
    finally:
        await ring.stop()
    drafted, accepted, _ = (a - b for a, b in zip(counted(), before, strict=True))
    assert [tok for ev in events for tok in ev.tokens] == expected
    assert sum(ev.accepted for ev in events) == accepted > 0
    assert sum(ev.drafted for ev in events) == drafted


async def test_a_head_whose_drafts_find_nothing_still_computes_each_step_with_the_sampling(
    ckpt: Checkpoint,
) -> None:
    """No draft (k never above 0): every step is a plain one, run in the sampling's model-thread
    turn as without drafting (RingHead.ahead_sent), and the answer is the plain one."""
    expected = plain(ckpt, SamplingParams(max_tokens=20))
    ring = build_ring(ckpt, SPLITS, context=64, draft=DraftPolicy(max_k=0))
    try:
        got = await answer(await ring.head.submit(PROMPT, Sampling(max_tokens=20)))
        sent = ring.head.ahead_sent
    finally:
        await ring.stop()
    assert got == expected and sent >= 15


@pytest.mark.parametrize(
    "sampling",
    [Sampling(max_tokens=40), Sampling(temperature=1.0, top_p=0.95, seed=5, max_tokens=40)],
    ids=["greedy", "seeded"],
)
async def test_a_draft_model_at_the_head_gives_the_plain_answer_in_fewer_circuits(
    ckpt: Checkpoint, sampling: Sampling
) -> None:
    """The head's draft model (here the served model's own checkpoint, whose greedy drafts are
    the served model's tokens) drafts each step; the other members verify its rows as any."""
    params = SamplingParams(
        temperature=sampling.temperature, top_p=sampling.top_p, seed=sampling.seed, max_tokens=40
    )
    expected = plain(ckpt, params)
    whole = Stage.load(ckpt, range(ckpt.n_blocks), True, "torch", "fp32", context=64)
    drafter = DraftModel(whole, "itself")
    # a draft model as costly as the target would not pay in a ring in memory: draft whatever it costs
    ring = build_ring(
        ckpt, SPLITS, context=64, draft=DraftPolicy(row_share=0.0, min_gain=-1.0), drafter=drafter
    )
    before = counted()
    try:
        got = await answer(await ring.head.submit(PROMPT, sampling))
        await asyncio.sleep(0.2)  # the free notice back round the ring closes its draft slot
    finally:
        await ring.stop()
    drafted, accepted, circuits = (a - b for a, b in zip(counted(), before, strict=True))
    assert got == expected and len(got) == 40
    assert drafted > 0 and circuits == 39 - accepted
    if sampling.temperature == 0:
        assert accepted == drafted  # the served model's own greedy tokens
    assert whole.open_requests == []


def three_homes() -> Plan:
    """A plan for the ring's three members 20 ms apart one way (its figures are what is priced)."""
    names = ("m0", "m1", "m2")
    fleet = [DeviceReport(n, 16 * GB, 50e9, pair_rtt_s={m: 0.040 for m in names if m != n}) for n in names]
    p = plan(fleet, resolve_manifest("qwen3-8b"), context=2048)
    assert p.feasible and p.per_token_s is not None
    return p


@pytest.mark.parametrize("draft", [CHEAP_ROWS, None], ids=["drafting", "plain"])
async def test_the_heads_session_document_prices_its_plan_for_the_tokens_its_circuits_gave(
    ckpt: Checkpoint, draft: DraftPolicy | None
) -> None:
    """Requests until the head counted MIN_CIRCUITS decode circuits: its counts are the counters'
    (every circuit, drafted and kept token), its /session document's plan figures are the plan's
    priced for them (a token below the plain one where drafts were kept, the same plain; as planned
    before, whatever yield the plan was priced for when decided), and the gauges follow the
    document."""
    p = three_homes()
    ring = build_ring(ckpt, SPLITS, context=64, draft=draft)
    ring.head.plan = with_yield(p, CircuitYield(2.0, 3.0, 0.1))  # as a re-plan priced it then
    ring.head.info.plan["chosen"] = p.summary()
    before = counted()
    try:
        first = ring.head.describe()["plan"]  # nothing counted: as planned
        assert first["chosen"] == first["planned"] == p.summary()
        for _ in range(8):
            await answer(await ring.head.submit(PROMPT, Sampling(max_tokens=40)))
            if ring.head.counts.circuits >= MIN_CIRCUITS:
                break
        doc = ring.head.describe()
    finally:
        await ring.stop()
    drafted, accepted, circuits = (a - b for a, b in zip(counted(), before, strict=True))
    c = ring.head.counts
    assert (c.circuits, c.drafted, c.accepted) == (circuits, drafted, accepted) and circuits >= MIN_CIRCUITS
    share = c.row_share()
    decode = doc["decode"]
    assert decode["circuits"] == circuits and decode["prices_plan"]
    assert decode["row_share_from"] == ("assumed" if share is None else "measured")
    chosen, planned = doc["plan"]["chosen"], doc["plan"]["planned"]
    assert planned == p.summary()
    if draft is None:
        assert drafted == 0 and chosen == planned  # plain decoding: the plan's own figures
    else:
        assert accepted > 0  # the tiny model's repeating answer: prompt lookup finds it
        assumed = draft.row_share
        y = CircuitYield.measured(circuits, drafted, accepted, assumed if share is None else share)
        assert chosen == with_yield(p, y).summary() and chosen["tokens_per_circuit"] == y.tokens
        assert chosen["per_token_ms"] < planned["per_token_ms"]
    metrics.observe_document(doc)
    gauges = {s.name: s.value for m in metrics.REGISTRY.collect() for s in m.samples}
    assert gauges["kafila_predicted_tokens_per_circuit"] == pytest.approx(chosen["tokens_per_circuit"])
    assert gauges["kafila_predicted_circuit_seconds"] == pytest.approx(chosen["circuit_ms"] / 1000)
