"""Metrics fed from trace records and session state: names, units, labels, and promtool's lint."""

from __future__ import annotations

from dataclasses import replace

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kafila.obs import metrics
from kafila.obs.listener import parse_addr, serve_metrics
from kafila.obs.trace import HopTrace
from kafila.proto import tensor as t
from kafila.session.channel import MemoryChannel
from kafila.session.ring.info import RingInfo
from kafila.session.ring.stagetrace import StageTally
from tests.obs.promtool import check_metrics, needs_promtool
from tests.obs.test_trace import request, session, stage


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition by (name, labels without the session identity)."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = frozenset((k, v) for k, v in s.labels.items() if k not in ("session", "model"))
            out[(s.name, labels)] = s.value
    return out


def value(text: str, name: str, **labels: str) -> float:
    return samples(text).get((name, frozenset(labels.items())), 0.0)


def test_request_and_session_records_feed_the_request_series() -> None:
    metrics.observe_session(session())
    before = metrics.exposition().decode()
    metrics.observe_first_token(queue_s=0.5, prefill_s=0.25, prompt_tokens=5)  # as the first token came
    metrics.observe_tokens(1)
    for interval in [0.1] * 9 + [1.1]:  # ten intervals between eleven tokens, one of them a stall
        metrics.observe_token_interval(interval)
        metrics.observe_tokens(1)
    running = metrics.exposition().decode()  # the request runs on: its tokens are counted already
    metrics.observe_request(request(7, (10, 12, 21), 2.0))
    text = metrics.exposition().decode()
    e1 = {"epoch": "1"}
    assert value(text, "kafila_stage_measured_seconds", member="b", stage="1", **e1) == pytest.approx(0.012)
    assert value(text, "kafila_stage_predicted_seconds", member="c", stage="2", **e1) == pytest.approx(0.020)
    assert value(text, "kafila_stage_prediction_ratio", member="c", stage="2", **e1) == pytest.approx(21 / 20)
    assert value(text, "kafila_decode_tokens_per_second") == pytest.approx(5.0)
    assert value(text, "kafila_predicted_bottleneck_seconds") == pytest.approx(0.020)
    assert value(text, "kafila_ring_transit_seconds") == pytest.approx(0.003)
    blocks = {"member": "b", "stage": "1", "first_block": "3", "last_block": "6", "epoch": "1"}
    assert value(text, "kafila_stage_blocks", **blocks) == 3

    def grew(name: str, **labels: str) -> float:
        return value(text, name, **labels) - value(before, name, **labels)

    assert grew("kafila_prompt_tokens_total") == 5 and grew("kafila_generation_tokens_total") == 11
    for counted in ("kafila_prompt_tokens_total", "kafila_generation_tokens_total"):  # not again at its end
        assert value(running, counted) == value(text, counted), counted
    assert grew("kafila_requests_total", finished_reason="stop") == 1
    assert grew("kafila_time_to_first_token_seconds_sum") == pytest.approx(0.75)
    assert grew("kafila_e2e_request_latency_seconds_sum") == pytest.approx(2.75)
    assert grew("kafila_request_queue_time_seconds_count") == 1
    # each interval as its token came: the stall is in the tail, not spread over the mean
    assert grew("kafila_inter_token_latency_seconds_count") == 10
    assert grew("kafila_inter_token_latency_seconds_sum") == pytest.approx(2.0)
    assert grew("kafila_inter_token_latency_seconds_bucket", le="0.25") == 9
    assert grew("kafila_inter_token_latency_seconds_bucket", le="1.0") == 9
    assert not [k for k in samples(text) if k[0].endswith("_created")]  # no _created series


def ring_info(blocks: dict[str, tuple[int, int]], paths: dict[str, str] | None = None) -> RingInfo:
    """Member a's view (the head) of a ring of `blocks`' members in that order, every edge planned direct."""
    order = tuple(blocks)
    planned = {f"{m}->{order[(i + 1) % len(order)]}": "direct" for i, m in enumerate(order)}
    predicted = {m: 10.0 * (b - a) for m, (a, b) in blocks.items()}
    return RingInfo("s1", "tiny", "kafila", order, blocks, predicted, planned | (paths or {}), planned)


def head_document(info: RingInfo, epoch: int, state: str = "serving") -> dict[str, object]:
    """The /session document the head's role gives for `info` at `epoch` (RoleBase.document)."""
    return info.document(state, None) | {"epoch": epoch, "me": info.order[0], "head": info.order[0]}


