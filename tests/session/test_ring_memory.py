"""The ring runtime with real stages of a tiny model, members joined in memory (one process)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

import pytest

from kafila.api.service import GenerationError, Sampling, TokenEvent
from kafila.engine.generate import generate
from kafila.engine.sampler import SamplingParams
from kafila.engine.stage import Stage
from kafila.models.checkpoint import Checkpoint
from kafila.proto import tensor as t
from kafila.proto.ring import Cause, RingBroken
from kafila.session.ring.role import RoleBase
from kafila.session.ring.schedule import SEPARATE_PROMPTS, lanes_for
from tests.session.ringkit import build_ring

PROMPTS = [
    [5, 9, 1, 77, 120, 3, 64, 18, 250, 31, 8],
    [17, 4, 200],
    [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
]


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint) -> Checkpoint:
    return Checkpoint.open(tiny_checkpoint("llama-gqa3-tied"))


def single_process(ckpt: Checkpoint, prompt: list[int], n: int) -> list[int]:
    stage = Stage.load(ckpt, range(5), True, backend="torch", dtype="fp32", context=64)
    params = SamplingParams(max_tokens=n)
    out = list(generate(stage, prompt, params, eos_ids=ckpt.config.eos_token_id, chunk=4))
    return [t for t in out if t not in ckpt.config.eos_token_id]


async def collect(gen) -> tuple[list[int], list[TokenEvent]]:
    events = [ev async for ev in gen]
    return [t for ev in events for t in ev.tokens], events


@pytest.mark.parametrize(
    "splits", [[(0, 5)], [(0, 2), (2, 5)], [(0, 1), (1, 4), (4, 5)], [(0, 3), (3, 4), (4, 5)]]
)
async def test_ring_gives_the_single_process_tokens(ckpt: Checkpoint, splits) -> None:
    ring = build_ring(ckpt, splits)
    try:
        for prompt in PROMPTS[:2]:
            tokens, events = await collect(await ring.head.submit(prompt, Sampling(max_tokens=12)))
            assert tokens == single_process(ckpt, prompt, 12)
            assert events[-1].finish in {"stop", "length"}
            assert events[0].prefill_s is not None
    finally:
        await ring.stop()


@pytest.mark.parametrize("splits", [[(0, 5)], [(0, 2), (2, 5)], [(0, 1), (1, 4), (4, 5)]])
async def test_each_decode_step_after_the_first_leaves_from_the_turn_that_sampled_its_token(
    ckpt: Checkpoint, splits
) -> None:
    """The head runs a lane's next step on the model thread right after sampling its tokens
    (Schedule.continuation): every decode step but the first (it follows the prefill) and no step
    after the last token; none is run twice, and the tokens stay the single process's."""
    ring = build_ring(ckpt, splits)
    try:
        for prompt in PROMPTS[:2]:
            before = ring.head.ahead_sent
            tokens, events = await collect(await ring.head.submit(prompt, Sampling(max_tokens=12)))
            assert tokens == single_process(ckpt, prompt, 12)
            generated = len(tokens) + (events[-1].finish == "stop")  # the stop token is not emitted
            assert ring.head.ahead_sent - before == max(generated - 2, 0)
        assert (ring.head.ahead_sent, ring.head.ahead_dropped) == (10, 0)  # the second prompt: 12 tokens
    finally:
        await ring.stop()


