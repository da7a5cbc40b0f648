"""`fleet status`, `down` and `logs` against real processes: each host's commands run in a local `sh`
(what ssh would run there, with the host's own HOME) against this machine's real Docker engine, a
Docker client pointed at a socket nothing serves, and the SIMULATED service manager
(tests/ops/simulated_service_manager.py); one host is reached with the real ssh at a closed port.
The verbs exit non-zero naming the host, site and step, and a second `down` finishes the job.
"""

from __future__ import annotations

import io
import os
import shutil
import socket
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ops import actions, fleetcmds
from ops.fleetfile import FleetFile, Host, parse
from ops.remote import OpsError, Remote
from tests.ops.fleetlab import SHIM

pytestmark = pytest.mark.docker  # the real engine's containers and volumes, by name


@dataclass
class LocalShellRemote(Remote):
    """A SIMULATED ssh for the hosts in `env`: their commands run in a local sh with that
    environment; any other host goes through the real ssh."""

    env: dict[str, dict[str, str]] = field(default_factory=dict)

    def argv(self, host: Host, remote: str) -> list[str]:
        if host.ssh in self.env:
            return ["env", "-i", *[f"{k}={v}" for k, v in self.env[host.ssh].items()], "sh", "-c", remote]
        return super().argv(host, remote)


def fleet_text(name: str, config: Path, api_port: int) -> str:
    hosts = [("h1", "s1", "local-docker", "docker"), ("h2", "s2", "local-nodocker", "docker"),
             ("h3", "s3", "local-native", "native"), ("h4", "s4", "gone", "native")]  # fmt: skip
    text = (
        f'[fleet]\nname = "{name}"\nimage = "img"\nssh_config = "{config}"\n'
        '[rendezvous]\nurl = "ws://127.0.0.1:9/v1/signal"\n'
        '[session]\nmodel = "smollm2-135m"\ncontext = 512\nconcurrency = 2\n'
    )
    text += "".join(f'[[device]]\nname = "{d}"\nmemory_gb = 8\n' for d, *_ in hosts)
    for device, site, ssh, runtime in hosts:
        text += (
            f'[[site]]\nname = "{site}"\n[[site.host]]\ndevice = "{device}"\nssh = "{ssh}"\n'
            f'runtime = "{runtime}"\ngpus = "none"\napi = "127.0.0.1:{api_port}"\n'
        )
    return text


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again on return: nothing listens there


def docker_image() -> str:
    """An image already in the local engine (the fleet's containers only sleep)."""
    if shutil.which("docker") is None or subprocess.run(["docker", "info"], capture_output=True).returncode:
        pytest.skip("needs a running Docker engine")
    for image in ("kafila/python-base:bookworm", "python:3.11-slim-bookworm", "debian:bookworm-slim"):
        if subprocess.run(["docker", "image", "inspect", image], capture_output=True).returncode == 0:
            return image
    pytest.skip("no base image in the local Docker engine (compose/build-base-image.sh builds one)")


def docker(*args: str) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def said(remote: Remote) -> str:
    """What kafila-ops printed to the operator since the last call."""
    assert isinstance(remote.out, io.StringIO)
    text = remote.out.getvalue()
    remote.out.seek(0)
    remote.out.truncate()
    return text