def test_every_series_of_the_ring_is_rebuilt_at_each_epoch_and_the_lost_members_removed() -> None:
    four = {"a": (0, 3), "b": (3, 6), "c": (6, 9), "d": (9, 12)}
    metrics.observe_document(head_document(ring_info(four), 1))
    metrics.observe_step("d", 3, 0.02, prefill=False)
    metrics.observe_stage(replace(stage(1, "c", 20.0), hop_out=HopTrace("c", "d", "direct", 10, 1, 2.0, 1.0)))
    metrics.observe_hop_transfer("c->d", "direct", 0.004)
    metrics.observe_edge(
        "c->d", "direct", "relay", measured_by="c"
    )  # d died: c's link fell back to the relay
    before = metrics.exposition().decode()
    assert value(before, "kafila_session_members_present") == 4
    assert value(before, "kafila_hop_transfer_seconds_count", hop="c->d", path="direct") == 1
    assert value(before, "kafila_edge_info", edge="c->d", planned_path="direct", path="relay",
                 measured_by="c", epoch="1") == 1  # fmt: skip

    three = {"a": (0, 4), "b": (4, 8), "c": (8, 12)}
    metrics.observe_document(head_document(ring_info(three), 2))
    metrics.observe_edge("c->d", "direct", "relay", measured_by="c")  # the old link's callback, late
    text = metrics.exposition().decode()
    got = samples(text)
    assert (
        value(text, "kafila_session_members_present"),
        value(text, "kafila_session_members_expected"),
    ) == (3, 4)
    assert value(text, "kafila_plan_epoch") == 2
    assert value(text, "kafila_replans_total") - value(before, "kafila_replans_total") == 1
    stages = sorted((dict(k[1]) for k in got if k[0] == "kafila_stage_blocks"), key=lambda d: d["stage"])
    assert [(s["member"], s["stage"], s["first_block"], s["last_block"], s["epoch"]) for s in stages] == [
        ("a", "0", "0", "4", "2"), ("b", "1", "4", "8", "2"), ("c", "2", "8", "12", "2")
    ]  # fmt: skip
    edges = sorted(
        (d["edge"], d["path"], d["epoch"]) for k in got if k[0] == "kafila_edge_info" for d in [dict(k[1])]
    )
    assert edges == [("a->b", "direct", "2"), ("b->c", "direct", "2"), ("c->a", "direct", "2")]
    predicted = {dict(k[1])["member"]: v for k, v in got.items() if k[0] == "kafila_stage_predicted_seconds"}
    assert predicted == {"a": pytest.approx(0.04), "b": pytest.approx(0.04), "c": pytest.approx(0.04)}
    gone = [k for k in got if ("member", "d") in k[1] or any(v.endswith("->d") or v.startswith("d->")
                                                            for _, v in k[1])]  # fmt: skip
    assert gone == []  # d's stage, its edges, hops and round trips
    assert not [k for k in got if k[0].startswith("kafila_stage_") and ("epoch", "1") in k[1]]
    metrics.observe_step("d", 3, 0.02, prefill=False)  # a late step of the old ring's stage
    metrics.observe_hop_transfer("c->d", "direct", 0.004)  # a late frame of the old ring's edge
    metrics.observe_hop_transfer("c->a", "direct", 0.003)  # the new ring's edge
    text = metrics.exposition().decode()
    assert value(text, "kafila_stage_compute_seconds_count", member="d", stage="3", phase="decode") == 0
    assert value(text, "kafila_hop_transfer_seconds_count", hop="c->d", path="direct") == 0
    assert value(text, "kafila_hop_transfer_seconds_count", hop="c->a", path="direct") == 1

    metrics.observe_document(head_document(ring_info(three), 2) | {"spares": ["d"]})  # d back, as a spare
    assert value(metrics.exposition().decode(), "kafila_session_spares") == 1
    metrics.observe_document(head_document(ring_info(four), 3) | {"spares": []})  # d planned in
    text = metrics.exposition().decode()
    assert (
        value(text, "kafila_session_members_present"),
        value(text, "kafila_session_members_expected"),
    ) == (4, 4)
    metrics.observe_document(head_document(ring_info(four), 3, state="broken"))
    assert value(metrics.exposition().decode(), "kafila_session_members_present") == 0