async def test_a_request_cancelled_during_its_lanes_turn_at_the_head_leaves_the_other_exact(
    ckpt: Checkpoint,
) -> None:
    """Two requests in one lane; one is cancelled while the head's model thread is busy (a held
    call, standing in for a slow head) and the lane's turn waits behind it. The turn runs the
    lane's next step for both, the schedule then sends it for one: that step is run again, and the
    other request's tokens stay the single process's."""
    ring = build_ring(ckpt, [(0, 2), (2, 5)], concurrency=2, lanes=1)
    head, gate = ring.head, threading.Event()
    try:
        stays = await head.submit(PROMPTS[1], Sampling(max_tokens=12))
        leaves = await head.submit(PROMPTS[1][:2], Sampling(max_tokens=30))
        answer = asyncio.ensure_future(collect(stays))
        seen = 0
        async for ev in leaves:
            seen += len(ev.tokens)
            if seen == 3:  # both decode in the lane's steps now, each run ahead by the head
                break
        held = asyncio.ensure_future(head.model.run(gate.wait))
        for _ in range(500):  # the lane's next turn queues behind the held call
            if head.model._calls.qsize():
                break
            await asyncio.sleep(0.01)
        assert head.model._calls.qsize() == 1
        leaves.cancel("the caller left")
        gate.set()
        await held
        tokens, _ = await answer
        assert tokens == single_process(ckpt, PROMPTS[1], 12)
        assert head.ahead_dropped == 1  # the one step run for both, then taken for one
    finally:
        gate.set()
        await ring.stop()


@pytest.mark.parametrize("dtypes", [["fp32", "bf16", "fp32"], ["fp32", "fp32", "bf16"]])
async def test_a_member_in_another_dtype_fails_the_request_by_name(ckpt: Checkpoint, dtypes) -> None:
    """Hidden states in the wrong dtype would be read as the wrong numbers (or hang the ring): a
    stage refuses them, and the request fails with both dtypes named. (Sessions give every member
    the host's dtype, tests/session/test_session_loopback.py; this is the guard behind it.)"""
    ring = build_ring(ckpt, [(0, 2), (2, 4), (4, 5)], dtypes=dtypes)
    try:
        gen = await ring.members[0].submit(PROMPTS[1], Sampling(max_tokens=4))
        with pytest.raises(GenerationError, match=r"computes in (BF16|F32) but received hidden states in"):
            await asyncio.wait_for(collect(gen), 10)
        assert ring.head.broken is None  # the ring itself stays up
    finally:
        await ring.stop()


async def test_penalties_reach_the_heads_sampler_from_any_member_as_in_kafila_run(ckpt: Checkpoint) -> None:
    """A repeat penalty over the whole answer (greedy): no token twice, at the head and through a
    forwarding member alike, and the tokens single-process generation gives with the same penalties.
    Without them this prompt's greedy answer repeats itself."""
    ring = build_ring(ckpt, [(0, 1), (1, 4), (4, 5)])
    penalties = {
        "repeat_penalty": 50.0,
        "repeat_last_n": 64,
        "presence_penalty": 0.5,
        "frequency_penalty": 0.25,
    }
    stage = Stage.load(ckpt, range(5), True, backend="torch", dtype="fp32", context=64)
    eos = ckpt.config.eos_token_id
    alone = list(
        generate(stage, PROMPTS[2], SamplingParams(max_tokens=24, **penalties), eos_ids=eos, chunk=4)
    )
    plain = single_process(ckpt, PROMPTS[2], 24)
    assert len(set(plain)) < len(plain)  # the unpenalized answer repeats
    assert len(set(alone)) == len(alone) and alone != plain
    try:
        for service in (ring.head, *ring.members):
            tokens, _ = await collect(await service.submit(PROMPTS[2], Sampling(max_tokens=24, **penalties)))
            assert tokens == [t for t in alone if t not in eos]
    finally:
        await ring.stop()


async def test_seeded_sampling_with_min_p_through_a_member_is_what_kafila_run_draws(ckpt: Checkpoint) -> None:
    """min_p, temperature and seed travel with a forwarded request: the same draws as single-process."""
    ring = build_ring(ckpt, [(0, 2), (2, 5)])
    sampled = {"temperature": 1.5, "seed": 11, "min_p": 0.2}
    stage = Stage.load(ckpt, range(5), True, backend="torch", dtype="fp32", context=64)
    eos = ckpt.config.eos_token_id
    alone = [
        t
        for t in generate(stage, PROMPTS[2], SamplingParams(max_tokens=16, **sampled), eos_ids=eos, chunk=4)
        if t not in eos
    ]
    try:
        tokens, _ = await collect(
            await ring.members[0].submit(PROMPTS[2], Sampling(max_tokens=16, **sampled))
        )
        assert tokens == alone
        other, _ = await collect(
            await ring.members[0].submit(PROMPTS[2], Sampling(max_tokens=16, **sampled | {"min_p": 0.0}))
        )
        assert other != alone  # min_p took part in the draws
    finally:
        await ring.stop()


