"""The relay's pure core: binding legs by token, forwarding, rejections, limits, expiry."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from kafila.proto import udp
from kafila.proto.udp import ErrorCode
from kafila.rendezvous.limits import Limits
from kafila.rendezvous.ratelimit import TokenBuckets
from kafila.rendezvous.relay import Drop, RelayLimitError, RelayTable, leg_token

A = ("198.51.100.1", 40001)
B = ("203.0.113.2", 50002)
EVE = ("192.0.2.66", 6666)


def table(**overrides: float) -> RelayTable:
    counter = itertools.count(1)
    limits = dataclasses.replace(Limits(), **overrides)  # type: ignore[arg-type]
    return RelayTable(limits, random_id=lambda: next(counter))


def bound_channel(relay: RelayTable) -> int:
    ch = relay.allocate("4-k7m2", 1, 2, 0.0)
    assert isinstance(relay.bind(udp.RelayBind(ch.id, ch.legs[0].token), A, 0, 0.0), udp.RelayBindAck)
    ack = relay.bind(udp.RelayBind(ch.id, ch.legs[1].token), B, 0, 0.0)
    assert ack == udp.RelayBindAck(ch.id, True, B)
    return ch.id


def test_forwarding_both_ways_with_counters() -> None:
    relay = table()
    cid = bound_channel(relay)
    assert relay.forward(cid, A, 1200, 1.0) == (B, 0)
    assert relay.forward(cid, B, 800, 1.0) == (A, 0)
    ch = relay.channels[cid]
    assert (ch.bytes, ch.packets) == (2000, 2)
    assert (relay.totals.bytes, relay.totals.packets) == (2000, 2)


def test_first_bind_reports_peer_unbound_and_data_waits() -> None:
    relay = table()
    ch = relay.allocate("s", 1, 2, 0.0)
    ack = relay.bind(udp.RelayBind(ch.id, ch.legs[0].token), A, 0, 0.0)
    assert ack == udp.RelayBindAck(ch.id, False, A)
    assert relay.forward(ch.id, A, 100, 0.0) is Drop.PEER_UNBOUND


def test_third_party_is_not_forwarded() -> None:
    relay = table()
    cid = bound_channel(relay)
    assert relay.forward(cid, EVE, 100, 1.0) is Drop.NOT_A_LEG
    assert relay.forward(999, A, 100, 1.0) is Drop.UNKNOWN_CHANNEL
    assert relay.totals.packets == 0 and relay.channels[cid].dropped == 1


def test_bad_token_and_unknown_channel_are_refused() -> None:
    relay = table()
    cid = bound_channel(relay)
    err = relay.bind(udp.RelayBind(cid, b"\x00" * 16), EVE, 0, 1.0)
    assert isinstance(err, udp.RelayBindError) and err.code is ErrorCode.BAD_TOKEN
    err = relay.bind(udp.RelayBind(cid + 1, b"\x00" * 16), EVE, 0, 1.0)
    assert isinstance(err, udp.RelayBindError) and err.code is ErrorCode.UNKNOWN_CHANNEL
    assert relay.forward(cid, A, 10, 1.0) == (B, 0)  # legs unchanged


def test_leg_moves_when_its_nat_mapping_changes() -> None:
    relay = table()
    cid = bound_channel(relay)
    moved = ("198.51.100.1", 40999)
    relay.bind(udp.RelayBind(cid, relay.channels[cid].legs[0].token), moved, 1, 2.0)
    assert relay.forward(cid, A, 10, 2.0) is Drop.NOT_A_LEG
    assert relay.forward(cid, B, 10, 2.0) == (moved, 1)  # out of the socket the leg bound through


def test_allocate_is_idempotent_per_edge() -> None:
    relay = table()
    assert relay.allocate("s", 1, 2, 0.0).id == relay.allocate("s", 2, 1, 0.0).id
    assert relay.allocate("s", 1, 3, 0.0).id != relay.allocate("t", 1, 2, 0.0).id


def test_channel_limits() -> None:
    relay = table(relay_channels_per_session=2, relay_channels=3)
    relay.allocate("s", 1, 2, 0.0)
    relay.allocate("s", 2, 3, 0.0)
    with pytest.raises(RelayLimitError, match="session s has 2 relay channels, the limit is 2"):
        relay.allocate("s", 3, 1, 0.0)
    relay.allocate("t", 1, 2, 0.0)
    with pytest.raises(RelayLimitError, match="relay has 3 channels, the limit is 3"):
        relay.allocate("u", 1, 2, 0.0)


def test_session_byte_rate_limit_drops_the_excess() -> None:
    relay = table(relay_session_bytes_per_s=10_000)
    cid = bound_channel(relay)
    results = [relay.forward(cid, A, 1000, 5.0) for _ in range(12)]
    assert results.count((B, 0)) == 10 and results.count(Drop.RATE_LIMITED) == 2
    assert relay.forward(cid, A, 1000, 5.2) == (B, 0)  # 0.2 s refills 2000 bytes


def test_idle_channels_expire_and_active_ones_stay() -> None:
    relay = table(relay_idle_s=60.0)
    cid = bound_channel(relay)
    other = relay.allocate("s2", 1, 2, 0.0).id
    relay.forward(cid, A, 10, 50.0)
    expired = relay.expire(60.0)
    assert [c.id for c in expired] == [other]
    assert relay.expire(109.0) == [] and cid in relay.channels
    assert [c.id for c in relay.expire(110.0)] == [cid]
    assert relay.forward(cid, A, 10, 111.0) is Drop.UNKNOWN_CHANNEL


def test_release_member_and_session() -> None:
    relay = table()
    relay.allocate("s", 1, 2, 0.0)
    relay.allocate("s", 2, 3, 0.0)
    relay.allocate("t", 1, 2, 0.0)
    assert len(relay.release_member("s", 3)) == 1
    assert len(relay.release_session("s")) == 1
    assert [c.session for c in relay.channels.values()] == ["t"]


def test_a_low_byte_rate_throttles_datagrams_larger_than_a_second_of_it() -> None:
    relay = table(relay_session_bytes_per_s=1000)  # one second's bytes < one 1200-byte QUIC datagram
    cid = bound_channel(relay)
    results = [relay.forward(cid, A, 1200, 0.1 * i) for i in range(100)]  # 10 datagrams/s for 10 s
    passed = results.count((B, 0))
    assert 8 <= passed <= 9  # about 1000 B/s of 1200 B datagrams: throttled, not blackholed
    assert results[0] == (B, 0) and results[1] == Drop.RATE_LIMITED


def test_a_cost_above_the_burst_is_taken_from_a_full_bucket_and_repaid_at_the_rate() -> None:
    buckets = TokenBuckets(rate=100.0, burst=100.0)
    assert buckets.take("s", 0.0, cost=250)  # full: taken, 150 in debt
    assert not buckets.take("s", 1.5, cost=1)  # 1.5 s repaid the debt, nothing more
    assert buckets.take("s", 2.0, cost=50)
    assert buckets.retry_after("s", 2.0, cost=250) == pytest.approx(1.0)  # waits for a full bucket
    assert not buckets.take("s", 2.9, cost=250) and buckets.take("s", 3.0, cost=250)


def test_a_relay_limit_of_0_says_the_rendezvous_does_not_relay() -> None:
    for limit in ("relay_channels", "relay_channels_per_session"):
        with pytest.raises(
            RelayLimitError, match="this rendezvous does not relay: its relay channel limit is 0"
        ):
            table(**{limit: 0}).allocate("s", 1, 2, 0.0)


# -- channels back after a restart (the same secret) -------------------------------------------------

SECRET = bytes(range(32))


def test_tokens_are_the_secret_s_signature_of_channel_and_leg() -> None:
    relay = RelayTable(Limits(), SECRET, random_id=lambda: 7)
    ch = relay.allocate("4-k7m2", 1, 2, 0.0)
    assert [leg.token for leg in ch.legs] == [leg_token(SECRET, 7, 0), leg_token(SECRET, 7, 1)]
    assert len({leg_token(SECRET, 7, 0), leg_token(SECRET, 7, 1), leg_token(SECRET, 8, 0)}) == 3
    assert leg_token(bytes(32), 7, 0) != leg_token(SECRET, 7, 0)


def test_a_restarted_relay_with_the_same_secret_takes_a_channel_back_from_both_legs() -> None:
    before = RelayTable(Limits(), SECRET, started=0.0, random_id=lambda: 41)
    ch = before.allocate("4-k7m2", 1, 2, 0.0)
    tokens = [leg.token for leg in ch.legs]
    after = RelayTable(Limits(), SECRET, started=1000.0)  # a new process: nothing of `before` is left
    ack = after.bind(udp.RelayBind(41, tokens[1]), B, 1, 1005.0)
    assert ack == udp.RelayBindAck(41, False, B)  # back, waiting for the other leg
    assert after.forward(41, B, 100, 1005.0) is Drop.PEER_UNBOUND
    assert after.bind(udp.RelayBind(41, tokens[0]), A, 0, 1006.0) == udp.RelayBindAck(41, True, A)
    assert after.forward(41, A, 1200, 1006.0) == (B, 1)
    assert after.forward(41, B, 800, 1006.0) == (A, 0)
    assert after.totals.recovered == 1 and len(after.channels) == 1
    assert after.bind(udp.RelayBind(41, b"\0" * udp.TOKEN_BYTES), EVE, 0, 1007.0) == udp.RelayBindError(
        41, ErrorCode.BAD_TOKEN, "token does not match either leg"
    )
    # a new allocation never takes the recovered id; the recovered channel expires when idle
    assert after.allocate("5-abcd", 1, 2, 1008.0).id != 41
    assert 41 not in {c.id for c in after.expire(1006.0 + Limits().relay_idle_s - 1)}
    assert 41 in {c.id for c in after.expire(1006.0 + Limits().relay_idle_s)}


@pytest.mark.parametrize(
    "secret, now, why",
    [
        (bytes(32), 1005.0, "another secret"),
        (SECRET, 1000.0 + Limits().relay_recover_s, "the recovery window has passed"),
        (None, 1005.0, "no secret kept: a random one"),
    ],
)
def test_an_unknown_channel_stays_unknown_without_the_secret_or_after_the_window(
    secret: bytes | None, now: float, why: str
) -> None:
    token = leg_token(SECRET, 41, 0)
    after = RelayTable(Limits(), secret, started=1000.0)
    reply = after.bind(udp.RelayBind(41, token), A, 0, now)
    assert isinstance(reply, udp.RelayBindError) and reply.code is ErrorCode.UNKNOWN_CHANNEL, why
    assert after.channels == {} and after.totals.recovered == 0


def test_recovery_respects_the_channel_limit_and_can_be_turned_off() -> None:
    full = RelayTable(dataclasses.replace(Limits(), relay_channels=1), SECRET, started=0.0)
    full.allocate("s", 1, 2, 0.0)
    reply = full.bind(udp.RelayBind(41, leg_token(SECRET, 41, 0)), A, 0, 1.0)
    assert isinstance(reply, udp.RelayBindError) and full.totals.recovered == 0
    off = RelayTable(dataclasses.replace(Limits(), relay_recover_s=0.0), SECRET, started=0.0)
    reply = off.bind(udp.RelayBind(41, leg_token(SECRET, 41, 0)), A, 0, 0.0)
    assert isinstance(reply, udp.RelayBindError)
    with pytest.raises(ValueError, match="relay secret has 8 bytes"):
        RelayTable(Limits(), bytes(8))
