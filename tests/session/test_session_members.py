"""Sessions of four and five members on loopback: a real rendezvous (tests/net/harness.py), members
formed by `host` and `join` in this process, each with its own socket, QUIC links, stage and model
thread. In rings this size some members are not ring neighbours of the host: they fetch their
weights over a control link to the host that carries no ring traffic."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from kafila.api.service import Sampling
from kafila.engine.generate import generate
from kafila.engine.sampler import SamplingParams
from kafila.engine.stage import Stage
from kafila.engine.tokenizer import Tokenizer
from kafila.models.checkpoint import Checkpoint
from kafila.obs.trace import StageRecord
from kafila.obs.tracefile import from_json
from kafila.rendezvous.server import RendezvousServer
from kafila.session.forming.host import host
from kafila.session.forming.join import join
from kafila.session.ring.stagetrace import planned_rtt_ms
from kafila.session.runtime import MemberRuntime
from kafila.session.terms import Options
from kafila.session.weights.manifest import checkpoint_id
from tests.session.conftest import make_tiny_chat
from tests.session.hosting import code_of

pytestmark = [pytest.mark.network, pytest.mark.slow]
NAMES = ("alpha", "beta", "gamma", "delta", "epsilon")
PROMPT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm2_tokenizer) -> Path:
    """A tiny random Llama (8 blocks: every member of five gets at least one) with the real
    SmolLM2 tokenizer and chat template."""
    return make_tiny_chat(tmp_path_factory.mktemp("tiny-chat-8"), smollm2_tokenizer, blocks=8)


def opts(rdv: RendezvousServer, name: str, tmp: Path, **kw) -> Options:
    base = dict(
        rendezvous=rdv.url,
        name=name,
        api="127.0.0.1:0",
        cache=tmp / name,
        probe_repeats=1,
        wait_s=60,
        trace=tmp / f"{name}.jsonl",
    )
    return Options(**(base | kw))


async def form(rdv: RendezvousServer, tmp: Path, n: int, model: Path, division: str) -> list[MemberRuntime]:
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    host_opts = opts(
        rdv, NAMES[0], tmp, model=str(model), members=n, context=256, division=division, chunk=64, queue=3
    )
    hosting = asyncio.ensure_future(host(host_opts, on_code=code.set_result))
    c = await code_of(code, hosting)
    members = [asyncio.ensure_future(join(c, opts(rdv, name, tmp))) for name in NAMES[1:n]]
    return list(await asyncio.gather(hosting, *members))


def single_process(path: Path, prompt: list[int], n: int) -> list[int]:
    ckpt = Checkpoint.open(path)
    stage = Stage.load(ckpt, range(ckpt.n_blocks), True, backend="torch", dtype="fp32", context=256)
    stop = Tokenizer.from_checkpoint(ckpt).stop_ids
    params = SamplingParams(max_tokens=n, seed=7)
    return [t for t in generate(stage, prompt, params, eos_ids=tuple(stop)) if t not in stop]


def stage_records(f: MemberRuntime) -> list[StageRecord]:
    return [r for r in map(from_json, f.role.traces.recent()) if isinstance(r, StageRecord)]


def far_from_host(order: tuple[str, ...], host_name: str) -> list[str]:
    """Members that are not ring neighbours of the host."""
    i = order.index(host_name)
    near = {order[(i + 1) % len(order)], order[i - 1], host_name}
    return [m for m in order if m not in near]


@pytest.mark.parametrize(("n", "division"), [(4, "kafila"), (5, "uniform")])
async def test_sessions_of_four_and_five_members(rdv, tiny_chat_model, tmp_path, n, division) -> None:
    formed = await form(rdv, tmp_path, n, tiny_chat_model, division)
    try:
        by_name = {f.name: f for f in formed}
        plan = formed[0].plan
        assert sorted(plan.order) == sorted(NAMES[:n]) and plan.division == division
        far = far_from_host(plan.order, NAMES[0])
        assert len(far) == n - 3  # the ring of 4 has one such member, the ring of 5 two
        for name in far:  # ... which reach the host over a control link of their own
            assert NAMES[0] in by_name[name].links and name in by_name[NAMES[0]].links
            assert set(by_name[name].links) == {NAMES[0], plan.successor(name), plan.predecessor(name)}

        ckpt = Checkpoint.open(tiny_chat_model)
        total = sum(t.nbytes for t in ckpt.tensors.values())
        for f in formed[1:]:  # each joiner fetched exactly its share of tensors, nothing more
            a, b = plan.block_range(f.name)
            share = sum(ckpt.tensors[t].nbytes for t in ckpt.names_for(range(a, b), plan.head == f.name))
            assert f.shard.tensor_bytes == share and 0 < share < total

        tok = Tokenizer.from_checkpoint(ckpt)
        prompt = tok.encode_chat(PROMPT)
        want = await asyncio.to_thread(single_process, tiny_chat_model, prompt, 12)
        assert by_name[plan.head].role.schedule.max_queue == 3  # the host's --queue, at the head
        asker = by_name[far[0]]  # a member that is neither the head's nor the host's neighbour
        events = await asker.role.submit(prompt, Sampling(max_tokens=12, seed=7))
        assert [t async for ev in events for t in ev.tokens] == want

        for _ in range(200):  # every member writes its stage record once the request is freed
            if all(stage_records(f) for f in formed):
                break
            await asyncio.sleep(0.05)
        for f in formed:  # host/join --trace reach every member, with the plan's priced round trips
            assert stage_records(f) and (tmp_path / f"{f.name}.jsonl").stat().st_size > 0
            assert f.role.info.edge_rtt_ms == planned_rtt_ms(plan.edges)

        ring_edges = {f"{a}->{plan.successor(a)}" for a in plan.order}
        controls = {asker.name: {f"{asker.name}<->{NAMES[0]}"}, NAMES[0]: {f"{NAMES[0]}<->{m}" for m in far}}
        async with httpx.AsyncClient() as client:
            for name, own_controls in controls.items():  # the far member's and the host's view
                doc = (await client.get(f"{by_name[name].api.url}/session")).json()
                assert doc["state"] == "serving" and doc["ring"] == list(plan.order)
                f = by_name[name]
                want = (
                    {"source": "own files", "fetched_bytes": 0, "fetched_tensor_bytes": 0}
                    if name == NAMES[0]
                    else {
                        "source": "fetched",
                        "fetched_bytes": f.shard.bytes_fetched,
                        "fetched_tensor_bytes": f.shard.tensor_bytes,
                    }
                )
                assert {k: doc["weights"][k] for k in want} == want and doc["weights"]["path"]
                assert [m["name"] for m in doc["members"]] == list(plan.order)
                assert {m["name"]: tuple(m["blocks"]) for m in doc["members"]} == {
                    s.name: (s.start, s.stop) for s in plan.stages
                }
                links = {link["edge"]: link["path"] for link in doc["links"]}
                assert set(links) == ring_edges | own_controls
                assert set(links.values()) <= {"direct", "relay"}
            tags = [(await client.get(f"{f.api.url}/api/tags")).json()["models"][0] for f in formed]
        digests = {t["digest"] for t in tags}
        assert digests == {checkpoint_id(tiny_chat_model)}  # every member names the host's checkpoint
    finally:
        for f in formed:
            await f.close()