def test_every_series_carries_the_session_and_the_model() -> None:
    metrics.observe_session(session())
    for family in text_string_to_metric_families(metrics.exposition().decode()):
        for s in family.samples:
            assert (s.labels.get("session"), s.labels.get("model")) == ("s1", "tiny"), s


async def test_stage_records_count_each_hop_at_its_sender_and_measure_the_edge_path() -> None:
    metrics.observe_session(session())  # plans c->a direct
    hop = {"hop": "c->a", "path": "local"}  # in-process channels: the path "local"
    before = metrics.exposition().decode()
    to_a, at_a = MemoryChannel.pair("c", "a")
    tally = StageTally(
        ring_info({"a": (0, 3), "b": (3, 6), "c": (6, 9)}), 2, to_a, to_a
    )  # member c's steps, observed as they run, and the frames it sends on to a as they leave
    entries = (t.Entry(8, 0, 1), t.Entry(9, 0, 1))  # a frame of two requests' decode steps
    frame = t.Hidden(step=0, dtype=t.DType.F32, shape=(2, 4), entries=entries, data=bytes(32))
    for _ in range(9):
        tally.add(8, 21_500, prefill=False)
        await to_a.send(frame)
        await at_a.recv()
    sent = to_a.counters.bytes_sent  # the frames' bytes as encoded
    await to_a.send(t.Control("beat"))  # not a hidden-state frame: no hop bytes
    tally.add(8, 4000, prefill=True)
    tally.add(8, 6000, prefill=True)
    running = metrics.exposition().decode()  # the requests run on
    assert (
        value(running, "kafila_hop_bytes_total", **hop) - value(before, "kafila_hop_bytes_total", **hop)
        == sent
    )
    assert (
        value(running, "kafila_hop_messages_total", **hop) - value(before, "kafila_hop_messages_total", **hop)
        == 9 * 2
    )  # once per request a frame carries
    metrics.observe_request(request(8, (10, 12, 21)))  # the head's ring view adds no hop bytes
    metrics.observe_stage(stage(8, "c", 21.5, bytes_out=4096))  # nor does the stage's record
    text = metrics.exposition().decode()
    assert value(text, "kafila_hop_bytes_total", **hop) == value(running, "kafila_hop_bytes_total", **hop)
    metrics.observe_hop_frame(
        "c->a", "relay", 100, 1, rtt_s=0.031
    )  # a frame over a link, its round trip then
    assert value(metrics.exposition().decode(), "kafila_hop_rtt_seconds", hop="c->a", path="relay") == 0.031
    metrics.observe_hop_frame("c->a", "direct", 100, 1, rtt_s=0.012)  # back on its direct path
    moved = metrics.exposition().decode()
    assert value(moved, "kafila_hop_rtt_seconds", hop="c->a", path="direct") == 0.012
    assert not [k for k in samples(moved) if k[0] == "kafila_hop_rtt_seconds" and ("path", "relay") in k[1]]
    hop = {"hop": "c->a", "path": "relay"}
    assert value(text, "kafila_hop_rtt_seconds", **hop) == pytest.approx(0.025)
    assert value(text, "kafila_hop_predicted_rtt_seconds", hop="c->a", epoch="1") == pytest.approx(0.020)
    assert value(text, "kafila_stage_wait_seconds", member="c", stage="2", epoch="1") == pytest.approx(
        0.00215
    )
    decode = {"member": "c", "stage": "2", "phase": "decode"}
    prefill = {**decode, "phase": "prefill"}
    assert (
        value(text, "kafila_stage_compute_seconds_count", **decode)
        - value(before, "kafila_stage_compute_seconds_count", **decode)
        == 9
    )  # one per decode step
    assert (
        value(text, "kafila_stage_compute_seconds_count", **prefill)
        - value(before, "kafila_stage_compute_seconds_count", **prefill)
        == 2
    )  # one per prefill chunk
    # the edge the plan made direct ran through the relay, as c (its sender) measured
    relayed = {"edge": "c->a", "planned_path": "direct", "path": "relay", "measured_by": "c", "epoch": "1"}
    assert value(text, "kafila_edge_info", **relayed) == 1
    assert value(text, "kafila_edge_info", edge="a->b", planned_path="direct", path="direct",
                 measured_by="predicted", epoch="1") == 1  # fmt: skip
    assert not [k for k in samples(text) if k[0] == "kafila_edge_info" and ("edge", "c->a") in k[1]
                and ("measured_by", "predicted") in k[1]]  # fmt: skip


