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


class _Costly:
    """A local whose repr must not be taken: rendering a traceback with every frame's locals walked
    a failed member task's whole model and session state."""

    def __repr__(self) -> str:
        raise AssertionError("a traceback rendered a frame's locals")


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_an_error_with_its_exception_logs_the_traceback_as_text_without_the_frames_locals(
    monkeypatch: pytest.MonkeyPatch, fmt: str
) -> None:
    out = io.StringIO()
    monkeypatch.setattr(sys, "stderr", out)
    configure_logging(fmt)

    def fails(state: _Costly) -> None:
        raise RuntimeError("the task failed")

    try:
        fails(_Costly())
    except RuntimeError as exc:
        get_logger("kafila.test").error("task_failed", exc_info=exc)
    text = out.getvalue()
    assert "Traceback (most recent call last)" in text and "RuntimeError: the task failed" in text
    if fmt == "json":
        assert "the task failed" in json.loads(text)["exception"]
