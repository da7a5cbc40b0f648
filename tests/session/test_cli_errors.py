"""`kafila host` / `kafila join` refuse bad input with one line naming it, never a traceback."""

import asyncio
import os
import signal
import socket
import subprocess
import sys

import pytest

from kafila.cli.host import run_member
from kafila.net.errors import LinkTimeout
from kafila.net.signaling import SignalingError
from kafila.rendezvous.server import RendezvousServer
from kafila.session.channel import ChannelClosed
from kafila.session.weights.manifest import WeightsError
from tests.net.harness import start_rendezvous


def with_api_off(argv: tuple[str, ...]) -> list[str]:
    """`host` and `join` without an API unless the test gives one: the default port (11434, Ollama's)
    may be taken on a developer's machine, and what these tests check comes after it is bound."""
    member = argv[:1] in (("host",), ("join",))
    return [*argv, "--api", "off"] if member and "--api" not in argv else list(argv)


def kafila_cli(*argv: str) -> subprocess.CompletedProcess[str]:
    """`kafila ARGV` in a fresh process, as a person runs it."""
    return subprocess.run(
        [sys.executable, "-m", "kafila", *with_api_off(argv)], capture_output=True, text=True, timeout=120
    )


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["host", "--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["join", "4-zzzz-bad"], "session code has 3 parts"),
        (["join", ""], "error: session code is empty; it looks like '4-k7m2-tiger-lamp-ocean'"),
        (["host", "--context", "100000"], "--context 100000 is beyond the 8192 positions smollm2-135m was"),
        (["host", "--members", "31"], "--members 31 is more than the 30 blocks of smollm2-135m"),
    ],
)
def test_bad_input_is_one_named_error(argv: list[str], named: str) -> None:
    done = kafila_cli(*argv)
    assert done.returncode == 1
    assert named in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("command", "flag", "value"),
    [
        ("host", "--memory-gb", "inf"),
        ("host", "--memory-gb", "nan"),
        ("host", "--memory-gb", "-1"),
        ("host", "--wait", "nan"),
        ("join", "--wait", "-5"),
    ],
)
def test_seconds_and_gigabytes_must_be_finite_and_positive(command: str, flag: str, value: str) -> None:
    code = ["4-k7m2-tiger-lamp-ocean"] if command == "join" else []
    done = kafila_cli(command, *code, flag, value)
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"argument {flag}: must be a finite number > 0, got '{value}'" in done.stderr


@pytest.mark.parametrize(("flag", "value"), [("--lost-after", "0.02"), ("--dead-after", "1.999")])
def test_a_bound_shorter_than_a_move_to_the_relay_is_refused_with_the_numbers(flag: str, value: str) -> None:
    """--dead-after 0.02 broke the ring before any request ("stopped answering (nothing for 0 s)");
    below 2 s a link whose direct path fails cannot move to the relay before the ring gives up."""
    done = kafila_cli("host", flag, value)
    assert done.returncode == 2, done.stderr
    assert (
        f"argument --lost-after/--dead-after: {float(value):g} s is below 2 s: a link whose direct path "
        "fails takes up to 1.25 s to move to the relay"
    ) in done.stderr


def test_the_bound_defaults_to_3_s_everywhere() -> None:
    import argparse

    from kafila.cli.host import add_member_flags
    from kafila.session.channel import DEFAULT_LOST_AFTER, Heartbeat, MemoryChannel
    from kafila.session.terms import Options

    parser = argparse.ArgumentParser()
    add_member_flags(parser)
    args = parser.parse_args([])
    a, _ = MemoryChannel.pair("a", "b")
    assert args.dead_after == Options().dead_after == Heartbeat(a).dead_after == DEFAULT_LOST_AFTER == 3.0
    assert parser.parse_args(["--dead-after", "4"]).dead_after == 4.0  # the old name still works


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["host", "--name", ""], "argument --name: must be 1-64 printable characters, got ''"),
        (["host", "--name", "x" * 65], "argument --name: must be 1-64 printable characters"),
        (["join", "4-k7m2-tiger-lamp-ocean", "--name", "a\nb"], "argument --name: must be 1-64 printable"),
        (["host", "--backend", "cuda"], "argument --backend: invalid choice: 'cuda'"),
        (
            ["join", "4-k7m2-tiger-lamp-ocean", "--rendezvous", "ftp://rdv.example"],
            "argument --rendezvous: 'ftp://rdv.example' is not a rendezvous address: give a ws://",
        ),
    ],
)
def test_names_and_backends_are_checked_by_the_parser(argv: list[str], named: str) -> None:
    done = kafila_cli(*argv)
    assert done.returncode == 2 and named in done.stderr and "Traceback" not in done.stderr