@dataclass
class Hosts:
    fleet: FleetFile
    remote: LocalShellRemote
    home: dict[str, Path]
    local_env: dict[str, dict[str, str]]
    blocker: str


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    image = docker_image()
    name = f"t{uuid.uuid4().hex[:10]}"
    config = tmp_path / "ssh_config"
    config.write_text(f"Host gone\n  HostName 127.0.0.1\n  Port {closed_port()}\n  User nobody\n")
    fleet = parse(fleet_text(name, config, closed_port()), "f.toml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("systemd-run", "systemctl", "journalctl"):
        (bin_dir / tool).symlink_to(SHIM)
    path = f"{Path(sys.executable).parent}:{os.environ['PATH']}"
    home = {d: tmp_path / d for d in ("h1", "h2", "h3", "h4")}
    env = {
        "local-docker": {"HOME": str(home["h1"]), "PATH": path},
        "local-nodocker": {"HOME": str(home["h2"]), "PATH": path,
                           "DOCKER_HOST": f"unix://{tmp_path}/no-docker.sock"},
        "local-native": {"HOME": str(home["h3"]), "PATH": f"{bin_dir}:{path}",
                         "KAFILA_SHIM_DIR": str(tmp_path / "shim3")},
    }  # fmt: skip
    local_env = {"gone": {"HOME": str(home["h4"]), "PATH": f"{bin_dir}:{path}",
                          "KAFILA_SHIM_DIR": str(tmp_path / "shim4")}}  # fmt: skip
    for d, h in home.items():  # what `up` left: each member's key folder and the native code file
        (h / ".config" / "kafila-ops" / name).mkdir(parents=True)
        (h / ".config" / "kafila-ops" / name / f"{d}.api-key").write_text("k" * 32 + "\n")
    (home["h3"] / ".cache" / "kafila-ops" / name).mkdir(parents=True)
    (home["h3"] / ".cache" / "kafila-ops" / name / "session-code").write_text("4-code\n")
    label = f"{actions.LABEL_FLEET}={name}"
    volume, blocker = f"kafila-{name}-vol", f"{name}-blocker"
    docker("run", "-d", "--name", f"kafila-{name}-h1", "--label", label, image, "sleep", "600")
    docker("volume", "create", "--label", label, volume)
    docker("create", "--name", blocker, "-v", f"{volume}:/x", image, "true")  # not the fleet's
    started = subprocess.run(
        ["systemd-run", "--user", "--unit", f"kafila-{name}-h3", "sleep", "600"],
        env=env["local-native"], capture_output=True, text=True,
    )  # fmt: skip
    assert started.returncode == 0, started.stderr
    try:
        yield Hosts(fleet, LocalShellRemote(fleet, out=io.StringIO(), env=env), home, local_env, blocker)
    finally:
        subprocess.run(["docker", "rm", "-f", f"kafila-{name}-h1", blocker], capture_output=True)
        subprocess.run(["docker", "volume", "rm", "-f", volume], capture_output=True)
        subprocess.run(["systemctl", "--user", "stop", f"kafila-{name}-h3"], env=env["local-native"])


def test_status_tells_unreachable_docker_not_running_running_and_absent_apart_and_exits_nonzero(
    hosts: Hosts,
) -> None:
    rows = fleetcmds.status(hosts.remote, hosts.fleet)
    assert {d: r["state"] for d, r in rows.items()} == {
        "h1": "running", "h2": "docker not running", "h3": "running", "h4": "unreachable",
    }  # fmt: skip
    assert fleetcmds.status_exit(rows) == fleetcmds.STATUS_HOST_FAILED
    err = said(hosts.remote)
    assert "host h2 (local-nodocker, site s2): container state: docker not running" in err
    assert "host h4 (gone, site s4): service state: unreachable: ssh: connect to host" in err
    with pytest.raises(OpsError) as logs:
        fleetcmds.logs(hosts.remote, hosts.fleet, None, 5)
    assert "host h2 (local-nodocker, site s2): logs: docker not running there" in str(logs.value)
    assert "host h4 (gone, site s4): logs: unreachable" in str(logs.value)


def test_down_removes_what_it_can_names_what_it_could_not_and_a_second_down_finishes(
    hosts: Hosts,
) -> None:
    fleet, name = hosts.fleet, hosts.fleet.name
    with pytest.raises(OpsError) as first:
        fleetcmds.down(hosts.remote, fleet)
    text = str(first.value)
    assert f"fleet {name}: down could not finish on 3 host(s)" in text
    assert "host h4 (gone, site s4): stop service" in text and "unreachable" in text
    assert "host h2 (local-nodocker, site s2): remove the fleet's containers and volumes: docker not" in text
    assert "host h1 (local-docker, site s1): remove the fleet's containers and volumes: exited 1:" in text
    assert "volume is in use" in text  # the blocker, not the fleet's, holds the volume
    err = said(hosts.remote)
    assert f"removed before it failed: removed container(s) kafila-{name}-h1" in err
    assert f"stopped kafila-{name}-h3.service" in err
    assert docker("ps", "-aq", "--filter", f"name=kafila-{name}-h1") == ""
    assert not (hosts.home["h3"] / ".cache" / "kafila-ops").exists()  # its removal finished
    assert (hosts.home["h1"] / ".config" / "kafila-ops" / name).exists()  # kept until its removal does

    docker("rm", hosts.blocker)
    hosts.remote.env.update(hosts.local_env)  # the unreachable host answers again
    hosts.remote.env["local-nodocker"].pop("DOCKER_HOST")  # and Docker runs again
    fleetcmds.down(hosts.remote, fleet)
    err = said(hosts.remote)
    assert f"removed volume(s) kafila-{name}-vol" in err
    assert f"kafila-{name}-h4.service was not running" in err
    assert f"fleet {name}: down finished on every host" in err
    assert docker("volume", "ls", "-q", "--filter", f"label={actions.LABEL_FLEET}={name}") == ""
    assert all(not (h / ".config" / "kafila-ops").exists() for h in hosts.home.values())

    rows = fleetcmds.status(hosts.remote, fleet)
    assert {r["state"] for r in rows.values()} == {"absent"}
    assert fleetcmds.status_exit(rows) == fleetcmds.STATUS_NOT_RUNNING


def test_one_fleets_down_leaves_another_fleets_session_code_on_a_shared_host(tmp_path: Path) -> None:
    a = parse(fleet_text("fa", tmp_path / "c", 11434), "a.toml")
    b = parse(fleet_text("fb", tmp_path / "c", 11434), "b.toml")
    host = a.host("h3")
    assert actions.code_file(a, host) != actions.code_file(b, host)
    for f in (a, b):
        (tmp_path / ".cache" / "kafila-ops" / f.name).mkdir(parents=True)
        (tmp_path / ".cache" / "kafila-ops" / f.name / "session-code").write_text(f"{f.name}-code\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("systemd-run", "systemctl", "journalctl"):
        (bin_dir / tool).symlink_to(SHIM)
    env = {"HOME": str(tmp_path), "PATH": f"{bin_dir}:{os.environ['PATH']}", "KAFILA_SHIM_DIR": str(tmp_path)}
    done = subprocess.run(["sh", "-c", actions.stop(a, host).remote], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / ".cache" / "kafila-ops" / "fa").exists()
    assert (tmp_path / ".cache" / "kafila-ops" / "fb" / "session-code").read_text() == "fb-code\n"
    read = subprocess.run(
        ["sh", "-c", actions.read_code(b, b.host("h3")).remote], env=env, capture_output=True, text=True
    )
    assert read.stdout == "fb-code\n"


def test_the_native_preflight_fails_where_kafila_imports_without_its_dependencies(tmp_path: Path) -> None:
    """A real venv that sees this checkout's kafila (a .pth file) and none of its dependencies:
    `import kafila` passes there, the preflight names what is missing; the test's own interpreter
    passes it and prints its Python and kafila versions."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "checkout.pth").write_text(f"{Path(__file__).resolve().parents[2]}\n")
    python = venv / "bin" / "python"
    assert subprocess.run([str(python), "-c", "import kafila"]).returncode == 0

    fleet = parse(fleet_text("pre", tmp_path / "c", 11434).replace('"gone"', f'"gone"\nvenv = "{venv}"'))
    check = actions.checks(fleet, fleet.host("h4"), "img")[1]
    assert check.what == f"check kafila and its dependencies in {python}"
    done = subprocess.run(["sh", "-c", check.remote], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    # kafila's metadata is found where the checkout holds a kafila.egg-info (a wheel was built in it):
    # the dependencies it lists are then named too
    assert f"({python}): kafila " in done.stderr and " cannot run a member: missing " in done.stderr
    assert "kafila.cli.host (No module named" in done.stderr
    assert f"{python} -m pip install 'kafila[torch]'" in done.stderr

    ok = actions.checks(fleet, fleet.host("h3"), "img")[1]
    done = subprocess.run(["sh", "-c", ok.remote], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    major, minor = sys.version_info[:2]
    assert done.stdout.startswith(f"python {major}.{minor}.") and ", kafila 0." in done.stdout


def test_up_stops_before_starting_anything_where_the_session_host_lacks_its_weights(tmp_path: Path) -> None:
    """Two native hosts in a local sh (SIMULATED ssh) under the SIMULATED service manager: the session
    host h1 lacks its [fleet] weights folder, so `up` fails at that check naming the host, site and
    step, with no member started and no key shipped anywhere; with the folder placed, the check passes
    and the session host member is started on it (its bogus tensors then stop it, in its own words)."""
    keys = tmp_path / "fleet.key"
    keys.write_text("k" * 32 + "\n")
    text = (
        '[fleet]\nname = "wts"\nimage = "img"\nsession_host = "h1"\nweights = "~/models/Qwen3-8B"\n'
        f'api_key_file = "{keys}"\n[rendezvous]\nurl = "ws://127.0.0.1:9/v1/signal"\n'
        '[session]\nmodel = "qwen3-8b"\ncontext = 512\nconcurrency = 1\n'
        '[[device]]\nname = "h1"\nmemory_gb = 24\n[[device]]\nname = "h2"\nmemory_gb = 24\n'
    )
    for device in ("h1", "h2"):
        text += (
            f'[[site]]\nname = "s-{device}"\n[[site.host]]\ndevice = "{device}"\nssh = "local-{device}"\n'
            f'runtime = "native"\npython = "{sys.executable}"\napi = "127.0.0.1:{closed_port()}"\n'
        )
    fleet = parse(text, "wts.toml")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("systemd-run", "systemctl", "journalctl"):
        (bin_dir / tool).symlink_to(SHIM)
    home = {d: tmp_path / d for d in ("h1", "h2")}
    env = {
        f"local-{d}": {"HOME": str(h), "PATH": f"{bin_dir}:{os.environ['PATH']}",
                       "PYTHONPATH": os.environ.get("PYTHONPATH", ""), "KAFILA_SHIM_DIR": str(h / "shim")}
        for d, h in home.items()
    }  # fmt: skip
    remote = LocalShellRemote(fleet, out=io.StringIO(), env=env)

    with pytest.raises(OpsError) as err:
        fleetcmds.up(remote, fleet, wait_s=30)
    assert str(err.value) == (
        "host h1 (local-h1, site s-h1): check the model weights ~/models/Qwen3-8B: exited 1: "
        f"no such folder: {home['h1']}/models/Qwen3-8B"
    )
    for h in home.values():
        assert not (h / "shim").exists()  # the service manager was never called
        assert not (h / ".config").exists() and not (h / ".cache").exists()  # no key, no state

    folder = home["h1"] / "models" / "Qwen3-8B"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text('{"model_type": "qwen3"}')
    (folder / "tokenizer.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(OpsError) as err:
        fleetcmds.up(remote, fleet, wait_s=30)
    assert str(err.value).startswith("host h1 (local-h1, site s-h1): read the session code: the member's")
    assert f"kafila: error: {folder}/config.json: config.json has no 'hidden_size'" in str(err.value)
    assert f"{folder}: config.json, tokenizer.json, 1 safetensors file(s), " in said(remote)
    calls = (home["h1"] / "shim" / "calls.jsonl").read_text()
    assert f'"host", "--model", "{folder}"' in calls  # ~/ expanded by the host's shell
    assert not (home["h2"] / "shim").exists()  # the joiner waits for the host's code
    subprocess.run(["systemctl", "--user", "stop", "kafila-wts-h1"], env=env["local-h1"], timeout=60)


def test_up_checks_a_mirror_url_before_anything_and_names_the_files_it_lacks(
    tiny_checkpoint, tmp_path
) -> None:
    """[fleet] weights as a URL: `up` asks a local server laid out like the hub for every checkpoint
    file before any host is touched; one lacking a safetensors file is named, a whole one passes."""
    from tests.session.hubserver import Hub, serving

    folder = tmp_path / "mirror"
    shutil.copytree(tiny_checkpoint("llama-mha-untied", sharded=True), folder)
    gone = sorted(folder.glob("*.safetensors"))[1]
    gone.rename(tmp_path / gone.name)
    with serving(Hub(folder)) as hub:
        text = (
            f'[fleet]\nname = "mir"\nimage = "img"\nsession_host = "h1"\nweights = "{hub.url}"\n'
            '[rendezvous]\nurl = "ws://127.0.0.1:9/v1/signal"\n'
            '[session]\nmodel = "qwen3-8b"\ncontext = 512\nconcurrency = 1\n[[device]]\nname = "h1"\n'
            'memory_gb = 24\n[[site]]\nname = "s"\n[[site.host]]\ndevice = "h1"\nssh = "nowhere"\n'
            'runtime = "native"\n'
        )
        fleet = parse(text, "mir.toml")
        remote = LocalShellRemote(fleet, out=io.StringIO(), env={})
        with pytest.raises(OpsError) as err:
            fleetcmds.check_hosts(remote, fleet, {})
        assert str(err.value).startswith(
            f"[fleet] weights {hub.url}: the mirror does not answer {gone.name}, "
        )
        assert "session host h1 would fetch qwen3-8b" in str(err.value)
        (tmp_path / gone.name).rename(gone)
        fleetcmds.check_mirror(remote, fleet)  # whole: no error
    assert "answers config.json and every safetensors file" in remote.out.getvalue()  # type: ignore[attr-defined]


def test_measured_stage_times_come_from_the_current_epochs_requests_only() -> None:
    """After a member left and joined again, the head's records hold requests over other stages:
    status reads the current epoch's (it used to raise, naming the two stage lists)."""
    from kafila.obs.trace import RequestRecord, StageTrace

    def req(rid: int, epoch: int, members: tuple[str, ...], ms: float) -> RequestRecord:
        stages = tuple(StageTrace(m, i, (i, i + 1), i == 0, 10.0, ms) for i, m in enumerate(members))
        return RequestRecord("s1", rid, "h1", "kafila", 5, 9, 0.1, 0.2, 0.8, 40.0, stages, epoch=epoch)

    records = [
        req(1, 2, ("h3", "h1"), 30.0),
        req(2, 3, ("h3", "h1", "h2"), 12.0),
        req(3, 3, ("h3", "h1", "h2"), 14.0),
    ]
    assert fleetcmds.epoch_stage_ms(records, {"session": "s1", "epoch": 3}) == {
        "h3": 13.0,
        "h1": 13.0,
        "h2": 13.0,
    }
    assert fleetcmds.epoch_stage_ms(records, {"session": "s1", "epoch": 2}) == {"h3": 30.0, "h1": 30.0}
    assert fleetcmds.epoch_stage_ms(records, {"session": "other", "epoch": 3}) == {}
