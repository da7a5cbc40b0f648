"""The per-host action list: what `fleet up` and `down` run, in order, every remote word quoted."""

from __future__ import annotations

import plistlib
import shlex
import socket
import subprocess
from pathlib import Path

import pytest

from ops import actions
from ops.cli import main as ops_main
from ops.fleetfile import FleetFile, parse
from ops.remote import OpsError, Remote

FLEET = """
[fleet]
name = "f1"
image = "kafila/member:cuda"
[rendezvous]
url = "ws://rdv.example:8470/v1/signal"
[session]
model = "smollm2-135m"
context = 512
concurrency = 2
[[device]]
name = "gpu"
memory_gb = 24
[[device]]
name = "cpu-box"
memory_gb = 8
[[device]]
name = "mac"
memory_gb = 18
[[site]]
name = "lab"
[[site.host]]
device = "gpu"
ssh = "ops@gpu"
api = "0.0.0.0:11434"
args = ["--insecure-no-key"]
[[site.host]]
device = "cpu-box"
ssh = "cpu"
gpus = "none"
args = ["--threads", "2", "--trace", "/tmp/it's here.jsonl"]
[[site]]
name = "home"
[[site.host]]
device = "mac"
ssh = "me@mac"
runtime = "native"
os = "macos"
venv = "~/kafila venv"
[[site.host]]
device = "linux-native"
ssh = "me@nat"
runtime = "native"
"""


def fleet_text() -> str:
    return FLEET.replace(
        '[[site.host]]\ndevice = "linux-native"', '[[site.host]]\ndevice = "penguin"'
    ).replace(
        '[[device]]\nname = "mac"', '[[device]]\nname = "penguin"\nmemory_gb = 4\n[[device]]\nname = "mac"'
    )


def sh_words(remote: str) -> list[str]:
    """How the remote sh splits the command (shlex follows POSIX sh quoting)."""
    return shlex.split(remote)


def test_up_checks_ships_starts_the_host_reads_the_code_then_starts_joiners_and_waits() -> None:
    fleet = parse(fleet_text(), "f.toml")
    steps = actions.up_steps(fleet)
    whats = [(s.host.device, s.what) for s in steps]
    assert whats == [
        ("gpu", "check Docker"),
        ("gpu", "check the NVIDIA runtime"),
        ("gpu", "check image kafila/member:cuda"),
        ("cpu-box", "check Docker"),
        ("cpu-box", "check image kafila/member:cuda"),
        ("mac", "check launchctl"),
        ("mac", "check kafila and its dependencies in ~/kafila venv/bin/python"),
        ("penguin", "check systemd-run"),
        ("penguin", "check kafila and its dependencies in python3"),
        ("gpu", "ship image kafila/member:cuda if missing (docker save | ssh)"),
        ("cpu-box", "ship image kafila/member:cuda if missing (docker save | ssh)"),
        ("gpu", "start the session host member gpu (container)"),
        ("gpu", "read the session code"),
        ("cpu-box", "start joining member cpu-box (container)"),
        ("mac", "start joining member mac (native service)"),
        ("penguin", "start joining member penguin (native service)"),
        ("gpu", "wait until the session serves"),
    ]


def test_containers_are_labelled_host_networked_and_get_gpus_only_on_nvidia_hosts() -> None:
    fleet = parse(fleet_text(), "f.toml")
    gpu, cpu = fleet.host("gpu"), fleet.host("cpu-box")
    head = actions.start(fleet, gpu, "sha256:abc", "")
    run = sh_words(head.remote.split(";", 1)[1])
    assert run[:4] == ["docker", "run", "-d", "--name"] and run[4] == "kafila-f1-gpu"
    assert "dev.kafila.fleet=f1" in run and "dev.kafila.member=gpu" in run
    assert run[run.index("--network") + 1] == "host" and run[run.index("--gpus") + 1] == "all"
    assert run[run.index("sha256:abc") + 1 :] == [
        "host", "--model", "smollm2-135m", "--members", "4", "--context", "512", "--concurrency", "2",
        "--code-file", actions.CONTAINER_CODE_FILE, "--name", "gpu", "--rendezvous",
        "ws://rdv.example:8470/v1/signal", "--api", "0.0.0.0:11434", "--metrics", "0.0.0.0:9464",
        "--insecure-no-key",
    ]  # fmt: skip
    join = sh_words(
        actions.start(fleet, cpu, "sha256:abc", "4-k7m2-tiger-lamp-ocean").remote.split(";", 1)[1]
    )
    assert "--gpus" not in join
    assert join[join.index("sha256:abc") + 1 :][:2] == ["join", "4-k7m2-tiger-lamp-ocean"]
    assert join[-2:] == [
        "--trace",
        "/tmp/it's here.jsonl",
    ]  # a quote in an argument survives the remote shell


