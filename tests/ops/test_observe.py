"""Traces to Prometheus blocks: the OpenMetrics text `fleet traces` writes, checked by the real promtool."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path

import pytest

from ops.fleetfile import parse
from ops.observe import openmetrics
from tests.obs.test_trace import request, session, stage
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
    tps = [line for line in lines if line.startswith("kafila_trace_request_tokens_per_second{")]
    assert tps == [
        'kafila_trace_request_tokens_per_second{fleet="f1",collected_from="gpu",session="s1",member="b",'
        'request="1"} 10 1700000000.000'
    ]  # 10 tokens after the first over 1 s of decode
    decode = sorted(line.split("} ")[1] for line in lines if line.startswith("kafila_trace_stage_decode_ms{"))
    assert decode == ["11 1700000000.000", "12.5 1700000000.000"]


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
