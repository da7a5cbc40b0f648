"""A session of three members on loopback (a real rendezvous, host and join, QUIC links, the
joiners fetching their blocks from the host) serving Qwen3 at its real widths, vocabulary,
tokenizer and chat template (tests.qwen3_real): the tokens are transformers' greedy ones, for a
short prompt and a long one prefilled in several chunks."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kafila.api.service import Sampling
from kafila.rendezvous.server import RendezvousServer
from kafila.session.forming.host import host
from kafila.session.forming.join import join
from kafila.session.runtime import MemberRuntime
from kafila.session.terms import Options
from tests.qwen3_real import QwenReal
from tests.session.hosting import code_of

pytestmark = [pytest.mark.network, pytest.mark.slow]


def opts(rdv: RendezvousServer, name: str, tmp: Path, **kw) -> Options:
    base = dict(
        rendezvous=rdv.url, name=name, api="127.0.0.1:0", cache=tmp / name, probe_repeats=1, wait_s=120
    )
    return Options(**(base | kw))


async def form(rdv: RendezvousServer, tmp: Path, model: Path) -> list[MemberRuntime]:
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    kw = dict(model=str(model), members=3, context=512, concurrency=2, chunk=64, dtype="fp32")
    hosting = asyncio.ensure_future(host(opts(rdv, "alpha", tmp, **kw), on_code=code.set_result))
    c = await code_of(code, hosting)
    joining = [asyncio.ensure_future(join(c, opts(rdv, n, tmp))) for n in ("beta", "gamma")]
    return list(await asyncio.gather(hosting, *joining))


async def test_three_members_give_transformers_greedy_tokens(rdv, qwen3_real: QwenReal, tmp_path) -> None:
    formed = await form(rdv, tmp_path, qwen3_real.folder)
    try:
        plan = formed[0].plan
        assert len(plan.order) == 3 and all(b > a for a, b in map(plan.block_range, plan.order))
        assert [f.role.stage.backend.dtype for f in formed] == ["fp32"] * 3
        member = next(f for f in formed if f.plan.head != f.name)  # not the head
        for want in (qwen3_real.short, qwen3_real.long):
            events = await member.role.submit(want.prompt, Sampling(max_tokens=len(want.tokens)))
            assert [t async for ev in events for t in ev.tokens] == want.tokens
    finally:
        for f in formed:
            await f.close()
