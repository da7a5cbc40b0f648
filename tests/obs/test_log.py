import io
import json
import sys

import pytest

from kafila.obs.log import configure_logging, get_logger


def test_logger_writes_to_the_current_stderr_even_after_the_old_one_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    configure_logging("json")
    log = get_logger("kafila.test")
    log.info("first", n=1)
    first.close()  # as pytest does with its capture between tests
    second = io.StringIO()
    monkeypatch.setattr(sys, "stderr", second)
    log.info("second", n=2)
    event = json.loads(second.getvalue())
    assert event["event"] == "second" and event["n"] == 2 and event["level"] == "info"


def test_level_filters_events(monkeypatch: pytest.MonkeyPatch) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    configure_logging("json", level="warning")
    get_logger("kafila.test").info("hidden")
    get_logger("kafila.test").warning("shown")
    assert [json.loads(line)["event"] for line in out.getvalue().splitlines()] == ["shown"]
