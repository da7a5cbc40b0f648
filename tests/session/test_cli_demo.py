"""`kafila demo` refuses bad flags at the parser, and ends every later failure (an unusable workdir
or model, a member or the rendezvous exiting, the API refusing the question) in one line naming it,
never a traceback or a silent exit 0."""

from __future__ import annotations

import asyncio
import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kafila.cli import demo
from kafila.demo.fleet import DEFAULT_NAMES
from tests.api.served import MODEL, serve_ring


def kafila_demo(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kafila", "demo", *argv], capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("a,b", "got 'a' in 'a,b'"),
        (",", "got '' in ','"),
        ("1,0", "got '0' in '1,0'"),
        ("1,2", "got '2' in '1,2'"),
        ("nan", "got 'nan' in 'nan'"),
        ("inf", "got 'inf' in 'inf'"),
        ("0.001", "got '0.001' in '0.001'"),
    ],
)
def test_a_share_that_is_not_a_fraction_of_one_cpu_is_refused_by_the_parser(value: str, named: str) -> None:
    done = kafila_demo("--shares", value)
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stdout == ""
    assert (
        f"argument --shares: each share must be a number from 0.01 to 1 (a fraction of one CPU), {named}"
        in (done.stderr)
    )


def test_more_members_than_the_demo_names_are_refused_by_the_parser() -> None:
    assert len(DEFAULT_NAMES) == demo.MAX_MEMBERS
    nine = ",".join(["1"] * (demo.MAX_MEMBERS + 1))
    done = kafila_demo("--shares", nine)
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stdout == ""
    assert (
        f"argument --shares: 9 shares, one per member, but the demo runs at most 8 members, got '{nine}'"
        in (done.stderr)
    )
    assert demo.shares_list(",".join(["0.5"] * demo.MAX_MEMBERS)) == (0.5,) * 8
    assert demo.shares_list("1, 0.5,0.01") == (1.0, 0.5, 0.01)


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ("0", "must be a whole number >= 1, got '0'"),
        ("-3", "must be a whole number >= 1, got '-3'"),
        ("512", "must be below the demo's context of 512 tokens (prompt plus answer), got '512'"),
    ],
)
def test_max_tokens_must_fit_the_demo_context(value: str, named: str) -> None:
    done = kafila_demo("--max-tokens", value)
    assert done.returncode == 2 and "Traceback" not in done.stderr and done.stdout == ""
    assert f"argument --max-tokens: {named}" in done.stderr
    assert demo.answer_tokens("511") == 511


def test_an_unusable_workdir_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    file = tmp_path / "file"
    file.write_text("not a folder")
    for workdir, named in [
        (file, f"--workdir '{file}' is not a folder"),
        (
            file / "sub",
            f"--workdir '{file}/sub' cannot hold the demo's logs and traces: [Errno 20] Not a directory",
        ),
        (Path("/proc/nope"), "--workdir '/proc/nope' cannot hold the demo's logs and traces: [Errno 2]"),
    ]:
        done = kafila_demo("--workdir", str(workdir))
        assert done.returncode == 1 and "Traceback" not in done.stderr and done.stdout == ""
        assert done.stderr.strip().splitlines() == [done.stderr.strip()]  # one line
        assert f"kafila demo: error: {named}" in done.stderr


def test_an_unknown_model_is_one_line_before_anything_starts(tmp_path: Path) -> None:
    done = kafila_demo("--model", "no-such-model", "--workdir", str(tmp_path))
    assert done.returncode == 1 and "Traceback" not in done.stderr and done.stdout == ""
    assert "kafila demo: error: --model 'no-such-model': unknown model 'no-such-model'" in done.stderr


def test_a_run_starts_with_no_logs_or_traces_of_an_earlier_run(tmp_path: Path) -> None:
    """Members append to their trace file: the workdir, reused by default, would mix runs."""
    earlier = [
        tmp_path / f"{name}{suffix}" for name in ("alpha", "theta") for suffix in (".log", ".trace.jsonl")
    ]
    for path in [*earlier, tmp_path / "rendezvous.log"]:
        path.write_text('{"stale": true}\n')
    (tmp_path / "notes.txt").write_text("mine")
    assert demo.prepare_workdir(tmp_path) == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert demo.prepare_workdir(tmp_path / "new" / "run").is_dir()