async def test_request_from_a_member_that_is_not_the_head(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 1), (1, 4), (4, 5)])
    try:
        for m in ring.members:
            tokens, _ = await collect(await m.submit(PROMPTS[0], Sampling(max_tokens=10)))
            assert tokens == single_process(ckpt, PROMPTS[0], 10)
    finally:
        await ring.stop()


async def test_the_head_sends_a_decode_step_before_the_token_it_answers_a_forwarding_member(
    ckpt: Checkpoint,
) -> None:
    """A request that came from another member gets its tokens as Tokens messages on the head's
    outgoing link, the same link as the frames. The step computed with a token leaves before the
    token's message, which would otherwise be sent first and delay the ring."""
    ring = build_ring(ckpt, [(0, 1), (1, 4), (4, 5)])
    link = ring.head.next
    sent: list[t.Message] = []
    send = link.send

    async def recording(msg: t.Message) -> None:
        sent.append(msg)
        await send(msg)

    try:
        link.send = recording  # type: ignore[method-assign]
        tokens, _ = await collect(await ring.members[0].submit(PROMPTS[1], Sampling(max_tokens=12)))
        assert tokens == single_process(ckpt, PROMPTS[1], 12)
        answers = [i for i, m in enumerate(sent) if isinstance(m, t.Tokens) and m.tokens]
        frames = {m.entries[0].position: i for i, m in enumerate(sent) if isinstance(m, t.Hidden)}
        first = len(PROMPTS[1])  # the first decode step's position, after the prefill's token
        assert len(answers) == 12
        for n, at in enumerate(answers[1:-1], 2):  # the n-th token goes with the step at first + n - 1
            assert frames[first + n - 1] < at
    finally:
        await ring.stop()


async def test_concurrent_requests_each_match_their_single_user_output(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)], concurrency=2)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [9, 9, 9, 9]]
    try:
        services = [ring.head, ring.members[0], ring.members[1], ring.head]
        gens = [await s.submit(p, Sampling(max_tokens=9)) for s, p in zip(services, prompts, strict=True)]
        results = await asyncio.gather(*(collect(g) for g in gens))
        for p, (tokens, _) in zip(prompts, results, strict=True):
            assert tokens == single_process(ckpt, p, 9)
        queued = [ev.queue_position for _, evs in results for ev in evs if ev.queue_position]
        assert queued  # with concurrency 2, the later requests waited and were told their place
    finally:
        await ring.stop()


async def test_four_users_travel_in_the_lanes_the_plan_allows_and_match_single_user(ckpt: Checkpoint) -> None:
    lanes = lanes_for(7.0, 3.0, 3)  # predicted 3 + 2 + 2 ms around a 3 ms head: two lanes of two requests
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)], concurrency=4, lanes=lanes)
    prompts = [PROMPTS[0], PROMPTS[1], PROMPTS[2], [9, 9, 9, 9]]
    try:
        # in a ring of several stages prompts admitted together prefill as separate steps
        assert ring.head.schedule.merge == SEPARATE_PROMPTS
        gens = [await ring.head.submit(p, Sampling(max_tokens=9)) for p in prompts]
        assert ring.head.describe()["lanes"] == [2, 2]
        results = await asyncio.gather(*(collect(g) for g in gens))
        for p, (tokens, _) in zip(prompts, results, strict=True):
            assert tokens == single_process(ckpt, p, 9)
        assert ring.head.describe()["lanes"] == [0, 0]
    finally:
        await ring.stop()


