"""Traces to Prometheus blocks: the OpenMetrics text `fleet traces` writes, checked by the real promtool
(metric lint, blocks), and a real Prometheus on those blocks answering every Bench run query."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ops.fleetfile import parse
from ops.observe import openmetrics
from tests.obs.promtool import check_metrics, needs_promtool
from tests.obs.test_trace import request, session, stage
from tests.ops.backfill import PROMETHEUS, bench_run_answers
from tests.ops.test_actions import fleet_text


def records() -> dict[str, list[dict[str, object]]]:
    return {
        "gpu": [session().to_json(), request(1, (10.0, 12.0, 30.0)).to_json(), stage(1, "a", 11.0).to_json()],
        "cpu-box": [stage(1, "b", 12.5).to_json()],
    }


def test_every_request_and_stage_is_one_series_stamped_with_the_collection_time() -> None:
    fleet = parse(fleet_text(), "f.toml")
    text = openmetrics(fleet, records(), 1_700_000_000.0)
    assert text.endswith("# EOF\n")
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    tps = [line for line in lines if line.startswith("kafila_trace_request_decode_tokens_per_second{")]
    assert tps == [
        'kafila_trace_request_decode_tokens_per_second{fleet="f1",collected_from="gpu",session="s1",'
        'member="b",request="1",epoch="1"} 10 1700000000.000'
    ]  # 10 tokens after the first over 1 s of decode

    def values(name: str) -> list[str]:
        return sorted(line.split("} ")[1] for line in lines if line.startswith(name + "{"))

    # base units: the records' milliseconds as seconds
    assert values("kafila_trace_stage_decode_seconds") == ["0.011 1700000000.000", "0.0125 1700000000.000"]
    assert values("kafila_trace_request_circuit_seconds") == ["0.044 1700000000.000"]
    assert values("kafila_trace_stage_prefill_seconds") == ["0.01 1700000000.000"] * 2  # 4 + 6 ms
    assert values("kafila_trace_request_ttft_seconds") == ["0.75 1700000000.000"]
    assert values("kafila_trace_hop_bytes") == ["4000 1700000000.000"] * 2  # each hop once: its sender's
    hops = [line for line in lines if line.startswith("kafila_trace_hop_rtt_seconds{")]
    assert hops[0].startswith(
        'kafila_trace_hop_rtt_seconds{fleet="f1",collected_from="cpu-box",session="s1",hop="b->c",'
        'path="relay",request="1",epoch="1"} 0.025 '
    )
    waits = [line for line in lines if line.startswith("kafila_trace_stage_wait_seconds{")]
    assert any('member="a",stage="0",request="1",epoch="1"} 0.0011 ' in line for line in waits), waits


def test_records_of_a_later_epoch_are_kept_apart_by_their_epoch_label() -> None:
    """After a re-plan a stage's figures belong to another division: the Bench run averages per
    epoch, so the backfill labels every request, stage and hop series with the record's epoch."""
    from dataclasses import replace

    fleet = parse(fleet_text(), "f.toml")
    later = {
        "gpu": [
            replace(stage(2, "a", 9.0), epoch=2).to_json(),
            replace(request(2, (1.0, 2.0, 3.0)), epoch=2).to_json(),
        ]
    }
    lines = [
        line for line in openmetrics(fleet, later, 0.0).splitlines() if line and not line.startswith("#")
    ]
    assert lines and all('epoch="2"' in line for line in lines), lines


@needs_promtool
def test_the_backfill_passes_promtools_metric_lint() -> None:
    """promtool's `check metrics` (Prometheus's naming conventions) on the backfill's families: the
    text format without the OpenMetrics timestamps and end marker, which it does not read."""
    text = openmetrics(parse(fleet_text(), "f.toml"), records(), 1_700_000_000.0)
    plain = [line.rsplit(" ", 1)[0] if not line.startswith("#") else line for line in text.splitlines()]
    assert check_metrics("\n".join(line for line in plain if line != "# EOF").encode() + b"\n") == ""


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (apt-get install prometheus) is missing"
)
def test_promtool_turns_it_into_tsdb_blocks(tmp_path: Path) -> None:
    fleet = parse(fleet_text(), "f.toml")
    om = tmp_path / "t.om"
    om.write_text(openmetrics(fleet, records(), time.time()))
    done = subprocess.run(
        ["promtool", "tsdb", "create-blocks-from", "openmetrics", str(om), str(tmp_path / "tsdb")],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert list((tmp_path / "tsdb").glob("*/meta.json")), done.stdout
    if PROMETHEUS is None:
        pytest.skip("prometheus is not installed (apt-get install --no-install-recommends prometheus)")
    answers = bench_run_answers(tmp_path / "tsdb")
    assert answers and all(answers.values()), answers  # every Bench run query returns data


def test_monitor_writes_its_targets_where_prometheus_reads_them() -> None:
    """The default targets file matches a file_sd glob of prometheus/prometheus.yml (whose paths are
    relative to that file's folder), and never the monitor's own temporary file."""
    import fnmatch

    import yaml

    from ops.observe import default_targets

    root = Path(__file__).resolve().parents[2]
    config = yaml.safe_load((root / "prometheus" / "prometheus.yml").read_text())
    [members] = [j for j in config["scrape_configs"] if j["job_name"] == "kafila-members"]
    globs = [g for sd in members["file_sd_configs"] for g in sd["files"]]
    path = default_targets(parse(fleet_text(), "f.toml"))
    assert path == Path("prometheus/targets/f1.json")
    relative = str(path.relative_to("prometheus"))
    assert any(fnmatch.fnmatch(relative, g) for g in globs), globs
    assert not any(fnmatch.fnmatch(relative + ".tmp", g) for g in globs)


def test_tunnels_listen_where_asked_and_the_targets_name_that_address() -> None:
    from ops.observe import address_literal
    from ops.remote import Remote, tunnel_argv

    fleet = parse(fleet_text(), "f.toml")
    argv = tunnel_argv(Remote(fleet), fleet.hosts[0], 4000, "127.0.0.1:9464", "172.17.0.1")
    assert argv[-3:] == ["-L", "172.17.0.1:4000:127.0.0.1:9464", fleet.hosts[0].ssh]
    assert (
        tunnel_argv(Remote(fleet), fleet.hosts[0], 4000, "127.0.0.1:9464")[-2]
        == "127.0.0.1:4000:127.0.0.1:9464"
    )
    assert address_literal("172.17.0.1") == "172.17.0.1" and address_literal("::1") == "[::1]"


def test_the_bridge_address_is_read_from_the_interface_and_a_missing_one_is_named() -> None:
    from ops.observe import bridge_address
    from ops.remote import OpsError

    if shutil.which("ip") is None:
        pytest.skip("no `ip` command (iproute2)")
    assert bridge_address("lo") == "127.0.0.1"  # a real interface read the same way as docker0
    with pytest.raises(OpsError, match="no IPv4 address on kafila-none0"):
        bridge_address("kafila-none0")
