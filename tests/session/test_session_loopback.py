"""Whole sessions on loopback: a real rendezvous, members forming the ring over QUIC links,
fetching their weights from the host, and answering through the API of a member that is not
the head. Three members run in this process (each with its own socket, links, stage and model
thread); tests/session/test_session_processes.py runs them as separate processes."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import openai
import pytest

from kafila.api.service import Sampling
from kafila.engine.generate import generate
from kafila.engine.sampler import SamplingParams
from kafila.engine.stage import Stage
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from kafila.planner.decide import as_planned, measured
from kafila.planner.drafting import MIN_CIRCUITS, CircuitCounts
from kafila.rendezvous.server import RendezvousServer
from kafila.session.errors import SessionError
from kafila.session.forming.host import host
from kafila.session.forming.join import join
from kafila.session.ring.head import RingHead
from kafila.session.runtime import MemberRuntime
from kafila.session.terms import Options
from tests.session.conftest import make_tiny_chat
from tests.session.hosting import code_of

pytestmark = [pytest.mark.network, pytest.mark.slow]
MODEL = "smollm2-135m"
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]
HOST_BELOW_HEAD = 6_000_000  # bytes the host offers: less than the tiny chat model's head needs


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny random Llama (6 blocks) with the real SmolLM2 tokenizer and chat template: every code
    path of a session at a fetch size the test can afford (the weight fetch is its slow part)."""
    return make_tiny_chat(tmp_path_factory.mktemp("tiny-chat"), smollm2_tokenizer, blocks=6)


def opts(rdv: RendezvousServer, name: str, tmp: Path, **kw) -> Options:
    base = dict(
        rendezvous=rdv.url, name=name, api="127.0.0.1:0", cache=tmp / name, probe_repeats=1, wait_s=60
    )
    return Options(**(base | kw))


async def form(
    rdv: RendezvousServer,
    tmp: Path,
    division: str = "kafila",
    model: str = MODEL,
    host_kw: dict | None = None,
    **kw,
) -> list[MemberRuntime]:
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    hosting = asyncio.ensure_future(
        host(
            opts(
                rdv,
                "alpha",
                tmp,
                model=model,
                members=3,
                context=256,
                concurrency=4,
                division=division,
                chunk=64,
                **(host_kw or {}),
            ),
            on_code=code.set_result,
        )
    )
    c = await code_of(code, hosting)
    members = [asyncio.ensure_future(join(c, opts(rdv, n, tmp, **kw.get(n, {})))) for n in ("beta", "gamma")]
    return list(await asyncio.gather(hosting, *members))


async def close(formed: list[MemberRuntime]) -> None:
    for f in formed:
        await f.close()


def single_process(
    path: Path, prompt: list[int], n: int, dtype: str = "fp32", quant: str = "auto"
) -> list[int]:
    ckpt = Checkpoint.open(path)
    stage = Stage.load(
        ckpt, range(ckpt.n_blocks), True, backend="torch", dtype=dtype, context=256, quant=quant
    )
    stop = Tokenizer.from_checkpoint(ckpt).stop_ids
    return [
        t for t in generate(stage, prompt, SamplingParams(max_tokens=n), eos_ids=tuple(stop)) if t not in stop
    ]


def service_of(formed: list[MemberRuntime], not_head: bool = True):
    for f in formed:
        if (f.plan.head != f.name) == not_head:
            return f
    raise AssertionError("no such member")


@pytest.mark.parametrize("division", ["kafila", "uniform", "memory"])
async def test_three_members_give_the_single_process_tokens(rdv, tiny_chat_model, tmp_path, division) -> None:
    formed = await form(rdv, tmp_path, division, model=str(tiny_chat_model))
    try:
        plan = formed[0].plan
        assert plan.division == division and len(plan.order) == 3
        tok = Tokenizer.from_checkpoint(Checkpoint.open(tiny_chat_model))
        prompt = tok.encode_chat(PROMPT)
        want = await asyncio.to_thread(single_process, tiny_chat_model, prompt, 16)
        member = service_of(formed)
        got = [t async for ev in await member.role.submit(prompt, Sampling(max_tokens=16)) for t in ev.tokens]
        assert got == want
        ckpt = Checkpoint.open(tiny_chat_model)
        for f in formed[1:]:  # each joiner fetched exactly its share of tensors, nothing more
            a, b = f.plan.block_range(f.name)
            share = sum(ckpt.tensors[n].nbytes for n in ckpt.names_for(range(a, b), f.plan.head == f.name))
            assert f.shard.tensor_bytes == share
            assert 0 < share < sum(t.nbytes for t in ckpt.tensors.values())
    finally:
        await close(formed)