def test_a_linux_native_member_runs_under_systemd_run_user_never_backgrounded() -> None:
    fleet = parse(fleet_text(), "f.toml")
    remote = actions.start(fleet, fleet.host("penguin"), "img", "CODE").remote
    assert "&" not in remote.replace("&&", "").replace("2>&1", "")  # no backgrounded shell
    run = remote[remote.index("systemd-run") :]
    words = sh_words(run)
    assert words[:5] == ["systemd-run", "--user", "--unit", "kafila-f1-penguin", "--collect"]
    assert words[words.index("python3") :][:5] == ["python3", "-m", "kafila", "join", "CODE"]


def test_a_macos_member_is_a_launchd_user_agent_with_its_home_expanded_remotely() -> None:
    fleet = parse(fleet_text(), "f.toml")
    remote = actions.start(fleet, fleet.host("mac"), "img", "CODE").remote
    assert "launchctl bootstrap gui/$(id -u)" in remote
    quoted = remote[remote.index("printf %s ") + len("printf %s ") : remote.index(" > ")]
    plist = plistlib.loads(sh_words(quoted)[0].encode())
    assert plist["Label"] == "dev.kafila.f1.mac" and plist["KeepAlive"] is False
    script = plist["ProgramArguments"][2]
    assert script.startswith("exec \"$HOME\"/'kafila venv/bin/python' -m kafila join CODE --name mac")


def test_remote_commands_survive_a_real_shell(tmp_path: Path) -> None:
    """Every start command parses in sh (`sh -n`), hostile characters included."""
    fleet = parse(fleet_text().replace('name = "f1"', 'name = "f1"'), "f.toml")
    steps = [*actions.up_steps(fleet, "4-code"), *actions.down_steps(fleet)]
    steps += [f(fleet, h) for h in fleet.hosts for f in (actions.hand_over, actions.keep_code)]
    for step in steps:
        done = subprocess.run(["sh", "-n", "-c", step.remote], capture_output=True, text=True)
        assert done.returncode == 0, (step.what, step.remote, done.stderr)


def test_down_removes_by_label_once_per_docker_host_joiners_first_and_is_idempotent_in_shape() -> None:
    fleet = parse(fleet_text(), "f.toml")
    steps = actions.down_steps(fleet)
    assert [(s.host.device, s.what) for s in steps] == [
        ("penguin", "stop service kafila-f1-penguin"),
        ("mac", "stop launchd agent dev.kafila.f1.mac"),
        ("cpu-box", "remove the fleet's containers and volumes"),
        ("gpu", "remove the fleet's containers and volumes"),
    ]
    assert "label=dev.kafila.fleet=f1" in steps[2].remote and 'if [ -n "$names" ]' in steps[2].remote


def test_down_stops_the_member_that_coordinates_last_of_the_members() -> None:
    """After a rolling upgrade handed the session host gpu's role over to mac, mac ends the session
    (last of the members) and gpu is stopped as any member."""
    fleet = parse(fleet_text(), "f.toml")
    steps = actions.down_steps(fleet, coordinator="mac")
    assert [s.host.device for s in steps] == ["penguin", "cpu-box", "gpu", "mac"]
    assert [s.host.device for s in actions.down_steps(fleet, "gpu")] == ["penguin", "mac", "cpu-box", "gpu"]


