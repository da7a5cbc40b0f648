"""`kafila rendezvous` as a user runs it: flags documented, a real process serving /healthz."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from kafila.cli import build_parser

pytestmark = pytest.mark.network


def free_port(kind: int) -> int:
    with socket.socket(socket.AF_INET, kind) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_every_flag_has_help() -> None:
    parser = build_parser("rendezvous")
    sub = next(a for a in parser._actions if a.dest == "command").choices["rendezvous"]  # type: ignore[union-attr]
    flags = [a for a in sub._actions if a.option_strings and a.dest != "help"]
    assert len(flags) >= 25
    assert all(a.help and len(a.help) > 15 for a in flags), [a.dest for a in flags if not a.help]


def test_process_serves_healthz_and_logs_json() -> None:
    port, udp_port, alt = (
        free_port(socket.SOCK_STREAM),
        free_port(socket.SOCK_DGRAM),
        free_port(socket.SOCK_DGRAM),
    )
    cmd = [sys.executable, "-m", "kafila", "rendezvous", "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["--udp-port", str(udp_port), "--udp-alt-port", str(alt), "--max-sessions", "7"]
    env = {k: v for k, v in os.environ.items() if k != "KAFILA_LOG"}
    proc = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1.0).json()
                break
            except httpx.HTTPError:
                assert proc.poll() is None, f"rendezvous exited {proc.returncode}"
                assert time.monotonic() < deadline, "no /healthz within 30 s"
                time.sleep(0.1)
        assert health["udp_port"] == udp_port
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=10)
    events = [json.loads(line)["event"] for line in err.splitlines() if line.startswith("{")]
    assert events[:2] == ["udp_listening", "rendezvous_started"]
    assert events[-1] == "rendezvous_stopped"  # SIGTERM (docker stop) is logged as the stop it is


def test_cert_without_key_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kafila", "rendezvous", "--cert", "cert.pem"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "--cert and --key go together" in out.stderr


@pytest.mark.parametrize(
    ("flag", "proto"), [("--port", "TCP"), ("--udp-port", "UDP"), ("--udp-alt-port", "UDP")]
)
def test_a_port_in_use_is_named_in_one_error_event_with_the_flag_that_chose_it(flag: str, proto: str) -> None:
    kind = socket.SOCK_STREAM if proto == "TCP" else socket.SOCK_DGRAM
    with socket.socket(socket.AF_INET, kind) as holder:
        holder.bind(("127.0.0.1", 0))
        if proto == "TCP":
            holder.listen()
        busy = holder.getsockname()[1]
        ports = {"--port": free_port(socket.SOCK_STREAM), "--udp-port": free_port(socket.SOCK_DGRAM)}
        ports |= {"--udp-alt-port": free_port(socket.SOCK_DGRAM), flag: busy}
        cmd = [sys.executable, "-m", "kafila", "rendezvous", "--host", "127.0.0.1"]
        cmd += [str(x) for pair in ports.items() for x in pair]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr + done.stdout
    events = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
    failed = [e for e in events if e["event"] == "listen_failed"]
    assert len(failed) == 1 and failed[0]["level"] == "error"
    assert failed[0]["error"] == f"cannot listen on {proto} 127.0.0.1:{busy}: Address already in use"
    held = "another program holds it (a rendezvous running already?)"
    assert failed[0]["hint"] == f"{held}: stop it, or choose another with {flag}"


def test_the_relay_secret_file_is_created_private_and_read_back(tmp_path) -> None:
    from kafila.cli.rendezvous import relay_secret

    path = str(tmp_path / "relay.key")
    secret, created = relay_secret(path)
    assert created and len(secret) == 32 and os.stat(path).st_mode & 0o777 == 0o600
    assert relay_secret(path) == (secret, False)  # a restart reads the same secret
    fresh = tmp_path / "state" / "fleet" / "relay.key"  # a fleet's folder not made yet: made private
    assert relay_secret(str(fresh))[1] and os.stat(fresh.parent).st_mode & 0o777 == 0o700
    (tmp_path / "bad.key").write_text("not hex\n")
    with pytest.raises(ValueError, match=r"bad\.key does not hold a hex secret"):
        relay_secret(str(tmp_path / "bad.key"))
    (tmp_path / "short.key").write_text("00ff\n")
    with pytest.raises(ValueError, match=r"short\.key holds 2 bytes, at least 16 are needed"):
        relay_secret(str(tmp_path / "short.key"))


def test_a_bad_relay_secret_file_is_refused_in_one_error_event(tmp_path) -> None:
    (tmp_path / "relay.key").write_text("zz\n")
    cmd = [sys.executable, "-m", "kafila", "rendezvous", "--relay-secret-file", str(tmp_path / "relay.key")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    events = [json.loads(line) for line in (done.stdout + done.stderr).splitlines() if line.startswith("{")]
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert [e["event"] for e in events if e["level"] == "error"] == ["relay_secret"]