async def test_cancel_frees_the_slot_for_the_next_request(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 2), (2, 5)], concurrency=1)
    try:
        gen = await ring.members[0].submit(PROMPTS[0], Sampling(max_tokens=40))
        async for ev in gen:
            if ev.tokens:
                break
        gen.cancel()
        tokens, _ = await asyncio.wait_for(
            collect(await ring.head.submit(PROMPTS[1], Sampling(max_tokens=8))), 10
        )
        assert tokens == single_process(ckpt, PROMPTS[1], 8)
    finally:
        await ring.stop()


async def test_a_request_past_a_full_queue_is_refused_as_busy_at_the_head_and_through_a_member(
    ckpt: Checkpoint,
) -> None:
    ring = build_ring(ckpt, [(0, 2), (2, 5)], concurrency=1, max_queue=1)
    try:
        first = await ring.head.submit(PROMPTS[0], Sampling(max_tokens=30))
        second = await ring.members[0].submit(PROMPTS[1], Sampling(max_tokens=4))  # waits: position 1
        while not ring.head.schedule.queue_positions():  # forwarded to the head
            await asyncio.sleep(0.01)
        with pytest.raises(GenerationError, match="queue is full: 1 requests already wait") as err:
            await ring.head.submit(PROMPTS[2], Sampling(max_tokens=4))
        assert err.value.code == "busy"
        with pytest.raises(GenerationError, match="queue is full") as err:  # refused by the head
            await asyncio.wait_for(
                collect(await ring.members[0].submit(PROMPTS[2], Sampling(max_tokens=4))), 10
            )
        assert err.value.code == "busy"
        tokens, _ = await asyncio.wait_for(collect(second), 30)  # the waiting one is served
        assert tokens == single_process(ckpt, PROMPTS[1], 4)
        assert (await asyncio.wait_for(collect(first), 30))[0] == single_process(ckpt, PROMPTS[0], 30)
    finally:
        await ring.stop()


async def test_at_the_context_end_the_ring_gives_what_kafila_run_gives(ckpt: Checkpoint) -> None:
    """`kafila run` made one token more than a session can (its last token needs no KV position,
    but a session counts prompt + answer within the context, as the API's max_tokens does)."""
    ring = build_ring(ckpt, [(0, 2), (2, 5)], context=24)
    prompt = PROMPTS[1]  # its answer has no EOS before the context's end
    try:
        ringed, _ = await collect(await ring.head.submit(prompt, Sampling(max_tokens=24 - len(prompt))))
    finally:
        await ring.stop()
    stage = Stage.load(ckpt, range(5), True, backend="torch", dtype="fp32", context=24)
    alone = list(generate(stage, prompt, SamplingParams(max_tokens=100), eos_ids=ckpt.config.eos_token_id))
    assert ringed == alone and len(alone) == 24 - len(prompt)


async def test_prompt_past_the_context_is_refused(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 5)], context=16)
    try:
        with pytest.raises(GenerationError, match="exceeds the context of 16"):
            await ring.head.submit(list(range(1, 12)), Sampling(max_tokens=8))
    finally:
        await ring.stop()


async def test_simulated_killed_member_fails_requests_quickly(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)], dead_after=1.0)
    try:
        gen = await ring.head.submit(PROMPTS[0], Sampling(max_tokens=40))
        ring.kill(1)  # simulated death of m1 while the request's prompt is on its way to it
        with pytest.raises(GenerationError, match="member m1 stopped answering") as err:
            await asyncio.wait_for(collect(gen), 10)
        assert err.value.code == "member_lost"
        assert ring.head.describe()["state"] == "broken"
        assert ring.members[1].describe()["state"] == "broken"  # the others notice too
        assert [m.describe()["me"] for m in (ring.head, *ring.members)] == ["m0", "m1", "m2"]
        with pytest.raises(GenerationError, match="m1"):
            await ring.members[1].submit(PROMPTS[1], Sampling(max_tokens=3))
    finally:
        await ring.stop()