def test_the_session_host_joins_again_with_the_code_after_handing_its_role_over() -> None:
    fleet = parse(fleet_text(), "f.toml")
    gpu, penguin = fleet.host("gpu"), fleet.host("penguin")
    joined = sh_words(actions.start(fleet, gpu, "img", "4-code", join=True).remote.split(";", 1)[1])
    assert joined[joined.index("img") + 1 : joined.index("img") + 3] == ["join", "4-code"]
    assert "--code-file" not in joined
    step = actions.start(fleet, penguin, "", "4-code", join=True)
    assert step.what == "start joining member penguin (native service)"
    assert "rm -f" not in step.remote  # only a session host opening a new session drops the old code
    over = actions.hand_over(fleet, gpu).remote
    assert (
        over.startswith("docker kill -s USR1 kafila-f1-gpu >/dev/null")
        and "docker wait kafila-f1-gpu" in over
    )
    assert (
        "systemctl --user kill -s USR1 kafila-f1-penguin.service" in actions.hand_over(fleet, penguin).remote
    )
    assert (
        "launchctl kill SIGUSR1 gui/$(id -u)/dev.kafila.f1.mac"
        in actions.hand_over(fleet, fleet.host("mac")).remote
    )


def test_a_native_host_keeps_the_session_code_it_is_given_on_standard_input(tmp_path: Path) -> None:
    """keep_code and read_code in a real sh with HOME in tmp_path: the code travels on standard
    input, lands in the fleet's state folder with mode 0600, and reads back."""
    import os
    import stat

    fleet = parse(fleet_text(), "f.toml")
    penguin = fleet.host("penguin")
    env = {**os.environ, "HOME": str(tmp_path)}
    kept = subprocess.run(["sh", "-c", actions.keep_code(fleet, penguin).remote], input="4-code\n",
                          env=env, capture_output=True, text=True)  # fmt: skip
    assert kept.returncode == 0, kept.stderr
    path = tmp_path / ".cache" / "kafila-ops" / "f1" / "session-code"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    read_code = actions.read_code(fleet, penguin).remote
    read = subprocess.run(["sh", "-c", read_code], env=env, capture_output=True, text=True)
    assert read.stdout == "4-code\n"


def test_ssh_is_batch_mode_with_connection_sharing(tmp_path: Path) -> None:
    argv = actions.ssh_argv("ops@gpu", "docker ps", tmp_path, "cfg")
    assert argv[:3] == ["ssh", "-F", "cfg"]
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert {"BatchMode=yes", "ControlMaster=auto", "ControlPersist=120"} <= set(opts)
    path = next(o for o in opts if o.startswith("ControlPath="))
    assert path.startswith(f"ControlPath={tmp_path}/")
    # one shared connection per destination as written: two aliases of one address never share one
    other = actions.ssh_argv("ops@cpu", "docker ps", tmp_path, "cfg")
    assert path not in other
    assert argv[-3:] == ["--", "ops@gpu", "docker ps"]


