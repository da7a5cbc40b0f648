"""Many addresses against one session code: loopback aliases stand in for attackers'
machines (every 127.x.y.z is this machine's on Linux; each client socket is bound to its own, so the
rendezvous sees as many source addresses). The attackers know the code's public part only."""

from __future__ import annotations

import asyncio
import json
import secrets
import time

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from kafila.net.signaling import SignalingClient
from kafila.proto import signaling as sig
from tests.rendezvous.conftest import Factory, open_protected

pytestmark = pytest.mark.network
HOST_CAP = {"memory_gb": 31.5, "model_dtype": "bfloat16", "marker": "host-facts"}
ATTACK_S = 3.0


async def guess(url: str, source: str, public: str, seen: list[str], cycle: bool, until: float) -> int:
    """Join attempts with random proofs from `source` until `until`; with `cycle`, a fresh connection
    (join, then leave) for each, as the griefers who cycled join+leave did. Every frame heard goes
    to `seen`; returns the attempts made."""
    attempts = 0
    while time.monotonic() < until:
        try:
            async with connect(url, local_addr=(source, 0), open_timeout=5) as ws:
                while time.monotonic() < until:
                    await ws.send(sig.encode(sig.JoinChallenge(public, "c")))
                    reply = await ws.recv()
                    seen.append(str(reply))
                    if sig.decode_server(reply).TYPE == "challenge":
                        proof = secrets.token_hex(32)
                        await ws.send(sig.encode(sig.Join(public, proof, f"griefer-{source}", {}, ref="j")))
                        seen.append(str(await ws.recv()))
                    attempts += 1
                    if cycle:
                        await ws.send(sig.encode(sig.Leave("cycling")))
                        break
                    await asyncio.sleep(0.05)
        except (ConnectionClosed, OSError):
            await asyncio.sleep(0.05)
    return attempts


async def test_a_member_joins_in_time_while_55_addresses_grief_and_they_learn_nothing(
    start_rendezvous: Factory,
) -> None:
    server = await start_rendezvous()
    host = await SignalingClient.connect(server.url)
    _opened, code = await open_protected(
        host, "secret-model-7b", 2, "the-host", HOST_CAP, candidates=["10.9.8.7:4242"]
    )
    until = time.monotonic() + ATTACK_S
    seen: list[str] = []
    guessers = [guess(server.url, f"127.0.1.{i + 1}", code.public, seen, False, until) for i in range(50)]
    cyclers = [guess(server.url, f"127.0.2.{i + 1}", code.public, seen, True, until) for i in range(5)]
    attack = asyncio.gather(*guessers, *cyclers)

    await asyncio.sleep(1.0)  # the attack is under way; budgets are spent
    member = await SignalingClient.connect(server.url)
    started = time.monotonic()
    joined = await member.join(code, "legit", {"memory_gb": 8})
    took = time.monotonic() - started
    attempts = await attack

    assert [m.name for m in joined.members] == ["the-host", "legit"] and took < 5.0, took
    assert await host.next_event(2.0) == sig.MemberJoined(joined.members[1])  # and no one else
    with pytest.raises(TimeoutError):
        await host.next_event(0.3)
    assert server.registry is not None
    outcomes = server.registry.joins
    # each address had its first wrong proof tested; after that only the session's budget
    # (burst 10, 10 a minute) let more be tested
    assert sum(attempts) > 200 and 55 <= outcomes["wrong_secret"] <= 55 + 10 + 1, (sum(attempts), outcomes)
    heard = [json.loads(frame) for frame in seen]
    assert {f["type"] for f in heard} <= {"challenge", "error"}
    everything = " ".join(seen)
    for fact in ("the-host", "secret-model", "host-facts", "bfloat16", "10.9.8.7", "127.0.0.1"):
        assert fact not in everything, fact
    await member.close()
    await host.close()
