"""A member whose address the rendezvous holds back (another member behind the same address
mistyped the code: one campus or home NAT, or 127.0.0.1 here) waits as told and joins, rather
than failing with `rate_limited` (kafila.session.forming.signaling.join_in_turn). A real
rendezvous with its real back-off (2 s after one wrong proof); the host is a bare signaling client
(simulated: it opens and protects the session, and never plans)."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from kafila.net.signaling import SignalingClient, SignalingError
from kafila.proto.codes import WORDS, parse_code
from kafila.session.forming import signaling
from kafila.session.forming.signaling import join_in_turn
from tests.net.harness import LAB_LIMITS, start_rendezvous
from tests.session.test_formation_shell import simulated_host

BACKOFF_S = 2.0


async def _mistyped(url: str, code: str) -> None:
    *head, last = code.split("-")
    carol = await SignalingClient.connect(url)
    try:
        with pytest.raises(SignalingError) as wrong:
            await carol.join("-".join([*head, next(w for w in WORDS if w != last)]), "carol", {})
        assert wrong.value.code == "wrong_secret"
    finally:
        await carol.close()


async def test_a_member_held_back_by_anothers_wrong_code_waits_and_joins(monkeypatch) -> None:
    said: list[str] = []
    monkeypatch.setattr(signaling, "say", said.append)
    rdv = await start_rendezvous(limits=replace(LAB_LIMITS, failed_proof_backoff_s=BACKOFF_S))
    host, code = await simulated_host(rdv)
    dave = await SignalingClient.connect(rdv.url)
    try:
        await _mistyped(rdv.url, code)
        started = time.monotonic()
        joined = await join_in_turn(dave, parse_code(code), "dave", {"role": "member"}, within=30)
        waited = time.monotonic() - started
        assert joined.member > 0 and "dave" in [m.name for m in joined.members]
        assert 1.0 <= waited < 15, waited
        assert len(said) == 1 and "too many wrong codes tried; retry in 2 s" in said[0], said
    finally:
        await dave.close()
        await host.close()
        await rdv.stop()


async def test_a_member_held_back_longer_than_it_may_wait_fails_naming_the_limit() -> None:
    rdv = await start_rendezvous(limits=replace(LAB_LIMITS, failed_proof_backoff_s=BACKOFF_S))
    host, code = await simulated_host(rdv)
    dave = await SignalingClient.connect(rdv.url)
    try:
        await _mistyped(rdv.url, code)
        with pytest.raises(SignalingError, match="too many wrong codes tried; retry in 2 s") as held:
            await join_in_turn(dave, parse_code(code), "dave", {"role": "member"}, within=0.5)
        assert held.value.code == "rate_limited"
    finally:
        await dave.close()
        await host.close()
        await rdv.stop()