async def test_every_member_computes_in_the_hosts_dtype(rdv, tiny_chat_model, tmp_path) -> None:
    """The host's --dtype is the session's: members that asked for another (or for auto, which on
    a GPU would differ from a CPU's) compute in the host's, the plan is priced in it, and the
    tokens are the single process's in that dtype."""
    member_kw = {n: {"dtype": "fp32"} for n in ("beta", "gamma")}
    formed = await form(rdv, tmp_path, model=str(tiny_chat_model), host_kw={"dtype": "bf16"}, **member_kw)
    try:
        assert [f.role.stage.backend.dtype for f in formed] == ["bf16"] * 3
        assert {f.role.describe()["dtype"] for f in formed} == {"bf16"}  # /session says so
        tok = Tokenizer.from_checkpoint(Checkpoint.open(tiny_chat_model))
        prompt = tok.encode_chat(PROMPT)
        want = await asyncio.to_thread(single_process, tiny_chat_model, prompt, 12, "bf16")
        member = service_of(formed)
        got = [t async for ev in await member.role.submit(prompt, Sampling(max_tokens=12)) for t in ev.tokens]
        assert got == want
    finally:
        await close(formed)


async def test_a_q4_session_of_a_packed_folder_gives_the_single_process_tokens(
    rdv, tiny_chat_model, tmp_path
) -> None:
    """`kafila models --quantize q4`'s folder hosted with --quant auto: the host resolves the
    session's format from the folder, the terms carry it, every member loads its blocks packed, each
    joiner fetched exactly its share of the packed bytes, and the tokens are a single process's of
    the same folder."""
    from kafila.models.quantize import quantize_folder

    packed = quantize_folder(tiny_chat_model, "q4", tmp_path / "tiny-q4", progress=False)
    formed = await form(rdv, tmp_path, model=str(packed))
    try:
        assert [f.role.stage.model.quant for f in formed] == ["q4"] * 3
        assert {f.role.describe()["quant"] for f in formed} == {"q4"}  # /session says so
        ckpt, floats = Checkpoint.open(packed), Checkpoint.open(tiny_chat_model)
        prompt = Tokenizer.from_checkpoint(ckpt).encode_chat(PROMPT)
        want = await asyncio.to_thread(single_process, packed, prompt, 12)
        got = [
            t
            async for ev in await service_of(formed).role.submit(prompt, Sampling(max_tokens=12))
            for t in ev.tokens
        ]
        assert got == want
        for f in formed[1:]:
            a, b = f.plan.block_range(f.name)
            names = ckpt.names_for(range(a, b), f.plan.head == f.name)
            assert f.shard.tensor_bytes == sum(ckpt.tensors[n].nbytes for n in names)  # packed bytes
            assert set(f.shard.tensors) == set(names)
            float_share = sum(
                floats.tensors[n].nbytes for n in floats.names_for(range(a, b), f.plan.head == f.name)
            )
            assert f.shard.tensor_bytes < float_share / 3  # q4 of fp32: about a sixth
    finally:
        await close(formed)


async def test_host_quant_int8_packs_a_float_folder_on_every_member(rdv, tiny_chat_model, tmp_path) -> None:
    """`kafila host --quant int8` of a float folder: members that asked for nothing (auto) load
    their fetched float blocks packed in int8, and the tokens are a single int8 process's."""
    formed = await form(rdv, tmp_path, model=str(tiny_chat_model), host_kw={"quant": "int8"})
    try:
        assert [f.role.stage.model.quant for f in formed] == ["int8"] * 3
        prompt = Tokenizer.from_checkpoint(Checkpoint.open(tiny_chat_model)).encode_chat(PROMPT)
        want = await asyncio.to_thread(single_process, tiny_chat_model, prompt, 12, "fp32", "int8")
        got = [
            t
            async for ev in await service_of(formed).role.submit(prompt, Sampling(max_tokens=12))
            for t in ev.tokens
        ]
        assert got == want
    finally:
        await close(formed)


async def test_openai_client_through_a_member_that_is_not_the_head(rdv, tmp_path) -> None:
    formed = await form(rdv, tmp_path)
    try:
        member = service_of(formed)
        async with openai.AsyncOpenAI(base_url=f"{member.api.url}/v1", api_key="x", max_retries=0) as client:
            r = await client.chat.completions.create(
                model=MODEL, messages=PROMPT, max_tokens=20, temperature=0
            )
        assert "Paris" in r.choices[0].message.content
        doc = member.role.describe()
        assert doc["state"] == "serving" and len(doc["ring"]) == 3
        # no --trace file: /traces still serves what each member measured (it used to be empty)
        for _ in range(100):  # the records follow the answer, with the request's free notice
            async with httpx.AsyncClient() as http:
                kinds = {
                    d["type"]
                    for f in formed
                    for d in (await http.get(f"{f.api.url}/traces")).json()["traces"]
                }
            if kinds == {"session", "stage", "request"}:
                break
            await asyncio.sleep(0.05)
        assert kinds == {"session", "stage", "request"}
    finally:
        await close(formed)


