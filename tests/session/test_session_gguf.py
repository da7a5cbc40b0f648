"""A session of two members on loopback (a real rendezvous, host and join, QUIC links, the joiner
fetching its blocks of the converted GGUF from the host) serving `--model FILE.gguf` of mixed types
(tests.models.test_gguf.MIXED) or of the K-quants (KQUANTS: Q4_K, Q5_K, Q6_K as stored, a stacked
q/k/v), served in place from the file: its greedy tokens are one process's, and a copy's."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kafila.api.service import Sampling
from kafila.models.gguf_convert import convert, ensure_gguf
from kafila.rendezvous.server import RendezvousServer
from kafila.session.forming.host import host
from kafila.session.forming.join import join
from kafila.session.runtime import MemberRuntime
from kafila.session.terms import Options
from tests.gguf_files import Shape, greedy_ids, qwen3_tokenizer_meta, write_gguf
from tests.models.test_gguf import KQUANTS, MIXED
from tests.session.hosting import code_of

pytestmark = [pytest.mark.network, pytest.mark.slow]
PROMPT = [9707, 11, 1879, 0, 3555, 374, 279, 6722, 315, 9625, 30]


def opts(rdv: RendezvousServer, name: str, tmp: Path, **kw) -> Options:
    base = dict(
        rendezvous=rdv.url, name=name, api="127.0.0.1:0", cache=tmp / name, probe_repeats=1, wait_s=120
    )
    return Options(**(base | kw))


def one_process(folder: Path, n: int) -> list[int]:
    return greedy_ids(folder, PROMPT, n)


@pytest.mark.parametrize("kinds", ["mixed", "kquants"])
async def test_two_members_serving_a_gguf_give_one_process_greedy_tokens(
    kinds: str, rdv, qwen3_tokenizer_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KAFILA_CACHE", str(tmp_path / "cache"))
    meta = qwen3_tokenizer_meta(qwen3_tokenizer_dir)
    types = {"mixed": MIXED, "kquants": KQUANTS}[kinds]
    file = write_gguf(tmp_path / f"tiny-qwen3-{kinds}.gguf", Shape(), meta, types, tied=True)
    folder = ensure_gguf(file, progress=False)  # served in place: the host reads the GGUF itself
    assert not (folder / "model.safetensors").exists()
    want = one_process(folder, 6)
    copy = tmp_path / "copy"  # the folder as a copy of the weights would be: the same answer
    copy.mkdir()
    convert(file, copy, progress=False, say=lambda line: None, inplace=False)
    assert one_process(copy, 6) == want
    code: asyncio.Future = asyncio.get_running_loop().create_future()
    kw = dict(model=str(file), members=2, context=64, concurrency=1, chunk=64, dtype="fp32")
    hosting = asyncio.ensure_future(host(opts(rdv, "alpha", tmp_path, **kw), on_code=code.set_result))
    c = await code_of(code, hosting)
    formed: list[MemberRuntime] = list(await asyncio.gather(hosting, join(c, opts(rdv, "beta", tmp_path))))
    try:
        plan = formed[0].plan
        assert len(plan.order) == 2 and all(b > a for a, b in map(plan.block_range, plan.order))
        member = next(f for f in formed if f.plan.head != f.name)  # not the head
        events = await member.role.submit(PROMPT, Sampling(max_tokens=6))
        assert [t async for ev in events for t in ev.tokens] == want
    finally:
        for f in formed:
            await f.close()