async def test_a_member_that_saw_the_host_end_the_session_tells_the_ring_it_ended(ckpt: Checkpoint) -> None:
    """m1's link to the host closed as ended (MemberRuntime.watch_host_ending sets `ending`;
    simulated here, the in-memory ring has no QUIC links): its "broken" says the session ended, so
    the members downstream end too even where their own link's closing comes later."""
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)])
    told: list[str] = []
    ring.members[1].on_ended = lambda: told.append("m2")
    ring.head.on_ended = lambda: told.append("m0")
    try:
        ring.members[0].ending = True
        detail = "link to m0 closed by the peer: the host ended the session"
        ring.members[0]._break(RingBroken("m0", Cause.CLOSED, detail))
        for _ in range(100):
            if ring.head.broken is not None:
                break
            await asyncio.sleep(0.02)
        assert told == ["m2", "m0"]
        assert "the host ended the session" in (ring.members[1].broken_text or "")
        assert ring.members[0].broken is not None and ring.members[0].broken.cause is Cause.ENDED
    finally:
        await ring.stop()


async def test_a_member_whose_channel_broke_as_ended_ends_and_tells_the_ring(ckpt: Checkpoint) -> None:
    """m1's channel to a neighbour failed because that neighbour's link closed as ended (its host
    ended the session; kafila.session.channel.closed_by): m1 ends now, before its own link to the
    host closes, and its "broken" ends the members downstream."""
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)])
    told: list[str] = []

    def ended(name: str, member: RoleBase) -> None:
        told.append(name)
        member.ending = True  # as MemberRuntime.watch_host_ending's `end` does

    ring.members[0].on_ended = lambda: ended("m1", ring.members[0])
    ring.members[1].on_ended = lambda: ended("m2", ring.members[1])
    try:
        ring.members[0]._break(RingBroken("m0", Cause.ENDED, "link to m0 closed by the peer: ended"))
        for _ in range(100):
            if ring.members[1].broken is not None:
                break
            await asyncio.sleep(0.02)
        assert told == ["m1", "m2"]
        assert [m.broken.cause for m in ring.members if m.broken] == [Cause.ENDED, Cause.ENDED]
    finally:
        await ring.stop()


async def test_a_member_that_broke_otherwise_does_not_say_the_session_ended(ckpt: Checkpoint) -> None:
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)])
    told: list[str] = []
    ring.members[1].on_ended = lambda: told.append("m2")
    try:
        ring.members[0]._break(RingBroken("m0", Cause.SILENT, "member m0 stopped answering"))
        for _ in range(100):
            if ring.members[1].broken is not None:
                break
            await asyncio.sleep(0.02)
        assert ring.members[1].broken is not None and told == []
    finally:
        await ring.stop()