async def test_infeasible_session_is_refused_naming_the_device(rdv, tmp_path) -> None:
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    tiny = 0.01  # GB: far less than any share of the model
    hosting = asyncio.ensure_future(
        host(
            opts(rdv, "alpha", tmp_path, model=MODEL, members=2, context=256, memory_bytes=int(tiny * 1e9)),
            on_code=code.set_result,
        )
    )
    c = await code_of(code, hosting)
    joining = asyncio.ensure_future(join(c, opts(rdv, "beta", tmp_path, memory_bytes=int(tiny * 1e9))))
    with pytest.raises(SessionError, match=r"alpha|beta"):
        await hosting
    with pytest.raises(SessionError, match="refused"):  # the member is told, not left waiting
        await joining


async def test_every_member_traces_its_hops_over_quic(rdv, tiny_chat_model, tmp_path) -> None:
    """Each member's stage record and the head's ring view: per-hop bytes counted on the QUIC links,
    the links' measured round trips next to the ones the plan priced."""
    from kafila.obs.trace import RequestRecord, StageRecord, TraceLog
    from kafila.obs.tracefile import from_json
    from kafila.session.ring.stagetrace import planned_rtt_ms

    formed = await form(rdv, tmp_path, model=str(tiny_chat_model))
    try:
        for f in formed:  # as `--trace FILE` would (the plan's priced round trips are wired already)
            f.role.traces = TraceLog(tmp_path / f"{f.name}.jsonl")
        prompt = Tokenizer.from_checkpoint(Checkpoint.open(tiny_chat_model)).encode_chat(PROMPT)
        gen = await service_of(formed).role.submit(prompt, Sampling(max_tokens=12))

        async def answer() -> list:
            return [ev async for ev in gen]

        await asyncio.wait_for(answer(), 60)
        head = service_of(formed, not_head=False)
        for _ in range(200):  # the request record follows the free notice around the ring
            recs = [from_json(d) for d in head.role.traces.recent()]
            if any(isinstance(r, RequestRecord) for r in recs):
                break
            await asyncio.sleep(0.05)
        stages = {
            f.name: next(r for r in map(from_json, f.role.traces.recent()) if isinstance(r, StageRecord))
            for f in formed
        }
    finally:
        await close(formed)
    [req] = [r for r in recs if isinstance(r, RequestRecord)]
    order = formed[0].plan.order
    edges = zip(order, order[1:] + order[:1], strict=True)
    assert [h.name for h in req.hops] == [f"{a}->{b}" for a, b in edges]
    priced = planned_rtt_ms(formed[0].plan.edges)
    for hop in req.hops:
        assert hop == stages[hop.src].hop_out and stages[hop.dst].hop_in.bytes == hop.bytes > 0
        assert hop.path == "direct" and hop.rtt_ms is not None and 0 < hop.rtt_ms < 1000
        assert hop.predicted_rtt_ms == priced.get(hop.name)
    # every stage ran each decode step (one per token, fewer where drafted tokens were kept)
    [steps] = {s.decode_steps for s in stages.values()}
    assert 0 < steps <= req.completion_tokens - 1