def test_session_state_queue_cache_plan_and_nat() -> None:
    metrics.observe_state("replanning")
    metrics.observe_plan(1)
    before = metrics.exposition().decode()
    metrics.observe_plan(2)
    metrics.observe_plan(2)  # the same epoch again is no new plan
    metrics.observe_queue(running=2, waiting=5)
    metrics.observe_slots(used=3, total=4)
    metrics.observe_kv_bytes("b", used=300, held=1200)
    metrics.observe_members(expected=3, present=2)
    metrics.observe_member_nat("b", "ordinary", "endpoint-independent")
    metrics.observe_member_nat("b", "restrictive", "endpoint-dependent")  # a later probe replaces it
    text = metrics.exposition().decode()
    assert value(text, "kafila_session_state", state="replanning") == 1
    assert value(text, "kafila_session_state", state="serving") == 0 and value(text, "kafila_ready") == 0
    assert value(text, "kafila_replans_total") - value(before, "kafila_replans_total") == 1
    assert value(text, "kafila_plan_epoch") == 2
    assert (value(text, "kafila_num_requests_running"), value(text, "kafila_num_requests_waiting")) == (2, 5)
    assert value(text, "kafila_request_slots_used") == 3 and value(text, "kafila_request_slots") == 4
    assert value(text, "kafila_kv_cache_usage_perc", member="b") == 0.25
    assert value(text, "kafila_kv_cache_bytes", member="b") == 1200
    assert (
        value(text, "kafila_session_members_expected"),
        value(text, "kafila_session_members_present"),
    ) == (3, 2)
    nat = [k for k in samples(text) if k[0] == "kafila_member_nat_info" and ("member", "b") in k[1]]
    assert nat == [("kafila_member_nat_info", frozenset({("member", "b"), ("nat_class", "restrictive"),
                                                          ("mapping", "endpoint-dependent")}))]  # fmt: skip
    metrics.observe_document({"state": "broken", "active": [], "queued": 0})
    text = metrics.exposition().decode()
    assert value(text, "kafila_session_state", state="broken") == 1 and value(text, "kafila_ready") == 0
    assert value(text, "kafila_session_members_present") == 0
    assert value(text, "kafila_num_requests_waiting") == 0
    kv = {"used_bytes": 64, "bytes": 1024}
    metrics.observe_document(
        {"state": "serving", "active": [4, 5], "queued": 1, "slots": 8, "me": "a", "kv": kv}
    )
    text = metrics.exposition().decode()
    assert value(text, "kafila_request_slots_used") == 2 and value(text, "kafila_request_slots") == 8
    assert value(text, "kafila_kv_cache_used_bytes", member="a") == 64
    assert value(text, "kafila_kv_cache_usage_perc", member="a") == 1 / 16
    assert not [k for k in samples(text) if k[0] == "kafila_kv_cache_bytes" and ("member", "b") in k[1]]


def test_bad_state_and_cache_figures_are_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="'starting' is not one of forming, spare, serving"):
        metrics.observe_state("starting")
    with pytest.raises(ValueError, match="5 used of 4"):
        metrics.observe_slots(5, 4)
    with pytest.raises(ValueError, match="KV cache of b: 5 bytes used is not within the 4 bytes held"):
        metrics.observe_kv_bytes("b", 5, 4)


def test_build_info_and_process_series() -> None:
    metrics.observe_build("torch", "float32", "cpu")
    text = metrics.exposition().decode()
    builds = [k for k in samples(text) if k[0] == "kafila_build_info"]
    assert [dict(k[1]) for k in builds] == [{"version": "0.1.0", "backend": "torch", "dtype": "float32",
                                             "device": "cpu"}]  # fmt: skip
    assert value(text, "process_resident_memory_bytes") > 0
    assert "process_cpu_seconds_total" in text


@needs_promtool
def test_promtool_finds_the_fed_metrics_clean() -> None:
    metrics.observe_session(session())
    metrics.observe_request(request(9, (10, 12, 21)))
    metrics.observe_stage(stage(9, "c", 21.5))
    metrics.observe_queue(1, 0)
    metrics.observe_slots(1, 2)
    metrics.observe_kv_bytes("a", 10, 100)
    assert check_metrics(metrics.exposition()) == ""