def test_help_says_how_many_members_the_defaults_and_what_each_division_means() -> None:
    done = kafila_demo("--help")
    text = " ".join(done.stdout.split())
    assert done.returncode == 0
    assert "one member per --shares entry (three by default, at most 8)" in text
    assert "1 to 8 (default 1,0.5,0.25: three members)" in text
    assert "(default /tmp/kafila-demo); each run first removes the previous run's logs and traces" in text
    assert "kafila (default: by the cost model" in text and "uniform (equal counts)" in text
    assert "memory (in proportion to each member's memory)" in text
    assert "answer length limit, 1 to 511 (default 48)" in text


def test_the_question_names_the_head_itself_in_a_fleet_of_one() -> None:
    assert demo.asking("alpha", "alpha") == "asking alpha (the head itself: the only member)"
    assert demo.asking("beta", "alpha") == "asking beta (not the head: it forwards to alpha)"


@pytest.mark.network
async def test_the_api_refusing_the_question_is_its_message_not_an_empty_answer(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """A real two-member ring serving the API on loopback (context 256): a question whose answer
    cannot fit is refused with a 400, which the demo shows instead of printing nothing."""
    question = [{"role": "user", "content": "What is the capital of France?"}]
    body = {"model": MODEL, "messages": question, "temperature": 0, "stream": True}
    async with serve_ring(smollm2_path, tmp_path, concurrency=1) as served:
        out = io.StringIO()
        with pytest.raises(demo.DemoError) as refused:
            await asyncio.to_thread(demo.ask, "beta", served.member.url, body | {"max_tokens": 300}, out)
        await asyncio.to_thread(demo.ask, "beta", served.member.url, body | {"max_tokens": 8}, out)
    assert str(refused.value).startswith("beta refused the question (400): prompt of ")
    assert "plus max_tokens=300 exceeds the session's context of 256 tokens" in str(refused.value)
    assert "(the demo's context is 512 tokens: shorten --prompt or lower --max-tokens)" in str(refused.value)
    assert "Paris" in out.getvalue()


@pytest.mark.network
def test_a_member_that_exits_at_start_is_one_line_naming_it_and_its_log(tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # a folder, so --model passes; the host refuses it
    done = kafila_demo("--model", str(broken), "--shares", "1", "--workdir", str(tmp_path), "--no-wait")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    error = [line for line in done.stderr.splitlines() if "error" in line]
    assert error == [
        f"kafila demo: error: member alpha (host) exited with 1: kafila: error: {broken}/config.json: "
        f"unknown architecture: model_type=None architectures=[]; Kafila runs ['llama', 'qwen3'] (its log: "
        f"{tmp_path}/alpha.log)"
    ]


@pytest.mark.slow
@pytest.mark.network
def test_a_one_member_demo_asks_the_head_and_names_a_member_that_dies_while_serving(
    smollm2_path: Path, tmp_path: Path
) -> None:
    """The real demo with one member: it asks the head itself, lists this run's traces only, and
    when its member dies while serving it says so in one line and exits 1 (it used to exit 0)."""
    (tmp_path / "beta.trace.jsonl").write_text('{"stale": true}\n')  # an earlier run's
    argv = [sys.executable, "-m", "kafila", "demo", "--shares", "1", "--workdir", str(tmp_path)]
    argv += ["--max-tokens", "12"]
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            assert proc.stdout is not None and proc.stderr is not None
            out = ""
            while "serving until Ctrl-C" not in out:
                line = proc.stdout.readline()
                assert line, f"the demo ended early: {out}{proc.stderr.read()}"
                out += line
            assert "asking alpha (the head itself: the only member): What is the capital" in out
            assert "Paris" in out
            assert f"traces (kafila trace summarize FILE):\n  {tmp_path}/alpha.trace.jsonl\nserving" in out
            assert not (tmp_path / "beta.trace.jsonl").exists()
            assert all(
                "stale" not in json.loads(r)
                for r in (tmp_path / "alpha.trace.jsonl").read_text().splitlines()
            )
            found = re.search(r"alpha +host .* pid (\d+) ", out)
            assert found, out
            os.kill(int(found.group(1)), signal.SIGKILL)
            assert proc.wait(30) == 1
            err = proc.stderr.read()
        finally:
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
                proc.wait(30)
    assert "Traceback" not in err
    assert (
        "kafila demo: error: member alpha (host) exited with -9" in err
        and f"(its log: {tmp_path}/alpha.log)" in err
    )