async def test_api_answers_while_the_session_forms_then_serves_on_the_same_address(
    rdv, tiny_chat_model, tmp_path, capsys
) -> None:
    """The host's API is up from its start: while it waits for its member, /session says what it
    is doing and an inference route answers 503 at once (it used to leave the client in the listen
    backlog for as long as forming took); once formed, the same address answers the request."""
    import re

    code: asyncio.Future = asyncio.get_running_loop().create_future()
    model = str(tiny_chat_model)
    host_opts = opts(rdv, "alpha", tmp_path, model=model, members=2, context=256)
    hosting = asyncio.ensure_future(host(host_opts, on_code=code.set_result))
    c = await code_of(code, hosting)
    said = ""
    async with httpx.AsyncClient(timeout=5) as http:
        for _ in range(600):  # the host probes itself first, then waits for its member
            said += capsys.readouterr().err
            url = re.search(r"kafila: API at (http://\S+)", said)
            if url and (await http.get(f"{url.group(1)}/session")).json()["step"].startswith("waiting for 1"):
                break
            await asyncio.sleep(0.05)
        assert url is not None, said
        base = url.group(1)
        doc = (await http.get(f"{base}/session")).json()
        assert doc["state"] == "forming" and doc["role"] == "host" and doc["me"] == "alpha"
        assert doc["model"] == tiny_chat_model.name  # the folder's name, not the host's path
        model = doc["model"]  # what clients name
        assert doc["step"].startswith("waiting for 1 member")
        assert (await http.get(f"{base}/healthz")).json() == {"ok": True, "state": "forming"}
        assert (await http.get(f"{base}/metrics")).status_code == 200  # Prometheus scrapes a forming member
        chat = {"model": model, "messages": PROMPT, "max_tokens": 4}
        r = await http.post(f"{base}/v1/chat/completions", json=chat)
        assert r.status_code == 503 and r.headers["retry-after"] == "5"
        assert (
            r.json()["error"]["code"] == "forming"
            and "forming: waiting for 1 member" in r.json()["error"]["message"]
        )
        r = await http.post(f"{base}/api/generate", json={"model": model, "prompt": "hi"})
        assert r.status_code == 503 and "still forming" in r.json()["error"]  # Ollama's error shape
        joining = asyncio.ensure_future(join(c, opts(rdv, "beta", tmp_path)))
        formed = list(await asyncio.gather(hosting, joining))
        try:
            assert formed[0].api.url == base  # the same server, switched to the session's app
            assert (await http.get(f"{base}/session")).json()["state"] == "serving"
            r = await http.post(f"{base}/v1/chat/completions", json=chat)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1
        finally:
            await close(formed)


async def test_the_hosts_plan_figures_follow_the_tokens_per_circuit_the_head_measured(
    rdv, tiny_chat_model, tmp_path
) -> None:
    """Requests until the head (a joiner: the host offers too little memory for the head) counted
    MIN_CIRCUITS decode circuits: its member tells the host the counts over their control link, and
    the host's /session prices the plan for them, next to the plan's figures as planned. (This
    random model's answers give prompt lookup nothing to draft: the drafted case's figures are
    tests/session/test_ring_speculative.py's.)"""
    formed = await form(rdv, tmp_path, model=str(tiny_chat_model), host_kw={"memory_bytes": HOST_BELOW_HEAD})
    try:
        hosting, head = formed[0], service_of(formed, not_head=False)
        assert head is not hosting  # the counts travel: the host's /session prices them
        role = head.role
        assert isinstance(role, RingHead) and hosting.plan is not None
        tok = Tokenizer.from_checkpoint(Checkpoint.open(tiny_chat_model))
        prompt = tok.encode_chat(PROMPT)
        for _ in range(10):
            [t async for ev in await role.submit(prompt, Sampling(max_tokens=24)) for t in ev.tokens]
            if role.counts.circuits >= MIN_CIRCUITS:
                break
        c = role.counts
        share = role.assumed_share() if c.row_share() is None else c.row_share()
        assert share is not None and c.circuits >= MIN_CIRCUITS
        want = measured(hosting.plan, CircuitCounts(c.circuits, c.drafted, c.accepted), share)
        for _ in range(100):  # within COUNTS_EVERY_S where the head is another member
            doc = hosting.ring().describe()
            if doc["plan"].get("decode", {}).get("circuits") == c.circuits:
                break
            await asyncio.sleep(0.1)
        assert doc["plan"]["decode"]["head"] == head.name and doc["plan"]["decode"]["prices_plan"]
        assert doc["plan"]["chosen"] == want.summary()
        assert doc["plan"]["planned"] == as_planned(hosting.plan).summary()
        assert want.tokens_per_circuit == 1 + c.accepted / c.circuits
    finally:
        await close(formed)


async def test_draft_ahead_reaches_the_head_that_a_session_forms(rdv, tiny_chat_model, tmp_path) -> None:
    """--draft-ahead (Options.draft_ahead) on every member: whichever member is the head drafts
    with a policy that sends a step ahead, its schedule allows one, and it answers."""
    ahead = {"draft_ahead": 1}
    formed = await form(rdv, tmp_path, model=str(tiny_chat_model), host_kw=ahead, beta=ahead, gamma=ahead)
    try:
        role = service_of(formed, not_head=False).role
        assert isinstance(role, RingHead) and role.draft is not None
        assert role.draft.ahead == 1 and role.schedule.ahead == 1
        tok = Tokenizer.from_checkpoint(Checkpoint.open(tiny_chat_model))
        got = [
            t
            async for ev in await role.submit(tok.encode_chat(PROMPT), Sampling(max_tokens=8))
            for t in ev.tokens
        ]
        assert 1 <= len(got) <= 8
    finally:
        await close(formed)