def test_the_listener_serves_the_registry_on_its_own_port_while_the_session_reads_broken() -> None:
    """No API, no event loop: the listener thread serves the registry, and a /session document
    that says broken is read at every scrape (the ring's state reaches Prometheus)."""
    metrics.set_source(lambda: {"state": "broken"})
    listener = serve_metrics("127.0.0.1:0")
    try:
        text = httpx.get(listener.url, timeout=10).text
        assert value(text, "kafila_session_state", state="broken") == 1
        metrics.set_source(lambda: {"state": "serving"})
        text = httpx.get(listener.url, timeout=10).text
        assert value(text, "kafila_session_state", state="serving") == 1 and value(text, "kafila_ready") == 1
        metrics.set_source(lambda: 1 / 0)  # type: ignore[arg-type,return-value]  # a failing source
        assert httpx.get(listener.url, timeout=10).status_code == 200
    finally:
        metrics.set_source(None)
        listener.close()
    with pytest.raises(httpx.ConnectError):
        httpx.get(listener.url, timeout=2)


def test_metrics_addresses() -> None:
    assert parse_addr("0.0.0.0:9464") == ("0.0.0.0", 9464)
    assert parse_addr(":9464") == ("127.0.0.1", 9464) and parse_addr("9464") == ("127.0.0.1", 9464)
    assert parse_addr("[::1]:9") == ("::1", 9)
    with pytest.raises(ValueError, match="'host:x' is not HOST:PORT"):
        parse_addr("host:x")
    with pytest.raises(ValueError, match="port 70000"):
        parse_addr("h:70000")


def test_a_taken_port_is_named() -> None:
    first = serve_metrics("127.0.0.1:0")
    try:
        with pytest.raises(OSError, match=f"cannot bind 127.0.0.1:{first.port}"):
            serve_metrics(f"127.0.0.1:{first.port}")
    finally:
        first.close()


def test_a_forming_members_metrics_say_forming() -> None:
    from starlette.testclient import TestClient

    from kafila.api.forming import FormingStatus, forming_app

    metrics.observe_state("serving")
    with TestClient(forming_app(FormingStatus("join"))) as client:
        text = client.get("/metrics").text
    assert value(text, "kafila_session_state", state="forming") == 1 and value(text, "kafila_ready") == 0
    status = FormingStatus("join", name="m2", model="tiny", session="s9", members_expected=4)
    with TestClient(forming_app(status)) as client:
        text = client.get("/metrics").text
    families = list(text_string_to_metric_families(text))
    expected = next(f for f in families if f.name == "kafila_session_members_expected").samples
    assert [(s.labels, s.value) for s in expected] == [({"session": "s9", "model": "tiny"}, 4)]


def test_a_spares_metrics_say_spare_not_forming() -> None:
    """A spare waits for as long as the ring does without it: read as "forming", it fired
    KafilaSessionStuckForming after 15 minutes."""
    from starlette.testclient import TestClient

    from kafila.api.forming import FormingStatus, forming_app

    status = FormingStatus("join", name="slow", model="tiny", session="s9", members_expected=2)
    status.spare, status.host = "time per token 15.0% worse with a new plan", "alpha"
    metrics.set_identity("", "")  # its first scrape comes when it is a spare already
    with TestClient(forming_app(status)) as client:
        text = client.get("/metrics").text
    assert value(text, "kafila_session_state", state="spare") == 1
    assert value(text, "kafila_session_state", state="forming") == 0 and value(text, "kafila_ready") == 0
    families = {f.name: f.samples for f in text_string_to_metric_families(text)}
    [expected] = families["kafila_session_members_expected"]
    assert (expected.labels, expected.value) == ({"session": "s9", "model": "tiny"}, 2)
    state = families["kafila_session_state"] + families["kafila_ready"]
    labelled = [s.labels.get("session") for s in state]
    assert set(labelled) == {"s9"}


def test_a_record_of_another_session_starts_the_ring_series_afresh_rather_than_being_dropped() -> None:
    """A process serves one session; where a record names another (a test process serves many),
    the series describe that one from then on instead of leaving its stages out."""
    metrics.observe_session(session())  # a, b, c of s1
    metrics.observe_stage(replace(stage(3, "b", 12.0), session="s7", member="m1"))
    text = metrics.exposition().decode()
    assert value(text, "kafila_stage_measured_seconds", member="m1", stage="1", epoch="1") == pytest.approx(
        0.012
    )
    assert not [k for k in samples(text) if k[0] == "kafila_stage_blocks"]  # s1's ring is not s7's