@pytest.mark.parametrize(("where", "method"), [(1, "step"), (0, "step"), (0, "logits")])
async def test_an_unexpected_error_on_a_model_thread_fails_requests_by_name_instead_of_hanging(
    ckpt: Checkpoint, where: int, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not a StageError (the stage's own refusals, answered per request) but anything else, such as
    the backend running out of memory (simulated: the stage's method raises): the ring is broken
    with the error named, every request fails at once and new ones are refused; nothing waits on a
    step that will never come back."""
    ring = build_ring(ckpt, [(0, 2), (2, 3), (3, 5)])
    stage = ring.head.stage if where == 0 else ring.members[where - 1].stage

    def fails(*_: object) -> None:
        raise RuntimeError("simulated: out of memory")

    try:
        monkeypatch.setattr(stage, method, fails)
        gen = await ring.head.submit(PROMPTS[1], Sampling(max_tokens=12))
        with pytest.raises(GenerationError, match=f"m{where}: internal error.*simulated: out of memory"):
            await asyncio.wait_for(collect(gen), 10)
        assert ring.head.describe()["state"] == "broken"
        with pytest.raises(GenerationError, match="simulated: out of memory"):
            await ring.head.submit(PROMPTS[0], Sampling(max_tokens=3))
    finally:
        await ring.stop()


async def until(done: Callable[[], bool], within_s: float) -> None:
    """Wait for `done()` to hold, checking every 10 ms; fail naming the deadline if it does not."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not done():
        assert loop.time() < deadline, f"still not done after {within_s:g} s"
        await asyncio.sleep(0.01)


async def test_many_waiting_clients_leaving_at_once_send_few_queue_updates(ckpt: Checkpoint) -> None:
    """150 forwarded requests wait behind one; all their clients leave at once. Each cancel moved
    the whole queue and every waiting request was told at once, a message around the ring each
    (about 150**2 / 2 here; 400 such clients broke a real ring). Positions now go out at most every
    QUEUE_REPORT_S, only those that changed: the running request is not disturbed."""
    from kafila.session.ring.head import QUEUE_REPORT_S

    ring = build_ring(ckpt, [(0, 2), (2, 5)], concurrency=1)
    link = ring.head.next
    told: list[int] = []
    send = link.send

    async def counting(msg: t.Message) -> None:
        if isinstance(msg, t.Tokens) and msg.queue_position:
            told.append(msg.request_id)
        await send(msg)

    try:
        link.send = counting  # type: ignore[method-assign]
        running = asyncio.ensure_future(collect(await ring.head.submit(PROMPTS[1], Sampling(max_tokens=40))))
        waiting = [await ring.members[0].submit([7, 8, 9], Sampling(max_tokens=5)) for _ in range(150)]
        # each forwarded request reaches the head and is told its place (a deadline, not a count of
        # sleeps: on a loaded 2-core machine 150 forwards took longer than 500 sleeps of 10 ms)
        await until(lambda: len(ring.head.schedule.queue_positions()) == 150, 60.0)
        for gen in waiting:
            gen.cancel("client disconnected")
        await until(lambda: not ring.head.schedule.queue_positions(), 60.0)
        await asyncio.sleep(2 * QUEUE_REPORT_S)
        tokens, _ = await running
        assert tokens == single_process(ckpt, PROMPTS[1], 40) and ring.head.broken is None
        assert 150 <= len(told) <= 2 * 150  # each told once on arrival, a few updates at most
    finally:
        await ring.stop()


async def test_a_member_never_batches_a_decode_step_with_a_prefill_chunk(ckpt: Checkpoint) -> None:
    """Frames waiting at a member (made slow: an emulated 10x slower device) run as one batch, but
    a decode row batched with a prefill chunk takes another kernel than alone: a seeded answer
    changed when another prompt prefilled alongside it. Decode and prefill now batch apart."""
    from kafila.engine.pace import Pace

    ring = build_ring(ckpt, [(0, 2), (2, 5)], concurrency=2)
    member = ring.members[0]
    batches: list[list[bool]] = []
    run = member._run

    async def recording(frames: list[t.Hidden]) -> None:
        batches.append([bool(f.flags & t.Flag.PREFILL) for f in frames])
        await run(frames)

    try:
        await collect(await ring.head.submit(PROMPTS[1], Sampling(max_tokens=2)))  # kernels compiled
        member._run = recording  # type: ignore[method-assign]
        member.stage.pace = Pace(0.1)
        decoding = await ring.head.submit(PROMPTS[1], Sampling(max_tokens=30))
        first = await anext(aiter(decoding))
        assert first.tokens
        prefilling = await ring.head.submit(PROMPTS[2] * 3, Sampling(max_tokens=2))  # 39 rows: 10 chunks
        (tokens, _), _ = await asyncio.gather(collect(decoding), collect(prefilling))
        assert first.tokens + tuple(tokens) == tuple(single_process(ckpt, PROMPTS[1], 30))
    finally:
        await ring.stop()
    assert any(all(b) for b in batches) and any(not any(b) for b in batches)
    assert all(len(set(b)) == 1 for b in batches), batches


async def test_a_member_runs_waiting_prefill_chunks_one_at_a_time_and_batches_decode_steps(
    ckpt: Checkpoint,
) -> None:
    """Prefill frames stay apart, so the next stage can start on one while this one computes the
    next (kafila.session.ring.schedule); waiting decode frames of distinct requests run as one batch."""
    ring = build_ring(ckpt, [(0, 2), (2, 5)], concurrency=4)
    member = ring.members[0]
    data = bytes(4 * 4 * 64)  # zero rows; only the batching is looked at

    def frame(rid: int, position: int, rows: int, flags: int) -> t.Hidden:
        return t.Hidden(
            0, t.DType.F32, (rows, 64), (t.Entry(rid, position, rows),), data[: rows * 256], flags
        )

    try:
        member._work[:] = [frame(1, 4, 4, t.Flag.PREFILL), frame(2, 0, 4, t.Flag.PREFILL)]
        member._work += [
            frame(3, 7, 1, 0),
            frame(4, 9, 1, 0),
            frame(3, 8, 1, 0),
            frame(5, 0, 4, t.Flag.PREFILL),
        ]
        taken = [member._take_batch() for _ in range(5)]
    finally:
        await ring.stop()
    ids = [[f.entries[0].request_id for f in batch] for batch in taken]  # type: ignore[union-attr]
    assert ids == [[1], [2], [3, 4], [3], [5]] and not member._work


async def test_prompts_admitted_together_prefill_as_separate_steps_in_a_ring_as_one_step_alone(
    ckpt: Checkpoint,
) -> None:
    """Through several stages separate steps overlap (the next stage starts on the first prompt
    while the head computes the second); a head alone merges them into one forward pass. Either
    way every answer is the single-process one."""
    for splits, entries in (([(0, 2), (2, 3), (3, 5)], [1, 1, 1]), ([(0, 5)], [3])):
        ring = build_ring(ckpt, splits, concurrency=3, chunk=32)  # one chunk for all three
        sizes: list[int] = []  # entries per prefill step the head sends
        take = ring.head.schedule.take

        def recording():  # type: ignore[no-untyped-def]
            steps = take()  # noqa: B023 (called while this ring runs)
            sizes.extend(len(s.entries) for s in steps if s.prefill)  # noqa: B023
            return steps

        ring.head.schedule.take = recording  # type: ignore[method-assign]
        try:
            gens = [await ring.head.submit(p, Sampling(max_tokens=6)) for p in PROMPTS[:3]]
            answers = await asyncio.gather(*(collect(g) for g in gens))
        finally:
            await ring.stop()
        assert sizes == entries, (splits, sizes)
        for prompt, (tokens, _) in zip(PROMPTS[:3], answers, strict=True):
            assert tokens == single_process(ckpt, prompt, 6)


async def test_prompts_admitted_together_with_a_long_one_match_their_single_user_output(
    ckpt: Checkpoint,
) -> None:
    """At a head alone in its ring, which merges prompts admitted together, a short prompt's only
    chunk and longer prompts' last chunks (at position 8) prefill in separate steps (their code
    paths differ), and every answer is the single-process one. (In a longer ring every prompt
    travels alone anyway.)"""
    ring = build_ring(ckpt, [(0, 5)], concurrency=3, chunk=8)
    starts: list[set[bool]] = []  # per prefill step the head sends: which of its chunks are first ones
    take = ring.head.schedule.take

    def recording():  # type: ignore[no-untyped-def]
        steps = take()
        starts.extend({e.position == 0 for e in s.entries} for s in steps if s.prefill)
        return steps

    ring.head.schedule.take = recording  # type: ignore[method-assign]
    try:
        prompts = [PROMPTS[2] + PROMPTS[1], PROMPTS[1], PROMPTS[0]]  # chunks at 0 and 8; at 0; at 0 and 8
        gens = [await ring.head.submit(p, Sampling(max_tokens=12)) for p in prompts]
        answers = await asyncio.gather(*(collect(g) for g in gens))
    finally:
        await ring.stop()
    assert all(len(kinds) == 1 for kinds in starts) and {True} in starts and {False} in starts, starts
    for prompt, (tokens, _) in zip(prompts, answers, strict=True):
        assert tokens == single_process(ckpt, prompt, 12)