def test_fleet_plan_prints_divisions_and_every_command(capsys: object, tmp_path: Path) -> None:
    path = tmp_path / "f.toml"
    path.write_text(fleet_text())
    assert ops_main(["fleet", "plan", str(path)]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "division" in out and "kafila" in out and "uniform" in out
    assert "commands `up` runs, in order:" in out
    assert " 17. [lab/gpu ops@gpu] wait until the session serves" in out


def test_a_bad_fleet_file_exits_2_naming_it(capsys: object, tmp_path: Path) -> None:
    path = tmp_path / "f.toml"
    path.write_text(fleet_text().replace('runtime = "native"', 'runtime = "nativ"', 1))
    assert ops_main(["fleet", "up", str(path)]) == 2
    err = capsys.readouterr().err  # type: ignore[attr-defined]
    assert err.startswith(f"kafila-ops: {path}: site 'home' host #1 (mac): 'runtime' must be one of")


def test_an_unreachable_host_is_named_with_its_step(tmp_path: Path) -> None:
    """The real ssh against a port nothing listens on: the error names the host, site and step."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again when the block ends: nothing listens there
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gpu-box\n  HostName 127.0.0.1\n  Port {port}\n  User nobody\n")
    text = (
        fleet_text()
        .replace('ssh = "ops@gpu"', 'ssh = "gpu-box"')
        .replace('image = "kafila/member:cuda"', f'image = "kafila/member:cuda"\nssh_config = "{config}"')
    )
    fleet = parse(text, "f.toml")
    step = actions.checks(fleet, fleet.host("gpu"), fleet.image)[0]
    with pytest.raises(OpsError) as err:
        Remote(fleet).run(step, timeout=30)
    assert str(err.value).startswith(
        "host gpu (gpu-box, site lab): check Docker: unreachable: ssh could not reach the host:"
    )
    assert "Connection refused" in str(err.value)


KEY = "s3cret-key-" + "x" * 16


def keyed_fleet(api: str = "127.0.0.1:11434", python: str = "python3") -> FleetFile:
    """fleet_text with [fleet] api_key_file: every member's API asks for a key."""
    image = 'image = "kafila/member:cuda"'
    text = fleet_text().replace(image, f'{image}\napi_key_file = "k"')
    text = text.replace('args = ["--insecure-no-key"]', "")  # the gpu's open API now has a key
    text = text.replace(
        'device = "penguin"\nssh = "me@nat"\nruntime = "native"',
        f'device = "penguin"\nssh = "me@nat"\nruntime = "native"\napi = "{api}"\npython = "{python}"',
    )
    return parse(text, "f.toml")


def test_with_an_api_key_up_ships_it_before_any_member_starts_and_members_read_it_from_a_file() -> None:
    fleet = keyed_fleet()
    steps = actions.up_steps(fleet)
    whats = [(s.host.device, s.what) for s in steps]
    ships = [w for w in whats if w[1].startswith("ship the API key")]
    assert ships == [
        ("gpu", "ship the API key file (mode 644)"),  # a container's user reads it through a bind mount
        ("cpu-box", "ship the API key file (mode 644)"),
        ("mac", "ship the API key file (mode 600)"),
        ("penguin", "ship the API key file (mode 600)"),
    ]
    first_start = next(i for i, w in enumerate(whats) if w[1].startswith("start"))
    assert max(whats.index(w) for w in ships) < first_start
    gpu = sh_words(actions.start(fleet, fleet.host("gpu"), "img", "").remote.split(";", 1)[1])
    mounts = [gpu[i + 1] for i, w in enumerate(gpu) if w == "-v"]
    # (sh_words does not expand $HOME, the remote shell does)
    assert "$HOME/.config/kafila-ops/f1/gpu.api-key:/run/kafila/api-key:ro" in mounts
    assert gpu[gpu.index("--api-key-file") + 1] == "/run/kafila/api-key"
    penguin = actions.start(fleet, fleet.host("penguin"), "img", "CODE").remote
    assert '--api-key-file "$HOME"/.config/kafila-ops/f1/penguin.api-key' in penguin
    down = {s.host.device: s.remote for s in actions.down_steps(fleet)}
    gone = (
        'rm -rf "$HOME"/.config/kafila-ops/f1 "$HOME"/.cache/kafila-ops/f1 || exit 1;'
        ' rmdir "$HOME"/.config/kafila-ops "$HOME"/.cache/kafila-ops >/dev/null 2>&1;'
    )
    assert all(gone in r for r in down.values())  # the folders too, once no fleet's files are left


def test_the_key_reaches_the_host_with_safe_modes_and_every_request_sends_it(tmp_path: Path) -> None:
    """ship_key and fetch run in a real sh with HOME in tmp_path (as ssh would run them), against a
    real HTTP server that asks for the key: the key travels on standard input and in a file, never in
    a command line."""
    import http.server
    import os
    import stat
    import sys
    import threading

    seen: list[str | None] = []

    class Api(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            seen.append(self.headers.get("Authorization"))
            ok = self.headers.get("Authorization") == f"Bearer {KEY}"
            body = b'{"state": "serving"}' if ok else b'{"error": "needs a key"}'
            self.send_response(200 if ok else 401)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Api)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        fleet = keyed_fleet(f"127.0.0.1:{server.server_port}", sys.executable)
        host = fleet.host("penguin")
        env = {**os.environ, "HOME": str(tmp_path)}
        ship = actions.ship_key(fleet, host)
        assert KEY not in ship.remote
        done = subprocess.run(["sh", "-c", ship.remote], input=f"# ops\n{KEY}\n", text=True, env=env)
        assert done.returncode == 0
        path = tmp_path / ".config" / "kafila-ops" / "f1" / "penguin.api-key"
        assert path.read_text() == f"# ops\n{KEY}\n"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        for folder in (path.parent, path.parent.parent):
            assert stat.S_IMODE(folder.stat().st_mode) == 0o700
        fetch = actions.fetch(fleet, host, "/session")
        assert KEY not in fetch
        out = subprocess.run(["sh", "-c", fetch], capture_output=True, text=True, env=env, timeout=30)
        assert out.stdout == '{"state": "serving"}', out.stderr
        assert seen == [f"Bearer {KEY}"]
    finally:
        server.shutdown()
        server.server_close()


def test_a_fleet_rendezvous_keeps_its_secret_so_sessions_outlive_its_restart() -> None:
    """The rendezvous the fleet starts keeps its secret (`--relay-secret-file`) in a labelled volume
    (a container) or in the fleet's private folder (native): a restarted rendezvous takes the running
    session back; `down` removes the volume with the containers."""
    from tests.ops.test_fleetfile import BASE

    fleet = parse(BASE, "two.toml")
    step = actions.rendezvous_start(fleet)
    assert step is not None and step.what == "start the rendezvous (container)"
    volume = actions.relay_volume(fleet)
    assert f"docker volume create --label dev.kafila.fleet=two {volume} >/dev/null &&" in step.remote
    argv = shlex.split(step.remote.split(" && ", 1)[1])
    assert argv[argv.index("-v") + 1] == f"{volume}:/var/lib/kafila"
    assert argv[argv.index("--relay-secret-file") + 1] == "/var/lib/kafila/relay.key"
    down = actions.stop(fleet, fleet.rendezvous.host)  # type: ignore[arg-type]
    assert "docker volume ls -q --filter label=dev.kafila.fleet=two" in down.remote
    assert down.remote.index("docker rm -f") < down.remote.index("docker volume rm")

    native = parse(BASE.replace('ssh = "rdv"', 'ssh = "rdv"\nruntime = "native"'), "two.toml")
    step = actions.rendezvous_start(native)
    assert step is not None and '"$HOME"/.config/kafila-ops/two/rendezvous-relay.key' in step.remote


def test_member_states_read_apart_from_what_each_runtime_prints() -> None:
    fleet = parse(fleet_text(), "f.toml")
    gpu, penguin, mac = fleet.host("gpu"), fleet.host("penguin"), fleet.host("mac")
    read = actions.member_state
    assert [read(gpu, 0, w) for w in ("running\n", "exited", "dead", "absent", "created")] == [
        "running", "exited", "exited", "absent", "created",
    ]  # fmt: skip
    assert read(gpu, 0, "docker not running\n") == "docker not running"
    assert read(gpu, 255, "") == read(penguin, 255, "active") == "unreachable"  # ssh's own 255
    assert [read(penguin, 0, w) for w in ("active", "failed", "inactive", "activating")] == [
        "running", "exited", "absent", "starting",
    ]  # fmt: skip
    assert read(penguin, 0, "Failed to connect to bus: No medium found") == "error"
    assert [read(mac, 0, w) for w in ("running", "not running", "absent")] == ["running", "exited", "absent"]


def test_a_step_on_a_machine_two_members_share_names_both() -> None:
    """A rendezvous and a member on one machine: Docker stopped there is reported as both's."""
    text = fleet_text().replace(
        'url = "ws://rdv.example:8470/v1/signal"', 'ssh = "ops@gpu"\naddress = "203.0.113.7"'
    )
    fleet = parse(text, "f.toml")
    assert fleet.rendezvous.host is not None
    check = actions.checks(fleet, fleet.rendezvous.host, fleet.rendezvous.image)[0]
    assert Remote(fleet).where(check) == (
        "host rendezvous (ops@gpu, site rendezvous; also runs gpu (site lab)): check Docker"
    )
    alone = actions.checks(fleet, fleet.host("cpu-box"), fleet.image)[0]
    assert Remote(fleet).where(alone) == "host cpu-box (cpu, site lab): check Docker"


def test_a_missing_local_image_is_met_with_the_dockerfile_that_builds_it() -> None:
    from ops.remote import build_hint

    assert (
        build_hint("kafila/rendezvous:latest")
        == "docker build -f Dockerfile.rendezvous -t kafila/rendezvous:latest ."
    )
    assert (
        build_hint("kafila/member:cpu")
        == "docker build -f Dockerfile.cuda --build-arg VARIANT=cpu -t kafila/member:cpu ."
    )
    assert build_hint("registry:5000/kafila/member:cuda") == (
        "docker build -f Dockerfile.cuda -t registry:5000/kafila/member:cuda ."
    )


def weights_fleet(weights: str, session_host: str = "gpu") -> FleetFile:
    """fleet_text with [fleet] weights on the session host `session_host`."""
    image = 'image = "kafila/member:cuda"'
    return parse(
        fleet_text().replace(image, f'{image}\nsession_host = "{session_host}"\nweights = "{weights}"'),
        "f.toml",
    )


def test_the_session_host_checks_its_weights_first_and_gets_the_folder_read_only_as_its_model() -> None:
    fleet = weights_fleet("~/models/Qwen3-8B")
    whats = [(s.host.device, s.what) for s in actions.up_steps(fleet)]
    checked = whats.index(("gpu", "check the model weights ~/models/Qwen3-8B"))
    assert whats[checked - 1] == ("gpu", "check image kafila/member:cuda")
    assert all(not what.startswith("start") for _, what in whats[:checked])
    run = sh_words(actions.start(fleet, fleet.host("gpu"), "sha256:abc", "").remote.split(";", 1)[1])
    assert "$HOME/models/Qwen3-8B:/srv/kafila-weights/Qwen3-8B:ro" in run  # $HOME: the remote sh's
    assert run[run.index("sha256:abc") + 1 : run.index("sha256:abc") + 4] == [
        "host", "--model", "/srv/kafila-weights/Qwen3-8B",
    ]  # fmt: skip
    joiner = actions.start(fleet, fleet.host("cpu-box"), "sha256:abc", "CODE").remote
    assert "kafila-weights" not in joiner and "Qwen3-8B" not in joiner

    native = weights_fleet("/srv/models/Qwen3-8B", session_host="penguin")
    words = sh_words(actions.start(native, native.host("penguin"), "img", "").remote.split("&&")[-1])
    assert words[words.index("python3") :][:6] == [
        "python3", "-m", "kafila", "host", "--model", "/srv/models/Qwen3-8B",
    ]  # fmt: skip
    assert [s.what for s in actions.checks(native, native.host("penguin"), "img")][-1] == (
        "check the model weights /srv/models/Qwen3-8B"
    )
    assert not any("weights" in s.what for s in actions.checks(native, native.host("gpu"), "img"))


def run_weights_check(fleet: FleetFile, home: Path) -> subprocess.CompletedProcess[str]:
    step = actions.check_weights(fleet, fleet.host(fleet.session_host))
    return subprocess.run(
        ["sh", "-c", step.remote], env={"HOME": str(home), "PATH": "/usr/bin:/bin"}, capture_output=True,
        text=True, timeout=30,
    )  # fmt: skip


def test_the_weights_check_names_what_the_folder_lacks_in_a_real_shell(tmp_path: Path) -> None:
    folder = tmp_path / "models" / "Qwen3-8B"
    folder.mkdir(parents=True)
    docker, native = weights_fleet("~/models/Qwen3-8B"), weights_fleet("~/models/Qwen3-8B", "penguin")
    done = run_weights_check(native, tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip().endswith(
        "/models/Qwen3-8B lacks config.json tokenizer.json *.safetensors"
        " (a Hugging Face model folder has them)"
    )
    for name in ("config.json", "tokenizer.json", "model-00001-of-00002.safetensors"):
        (folder / name).write_bytes(b"{}" * 1024)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\0" * 4096)
    for fleet in (native, docker):
        done = run_weights_check(fleet, tmp_path)
        assert done.returncode == 0, done.stderr
        assert f"{folder}: config.json, tokenizer.json, 2 safetensors file(s), " in done.stdout

    outside = tmp_path / "blobs" / "abc"
    outside.parent.mkdir()
    outside.write_bytes(b"\0" * 64)
    (folder / "model-00002-of-00002.safetensors").unlink()
    (folder / "model-00002-of-00002.safetensors").symlink_to(outside)
    assert run_weights_check(native, tmp_path).returncode == 0  # a native member follows it
    done = run_weights_check(docker, tmp_path)
    assert done.returncode == 1
    assert "has symlinks out of the folder, which the container cannot follow: " in done.stderr
    assert "model-00002-of-00002.safetensors" in done.stderr

    (folder / "model-00002-of-00002.safetensors").unlink()
    (folder / "config.json").chmod(0o600)
    done = run_weights_check(docker, tmp_path)
    assert done.returncode == 1
    assert f"the container's user (uid 10001) cannot read: {folder}/config.json" in done.stderr
    assert f"chmod -R o+rX {folder}" in done.stderr

    done = run_weights_check(weights_fleet("~/models/none"), tmp_path)
    assert done.returncode == 1 and done.stderr.strip() == f"no such folder: {tmp_path}/models/none"
    (tmp_path / "models" / "one-file").write_bytes(b"GGUF")
    done = run_weights_check(weights_fleet("~/models/one-file"), tmp_path)
    assert done.returncode == 1 and "/models/one-file is a file, not a model folder" in done.stderr


def test_a_gguf_file_as_weights_is_mounted_alone_read_only_and_is_the_session_hosts_model() -> None:
    """`kafila host --model FILE.gguf` converts it in place into the member's cache: the container
    gets the file (its folder's other files stay out) and the cache volume as KAFILA_CACHE."""
    fleet = weights_fleet("~/models/Qwen3-8B-Q4_K_M.gguf")
    whats = [(s.host.device, s.what) for s in actions.up_steps(fleet)]
    checked = whats.index(("gpu", "check the model weights ~/models/Qwen3-8B-Q4_K_M.gguf"))
    assert all(not what.startswith("start") for _, what in whats[:checked])
    run = sh_words(actions.start(fleet, fleet.host("gpu"), "sha256:abc", "").remote.split(";", 1)[1])
    mounts = [run[i + 1] for i, w in enumerate(run) if w == "-v"]
    assert mounts == [
        "kafila-cache:/var/cache/kafila",
        "$HOME/models/Qwen3-8B-Q4_K_M.gguf:/srv/kafila-weights/Qwen3-8B-Q4_K_M.gguf:ro",
    ]
    assert "KAFILA_CACHE=/var/cache/kafila" in run  # where the in-place folder is written: the volume
    assert run[run.index("sha256:abc") + 1 : run.index("sha256:abc") + 4] == [
        "host", "--model", "/srv/kafila-weights/Qwen3-8B-Q4_K_M.gguf",
    ]  # fmt: skip
    joiner = actions.start(fleet, fleet.host("cpu-box"), "sha256:abc", "CODE").remote
    assert "kafila-weights" not in joiner and ".gguf" not in joiner

    native = weights_fleet("/srv/models/q8.gguf", session_host="penguin")
    words = sh_words(actions.start(native, native.host("penguin"), "img", "").remote.split("&&")[-1])
    assert words[words.index("python3") :][:6] == [
        "python3",
        "-m",
        "kafila",
        "host",
        "--model",
        "/srv/models/q8.gguf",
    ]
    assert [s.what for s in actions.checks(native, native.host("penguin"), "img")][-1] == (
        "check the model weights /srv/models/q8.gguf"
    )


def test_the_gguf_check_names_what_is_wrong_with_the_file_in_a_real_shell(tmp_path: Path) -> None:
    file = tmp_path / "models" / "q.gguf"
    docker, native = weights_fleet("~/models/q.gguf"), weights_fleet("~/models/q.gguf", "penguin")
    for fleet in (native, docker):
        done = run_weights_check(fleet, tmp_path)
        assert done.returncode == 1 and done.stderr.strip() == f"no such file: {file}"
    file.mkdir(parents=True)
    done = run_weights_check(docker, tmp_path)
    assert (
        done.returncode == 1
        and f"{file} is not a file: a .gguf weights path names the GGUF file" in done.stderr
    )
    file.rmdir()
    file.write_bytes(b"PK\3\4" + bytes(60))
    done = run_weights_check(native, tmp_path)
    assert done.returncode == 1 and f"{file} is not a GGUF file (it does not start with GGUF)" in done.stderr
    file.write_bytes(b"GGUF" + bytes(8192))
    for fleet in (native, docker):
        done = run_weights_check(fleet, tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"{file}: a GGUF file, ") and done.stdout.endswith(" KiB\n")
    link = tmp_path / "models" / "linked.gguf"  # a Hugging Face cache snapshot's: the mount follows it
    link.symlink_to(file)
    assert run_weights_check(weights_fleet("~/models/linked.gguf"), tmp_path).returncode == 0
    file.chmod(0o600)
    assert run_weights_check(native, tmp_path).returncode == 0  # a native member runs as the ssh user
    done = run_weights_check(docker, tmp_path)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        f"the container's user (uid 10001) cannot read: {file} ; make it world-readable: chmod o+r {file}"
    )


def test_a_mirror_url_as_weights_starts_the_session_host_with_weights_from_and_no_mount() -> None:
    url = "https://huggingface.co/Qwen/Qwen3-8B"
    fleet = weights_fleet(url)
    assert not any("weights" in s.what for s in actions.up_steps(fleet))  # checked from here (fleetcmds)
    run = sh_words(actions.start(fleet, fleet.host("gpu"), "sha256:abc", "").remote.split(";", 1)[1])
    assert "kafila-weights" not in " ".join(run)  # nothing to mount
    host_args = run[run.index("sha256:abc") + 1 :]
    assert host_args[:3] == ["host", "--model", fleet.plan.model]
    assert host_args[host_args.index("--weights-from") + 1] == url
    joiner = actions.start(fleet, fleet.host("cpu-box"), "sha256:abc", "CODE").remote
    assert "--weights-from" not in joiner  # members hear the mirror from the host


def test_a_member_leaves_on_sigterm_and_its_build_is_asked_where_it_runs() -> None:
    fleet = parse(fleet_text(), "f.toml")
    gpu, mac, penguin = (fleet.host(n) for n in ("gpu", "mac", "penguin"))
    assert sh_words(actions.leave(fleet, gpu).remote) == [
        "docker",
        "stop",
        "-t",
        "60",
        "kafila-f1-gpu",
        ">/dev/null",
    ]
    assert sh_words(actions.leave(fleet, penguin).remote) == [
        "systemctl", "--user", "stop", "kafila-f1-penguin.service"
    ]  # fmt: skip
    assert actions.leave(fleet, mac).remote == "launchctl bootout gui/$(id -u)/dev.kafila.f1.mac"
    assert sh_words(actions.image_of(fleet, gpu).remote)[-1] == "kafila-f1-gpu"
    running = sh_words(actions.speaks(fleet, gpu, installed=False).remote)
    assert running == ["docker", "exec", "kafila-f1-gpu", "python", "-m", "kafila.proto.speaks"]
    assert actions.speaks(fleet, mac, installed=True).remote.endswith(" -m kafila.proto.speaks")
    assert "kafila venv" in actions.speaks(fleet, mac, installed=True).remote