def test_a_code_file_that_cannot_be_written_is_named_before_the_session_opens(tmp_path) -> None:
    argv = [
        "host",
        "--code-file",
        str(tmp_path / "no-such-dir" / "code"),
        "--rendezvous",
        "ws://127.0.0.1:1/x",
    ]
    done = kafila_cli(*argv)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "cannot write --code-file" in done.stderr and "No such file or directory" in done.stderr
    assert "cannot reach the rendezvous" not in done.stderr  # before connecting


def test_a_weight_cache_that_cannot_be_a_folder_is_named_before_anything_starts(tmp_path) -> None:
    """It was named only once the plan came and the first weights arrived (probe, links, plan)."""
    (tmp_path / "a-file").write_text("")
    argv = [sys.executable, "-m", "kafila", "join", "4-k7m2-tiger-lamp-ocean", "--api", "off"]
    argv += ["--rendezvous", "ws://127.0.0.1:1/x"]
    env = os.environ | {"KAFILA_CACHE": str(tmp_path / "a-file" / "cache")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    named = (
        f"cannot use the weight cache under {tmp_path / 'a-file' / 'cache'}: {tmp_path / 'a-file'} is a file"
    )
    assert named in done.stderr and "set KAFILA_CACHE to another folder" in done.stderr
    assert "cannot reach the rendezvous" not in done.stderr  # before connecting


@pytest.mark.parametrize("command", ["host", "join"])
@pytest.mark.parametrize(
    ("where", "named"), [("a-file/trace.jsonl", "a-file is a file, not a folder"), (".", "Is a directory")]
)
def test_a_trace_that_cannot_be_written_is_named_before_anything_starts(
    tmp_path, command: str, where: str, named: str
) -> None:
    """It failed with a traceback after the probe and the stage load (a folder that cannot be
    made), or the session ran without its trace (a directory)."""
    (tmp_path / "a-file").write_text("")
    code = ["4-k7m2-tiger-lamp-ocean"] if command == "join" else []
    done = kafila_cli(command, *code, "--trace", str(tmp_path / where), "--rendezvous", "ws://127.0.0.1:1/x")
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert f"cannot write the trace to {tmp_path / where}: " in done.stderr and named in done.stderr
    assert "cannot reach the rendezvous" not in done.stderr  # before connecting


def test_the_code_file_appears_only_with_the_code_in_it(tmp_path) -> None:
    """Scripts wait for the file to exist and then read the code: checking it may be written must
    not create it (an empty file made the NAT-lab members read a code of 0 parts)."""
    code_file = tmp_path / "code"
    done = kafila_cli("host", "--code-file", str(code_file), "--rendezvous", "ws://127.0.0.1:1/x")
    assert done.returncode == 1 and "cannot reach the rendezvous" in done.stderr
    assert not code_file.exists() and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("flag", ["--members", "--context"])
def test_counts_below_one_are_refused_by_the_parser(flag: str) -> None:
    done = kafila_cli("host", flag, "0")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert f"argument {flag}: must be a whole number >= 1, got '0'" in done.stderr


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs a machine with 2 CPUs or more")
def test_emulated_speed_on_several_cpus_is_refused_before_connecting() -> None:
    argv = [sys.executable, "-m", "kafila", "join", "4-zzzz-bad", "--emulate-speed", "0.5"]
    done = subprocess.run(["taskset", "-c", "0,1", *argv], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "--emulate-speed 0.5 needs this member to compute on one CPU (it may use 2)" in done.stderr
    for fix in (["taskset", "-c", "0", *argv], [*argv, "--threads", "1"]):
        fixed = subprocess.run(fix, capture_output=True, text=True, timeout=120)
        assert fixed.returncode == 1 and "session code has 3 parts" in fixed.stderr  # past the check


def test_an_unreachable_rendezvous_is_named_with_the_reason() -> None:
    url = "ws://127.0.0.1:1/v1/signal"  # nothing listens on port 1: connection refused
    done = kafila_cli("join", "4-k7m2-tiger-lamp-ocean", "--rendezvous", url)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        f"cannot reach the rendezvous at {url}: connection refused: nothing listens on that port"
        in done.stderr
    )


async def kafila_against(
    server: RendezvousServer, *argv: str, address: str | None = None
) -> tuple[int | None, str]:
    """`kafila ARGV --rendezvous URL` (or `address`, as a person may type it) in a fresh process
    against `server` (running on this test's loop), then the server stopped: exit status, stderr."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *[sys.executable, "-m", "kafila", *with_api_off(argv), "--rendezvous", address or server.url],
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        _, err = await asyncio.wait_for(proc.communicate(), 120)
    finally:
        await server.stop()
    return proc.returncode, err.decode()


async def test_a_code_the_rendezvous_does_not_know_is_refused_in_one_line() -> None:
    server = await start_rendezvous()  # a real rendezvous on this test's loop
    code, stderr = await kafila_against(server, "join", "4-k7m2-tiger-lamp-ocean")
    assert code == 1 and "Traceback" not in stderr
    assert f"the rendezvous at {server.url} would not join session 4-k7m2: no open session" in stderr
    assert "(unknown_session); the host printed the whole join command, with its --rendezvous" in stderr


@pytest.mark.parametrize("typed", ["127.0.0.1:{port}", "http://127.0.0.1:{port}", "ws://127.0.0.1:{port}/"])
async def test_the_rendezvous_may_be_given_as_host_and_port_or_an_http_url(typed: str) -> None:
    """`--rendezvous 127.0.0.1:8470` (or http://...) was refused as "scheme isn't ws or wss"."""
    server = await start_rendezvous()
    assert server.url.startswith("ws://127.0.0.1:") and server.url.endswith("/v1/signal")
    typed = typed.format(port=server.http_port)
    code, stderr = await kafila_against(server, "join", "4-k7m2-tiger-lamp-ocean", address=typed)
    assert code == 1 and "Traceback" not in stderr
    assert f"the rendezvous at {server.url} would not join session 4-k7m2: no open session" in stderr


async def test_a_rendezvous_whose_udp_is_blocked_is_named_not_a_traceback() -> None:
    """Its UDP probe port blocked (simulated by closing the rendezvous's UDP service, the signaling
    stays up): the host's NAT probe gets no answer."""
    server = await start_rendezvous()
    server.udp.close()
    code, stderr = await kafila_against(server, "host", "--members", "1")
    assert code == 1 and "Traceback" not in stderr
    probe = f"127.0.0.1:{server.udp.port}"
    assert f"cannot classify this member's NAT: rendezvous probe endpoint {probe} did not answer" in stderr
    assert "the rendezvous's UDP ports must be reachable from here" in stderr


async def test_an_ipv6_only_rendezvous_is_named_as_such_not_blamed_on_a_firewall() -> None:
    """Members reach the UDP ports over IPv4; the rendezvous given as [::1] lost every probe and the
    member was told its firewall blocked them."""
    server = await start_rendezvous("::1")
    code, stderr = await kafila_against(server, "host", "--members", "1")
    assert code == 1 and "Traceback" not in stderr
    assert "rendezvous host ::1 has no IPv4 address (only ::1)" in stderr
    assert "IPv6-only rendezvous is not supported yet" in stderr
    assert "must be reachable" not in stderr


@pytest.mark.parametrize(
    "failure",
    [
        LinkTimeout("edge 1-2: no offer from member 2 within 30.0 s"),
        WeightsError("tensor model.norm.weight: 2304 bytes fetched, 2048 expected"),
        ChannelClosed("channel to beta closed"),
        SignalingError("rate_limited", "too many requests"),
    ],
    ids=type,
)
def test_a_member_that_fails_on_its_own_cause_says_it_in_one_line(
    failure: Exception, capsys: pytest.CaptureFixture[str]
) -> None:
    async def start() -> None:
        raise failure

    assert run_member(start) == 1
    err = capsys.readouterr().err
    assert f"kafila: error: {failure}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("api", "named"),
    [
        ("127.0.0.1:99999", "--api '127.0.0.1:99999': port 99999 is outside 0-65535"),
        ("localhost", "--api 'localhost': expected HOST:PORT, :PORT or PORT"),
        ("taken", "cannot serve the API on 127.0.0.1:{port}: Address already in use (choose another with"),
        ("192.0.2.1:8000", "cannot serve the API on 192.0.2.1:8000: Cannot assign requested address"),
    ],
)
def test_an_api_address_that_cannot_serve_is_named_before_the_rendezvous_is_asked(
    api: str, named: str
) -> None:
    with socket.socket() as holder:  # another program on a port
        holder.bind(("127.0.0.1", 0))
        port = holder.getsockname()[1]
        api = f"127.0.0.1:{port}" if api == "taken" else api
        argv = ["join", "4-k7m2-tiger-lamp-ocean", "--api", api, "--rendezvous", "ws://127.0.0.1:1/v1/signal"]
        done = kafila_cli(*argv)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert named.format(port=port) in done.stderr
    assert "cannot reach the rendezvous" not in done.stderr  # refused before connecting


@pytest.mark.parametrize(
    ("sig", "status", "line", "when"),
    [
        (
            signal.SIGTERM,
            143,
            "kafila: terminated: left before the session formed",
            "waiting for 1 member(s)",
        ),
        (
            signal.SIGINT,
            130,
            "kafila: interrupted: left before the session formed",
            "waiting for 1 member(s)",
        ),
        (signal.SIGTERM, 143, "kafila: terminated: left before the session formed", "measuring this device"),
        (signal.SIGINT, 130, "kafila: interrupted: left before the session formed", "measuring this device"),
    ],
    ids=["sigterm", "ctrl-c", "sigterm-while-probing", "ctrl-c-while-probing"],
)
async def test_a_host_stopped_before_its_session_forms_says_so(sig, status, line, when) -> None:
    """SIGTERM used to say "session closed" for a session that never formed; Ctrl-C said nothing;
    either, while the member measured itself, waited for the probe to end (8-14 s here, past
    `docker stop`'s 10 s), and then the probe's thread, still in torch at the interpreter's exit,
    could abort it ("terminate called without an active exception", exit 134)."""
    server = await start_rendezvous()
    try:
        proc = await asyncio.create_subprocess_exec(
            *[
                sys.executable,
                "-m",
                "kafila",
                "host",
                "--members",
                "2",
                "--api",
                "off",
                "--rendezvous",
                server.url,
                "--probe-max-age",
                "0",  # measures: no earlier test's measurement is offered instead
            ],
            stderr=asyncio.subprocess.PIPE,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # as a terminal's foreground job
        )
        assert proc.stderr is not None
        seen = ""
        while when not in seen:
            more = await asyncio.wait_for(proc.stderr.readline(), 120)
            assert more, seen
            seen += more.decode()
        proc.send_signal(sig)
        rest = (await asyncio.wait_for(proc.stderr.read(), 30)).decode()
        assert await proc.wait() == status
        assert "GB/s" not in rest or when != "measuring this device"  # stopped, not after the probe's end
    finally:
        await server.stop()
    assert rest.rstrip().splitlines()[-1] == line and "Traceback" not in rest


async def test_a_host_waiting_longer_than_the_code_lives_is_told() -> None:
    """A rendezvous whose code TTL is shorter than the host's --wait refuses members joining late
    while the host still waits for them: the host says so when it prints the code."""
    from dataclasses import replace

    from tests.net.harness import LAB_LIMITS

    server = await start_rendezvous(limits=replace(LAB_LIMITS, code_ttl_s=10.0))
    try:
        argv = ["host", "--members", "2", "--wait", "30", "--api", "off", "--rendezvous", server.url]
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kafila", *argv, stderr=asyncio.subprocess.PIPE
        )
        assert proc.stderr is not None
        first = [(await asyncio.wait_for(proc.stderr.readline(), 60)).decode() for _ in range(2)]
        proc.terminate()
        await proc.wait()
    finally:
        await server.stop()
    assert first[0].startswith("kafila: session code: ")
    assert first[1] == (
        "kafila: note: the rendezvous takes joins with this code for 10 s after it opened or was last "
        "joined, less than --wait 30 s: members must join within that\n"
    )
