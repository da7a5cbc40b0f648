"""`kafila-ops` end to end on the fleet lab (tests/ops/fleetlab.py): three sites behind real netfilter
NATs in network namespaces, each host with its own sshd, two with their own dockerd and one native
host whose service manager is SIMULATED (a shim that records what it is asked and runs the member).
`fleet up` forms a real session across the namespaces, `status` shows it serving, `bench` prints its
table, `traces` backfills blocks from which a real Prometheus answers every Bench run panel's
queries. Then a host made unreachable (its sshd stopped), Docker stopped on another and a removal
that fails on a third: `status`, `logs` and `down` exit non-zero naming each host, site and step,
and once they are back a second `down` finishes and leaves nothing behind.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.natlab.lab import Lab
from tests.ops.backfill import bench_run_answers
from tests.ops.fleetlab import ROOT, FleetLab, missing_requirements
from tests.ops.labvenv import Made, ensure_lab_venv, pip_install

pytestmark = [
    pytest.mark.root,
    pytest.mark.docker,
    pytest.mark.slow,
    pytest.mark.network,
    # the image build, a whole fleet up, its failure paths and down, and the lab's teardown: 2.5 min
    # on a quiet machine; 15 min with a CI run beside it (load 20 on 2 cores: up alone took 536 s)
    pytest.mark.timeout(1800),
]


@pytest.fixture
def lab_venv(member_image: str) -> Made:
    """The native hosts' virtual environment, installed as the README installs kafila from the
    wheelhouse the member image was built from (tests/ops/labvenv.py)."""
    why = missing_requirements()
    if why:
        pytest.skip(why)
    made = ensure_lab_venv(ROOT)
    print(f"\nnative hosts' venv {made.venv}: {made.how} in {made.seconds:.1f} s")
    return made


@pytest.fixture
def fleet_lab(lab_venv: Made) -> Iterator[FleetLab]:
    with Lab() as lab:
        fl = FleetLab(lab, Path(f"/tmp/kfl{os.getpid()}"))
        try:
            fl.start()
            yield fl
        finally:
            fl.close()
        assert not fl.dir.exists() and fl.mounts() == [], "the lab left files or mounts behind"


def ops(fleet: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "KAFILA_LOG_LEVEL": "warning"}
    return subprocess.run(
        [sys.executable, "-m", "ops", "fleet", args[0], str(fleet), *args[1:]],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=fleet.parent,
    )  # fmt: skip


def ok(done: subprocess.CompletedProcess[str]) -> str:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout[-4000:]}\n{done.stderr[-6000:]}"
    return done.stdout


def test_fleet_up_status_bench_traces_down_across_nats_with_a_simulated_service_manager(
    fleet_lab: FleetLab, lab_venv: Made, tmp_path: Path
) -> None:
    from ops.fleetfile import load

    fleet = tmp_path / "lab.toml"
    # the members' APIs ask for a key, which `up` ships and every kafila-ops request sends; the
    # session host h1 (docker) serves the default model's own GGUF file, named as [fleet] weights
    gguf = default_gguf()
    text = (ROOT / "fleets" / "lab.toml").read_text()
    fleet.write_text(
        text.replace(
            'session_host = "h1"', f'session_host = "h1"\napi_key_file = "lab-api.key"\nweights = "{gguf}"'
        )
    )
    (tmp_path / "lab-api.key").write_text(f"{secrets.token_urlsafe(24)}\n")
    (tmp_path / "lab-ssh_config").write_text(fleet_lab.ssh_config())
    venv = lab_venv.venv
    parsed = load(fleet)
    assert {parsed.host("h3").python, parsed.rendezvous.host.python} == {f"{venv}/bin/python"}  # type: ignore[union-attr]
    keys = Path.home() / ".config" / "kafila-ops" / "lab"  # every lab host logs in as this machine's root
    try:
        started = time.monotonic()
        up = ops(fleet, "up", "--wait", "900", timeout=1500)
        took = time.monotonic() - started
        out = ok(up)
        m = re.search(r"serving after ([\d.]+) s \(image transfer ([\d.]+) s\)", out)
        assert m, out
        print(
            f"\nfleet up: {took:.1f} s from nothing to serving; image transfer {m.group(2)} s\n"
            + up.stderr[-1500:]
        )
        # shipped to both docker hosts, which had no image, layer by layer through this machine's registry
        shipped = re.findall(r"(h1|h2): \S+ pulled: (\d+) layer\(s\) sent, ([\d.]+) MB", up.stderr)
        assert sorted(h for h, _, _ in shipped) == ["h1", "h2"], up.stderr[-3000:]
        assert all(int(n) > 0 for _, n, _ in shipped), shipped
        only_the_new_layer_crosses(fleet_lab, fleet)
        mounts_the_gguf_alone(fleet_lab, gguf)
        for name in ("h1", "h2", "h3"):
            assert re.search(rf"^{name}\s+site\d\s+\d+-\d+", out, re.M), out
        assert stat.S_IMODE((keys / "h3.api-key").stat().st_mode) == 0o600  # native
        assert stat.S_IMODE((keys / "h1.api-key").stat().st_mode) == 0o644  # bind-mounted, in 0700 folders
        assert stat.S_IMODE(keys.stat().st_mode) == 0o700
        assert unauthenticated_status(fleet_lab.hosts["lab-h3"].ns, "/session") == 401

        status = ok(ops(fleet, "status"))
        print(status)
        for name in ("h1", "h2", "h3"):
            row = next(line for line in status.splitlines() if line.startswith(name + " "))
            assert "serving" in row, status
        assert re.search(r"^h1\s.*\brunning\b", status, re.M) and re.search(
            r"^h3\s.*\brunning\b", status, re.M
        )
        # the preflight ran the venv's interpreter, which found kafila installed in the venv
        site_packages = f"{venv}/lib/python{sys.version_info.major}.{sys.version_info.minor}/site-packages"
        python = f"python {sys.version.split()[0]} ({venv}/bin/python)"
        for where in ("h3 (lab-h3, site site3)", "rendezvous (lab-rdv, site rendezvous)"):
            said = f"{where}: {python}, kafila 0.1.0 at {site_packages}"
            assert said in up.stderr, up.stderr[-3000:]
        runs_from_the_venv(fleet_lab, "lab-h3", "kafila-lab-h3", venv)
        runs_from_the_venv(fleet_lab, "lab-rdv", "kafila-lab-rendezvous", venv)

        watched = monitor_scrapes(fleet, tmp_path / "targets.json")
        assert sorted(watched) == ["h1", "h2", "h3"]
        assert {g["labels"]["site"] for g in watched.values()} == {"site1", "site2", "site3"}

        bench_file = tmp_path / "bench.txt"
        bench = ok(
            ops(fleet, "bench", "--out", str(bench_file), "--requests", "2", "--max-tokens", "8", timeout=900)
        )
        print(bench)
        assert "1 user:" in bench and "4 users:" in bench and bench_file.read_text().strip() == bench.strip()

        traces = tmp_path / "traces"
        ok(ops(fleet, "traces", str(traces)))
        assert {p.name for p in traces.glob("*.jsonl")} == {"h1.jsonl", "h2.jsonl", "h3.jsonl"}
        answers = bench_run_answers(traces / "tsdb")  # the Bench run dashboard on the backfilled blocks
        assert answers and all(answers.values()), answers

        calls = [
            json.loads(line)
            for line in (fleet_lab.hosts["lab-h3"].dir / "shim" / "calls.jsonl").read_text().splitlines()
        ]
        assert [c["args"][:4] for c in calls if c["tool"] == "systemd-run"] == [
            ["--user", "--unit", "kafila-lab-h3", "--collect"]
        ]
        coordinates = rolling_upgrade(fleet_lab, fleet, venv, tmp_path)
        failure_paths(fleet_lab, fleet, coordinates)
    finally:
        fleet_lab.restore()
        first = ops(fleet, "down", timeout=300)
    ok(first)
    ok(ops(fleet, "down", timeout=300))  # idempotent: nothing left is not an error
    assert fleet_lab.leftovers() == []
    assert not keys.exists() and not keys.parent.exists()
    calls = [
        json.loads(line)
        for line in (fleet_lab.hosts["lab-rdv"].dir / "shim" / "calls.jsonl").read_text().splitlines()
    ]
    assert ["stop", "kafila-lab-rendezvous.service"] in [
        [a for a in c["args"] if a != "--user"][:2] for c in calls
    ]


def rolling_upgrade(fleet_lab: FleetLab, fleet: Path, venv: Path, tmp_path: Path) -> str:
    """While a client in h1's namespace streams requests without pause: an image whose session
    messages are of another version is refused before anything stops; then a new image (one layer
    above) and a new kafila for the native h3 (this source under another version, pip-installed
    into the fleet's venv while h3 runs from it, as a user upgrades) replace h3 and h2 one at a
    time, and the session host h1 last: it
    hands its role over (SIGUSR1) and joins again with the session's code. No request fails (the
    client waits out 503 answers and retries the connections refused while h1 restarts); every
    member runs the new build; the member h1 handed over to coordinates, which status says (and
    which is returned)."""
    from ops.fleetfile import load

    parsed = load(fleet)
    image = member_image_name(parsed, parsed.host("h1"))
    old_id = local_image(image)
    versioned = ROOT / "kafila" / "proto" / "session.py"
    v = int(re.search(r"^SESSION_VERSION = (\d+)", versioned.read_text(), re.M).group(1))  # type: ignore[union-attr]
    install_upgrade(venv, tmp_path / "new-kafila")
    stop, answers = tmp_path / "client.stop", tmp_path / "answers.jsonl"
    new_id, said = "", b""
    client = subprocess.Popen(
        ["nsenter", f"--net=/var/run/netns/{fleet_lab.hosts['lab-h1'].ns}", sys.executable,
         str(ROOT / "tests" / "ops" / "streaming_client.py"), "http://127.0.0.1:11434/v1/chat/completions",
         str(tmp_path / "lab-api.key"), str(answers), str(stop)],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        build_on(image, f"RUN sed -i 's/^SESSION_VERSION = {v}/SESSION_VERSION = {v + 1}/' "
                        "$(python -c 'import kafila.proto.session as s; print(s.__file__)')")  # fmt: skip
        refused = ops(fleet, "up")
        assert refused.returncode == 1, refused
        assert "rolling upgrade refused; nothing was stopped" in refused.stderr, refused.stderr
        assert "h2: session messages: the session (kafila " in refused.stdout, refused.stdout
        assert f"runs v{v}, kafila " in refused.stdout and f"speaks v{v + 1}" in refused.stdout
        assert "leaving the session" not in refused.stderr
        refused_id = local_image(image)
        subprocess.run(["docker", "tag", old_id, image], check=True, capture_output=True)
        subprocess.run(["docker", "rmi", refused_id], check=True, capture_output=True)
        build_on(image, f"RUN echo {secrets.token_hex(8)} > /tmp/upgrade")
        new_id = local_image(image)
        dry = ok(ops(fleet, "up", "--dry-run"))
        assert re.search(r"^\d\. h2 .*leaves, starts on image", dry, re.M), dry
        assert re.search(r"^\d\. h3 .*starts on kafila \S+\+upgrade", dry, re.M), dry
        assert re.search(
            r"^3\. h1 .*the session's host: hands its role over to the first present of", dry, re.M
        )
        started = time.monotonic()
        rolled = ops(fleet, "up", "--wait", "600", timeout=1500)
        took = time.monotonic() - started
        out = ok(rolled)
        print(f"\nrolling upgrade: {took:.1f} s\n{out}\n{rolled.stderr[-2500:]}")
        assert "rolling upgrade done: " in out and "3/3: h1 serves again" in rolled.stderr, rolled.stderr
        assert "coordinates the session now" in rolled.stderr
        time.sleep(3)  # the client streams on the upgraded session a while
    finally:
        stop.touch()
        _, said = client.communicate(timeout=180)  # reads and closes its stderr pipe
        subprocess.run(["docker", "tag", old_id, image], check=True, capture_output=True)
        if new_id:  # the lab's own build leaves no dangling image
            subprocess.run(["docker", "rmi", new_id], capture_output=True, timeout=120)
    records = [json.loads(line) for line in answers.read_text().splitlines()]
    failed = [r for r in records if r.get("status") != 200 or r.get("error") or not r.get("finish")]
    waited = [r for r in records if r["retried_503"]]
    refused = [r for r in records if r.get("retried_refused")]
    print(
        f"client: {len(records)} requests over {records[-1]['t1'] - records[0]['t0']:.1f} s, "
        f"{len(failed)} failed, {len(waited)} waited out a 503 (Retry-After) first "
        f"({sum(r['retried_503'] for r in records)} answers), {len(refused)} retried refused connections "
        f"({sum(r['retried_refused'] for r in records)} s)"
    )
    assert records and not failed, (failed[:5], said.decode(errors="replace")[-2000:])
    assert runs_image(fleet_lab, "lab-h2", "kafila-lab-h2") == new_id
    assert runs_image(fleet_lab, "lab-h1", "kafila-lab-h1") == new_id
    h3 = ops(fleet, "status")
    print(h3.stdout)
    assert h3.returncode == 0 and all(
        re.search(rf"^{n}\s.*\bserving\b", h3.stdout, re.M) for n in ("h1", "h2", "h3")
    ), h3.stdout
    host = re.search(
        r"^the session's host is (h[23]) \(the fleet's session host h1 handed its role over\)",
        h3.stdout,
        re.M,
    )
    assert host is not None, h3.stdout
    key = (tmp_path / "lab-api.key").read_text().strip()
    code = (
        "import urllib.request as u\n"
        "q = u.Request('http://127.0.0.1:11434/metrics', headers={'Authorization': 'Bearer ' + "
        f"{key!r}}})\nprint(u.urlopen(q, timeout=10).read().decode())"
    )
    metrics = subprocess.run(
        ["nsenter", f"--net=/var/run/netns/{fleet_lab.hosts['lab-h3'].ns}", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert re.search(r'kafila_build_info\{[^}]*version="[^"]+\+upgrade"', metrics.stdout), metrics.stdout[
        :500
    ]
    return host.group(1)


def install_upgrade(venv: Path, source: Path) -> None:
    """This checkout's source under the version 0.1.0+upgrade, pip-installed into `venv` (its
    build backend from the wheelhouse, no package index): what `pip install .` after a pull does."""
    for part in ("kafila", "ops"):
        shutil.copytree(
            ROOT / part, source / part, ignore=shutil.ignore_patterns("__pycache__", "*.nbi", "*.nbc")
        )
    shutil.copy(ROOT / "README.md", source / "README.md")
    for path, pattern in ((source / "kafila" / "__init__.py", r'^(__version__ = )"([^"]+)"'),
                          (source / "pyproject.toml", r'^(version = )"([^"]+)"')):  # fmt: skip
        text = (ROOT / "pyproject.toml").read_text() if path.name == "pyproject.toml" else path.read_text()
        new = re.sub(pattern, r'\1"\2+upgrade"', text, count=1, flags=re.M)
        assert new != text, path
        path.write_text(new)
    pip_install(venv, "--no-deps", "--find-links", str(ROOT / "wheelhouse"), str(source))


def runs_from_the_venv(fleet_lab: FleetLab, alias: str, unit: str, venv: Path) -> None:
    """The service's process runs the venv's interpreter, with no PYTHONPATH in its environment."""
    pid = int((fleet_lab.hosts[alias].dir / "shim" / f"{unit}.pid").read_text())
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    assert argv[0].decode() == f"{venv}/bin/python", argv
    assert not [e for e in environ if e.startswith((b"PYTHONPATH=", b"PYTHONHOME="))], environ


def local_image(image: str) -> str:
    done = subprocess.run(
        ["docker", "image", "inspect", "-f", "{{.Id}}", image], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def build_on(image: str, step: str) -> None:
    """`image` rebuilt one layer above what it names now (the tag moves to the new one), the step
    run as root and the image's user kept."""
    user = subprocess.run(["docker", "image", "inspect", "-f", "{{.Config.User}}", image],
                          capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    build = subprocess.run(
        ["docker", "build", "-q", "-t", image, "-"],
        input=f"FROM {image}\nUSER root\n{step}\nUSER {user or 'root'}\n",
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr


def default_gguf() -> Path:
    from kafila.models.default import DEFAULT_MODEL, DEFAULT_MODELS, locate_gguf

    return locate_gguf(DEFAULT_MODELS[DEFAULT_MODEL])


def mounts_the_gguf_alone(fleet_lab: FleetLab, gguf: Path) -> None:
    """h1's container has the GGUF file bind-mounted read-only (not its folder), and converted it in
    place into its cache volume: the index there names the file where the container sees it."""

    def docker(*args: str) -> str:
        done = subprocess.run(
            ["docker", "-H", fleet_lab.hosts["lab-h1"].socket, *args],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout

    inside = f"/srv/kafila-weights/{gguf.name}"
    mounts = json.loads(docker("inspect", "-f", "{{json .Mounts}}", "kafila-lab-h1"))
    binds = [(m["Destination"], m["RW"]) for m in mounts if m["Type"] == "bind" and m["Source"] == str(gguf)]
    assert binds == [(inside, False)], mounts
    index = docker(
        "exec", "kafila-lab-h1", "sh", "-c", 'cat "$KAFILA_CACHE"/gguf/*/model.safetensors.gguf.json'
    )
    assert json.dumps(inside) in index, index[:2000]


def runs_image(fleet_lab: FleetLab, alias: str, container: str) -> str:
    done = subprocess.run(
        ["docker", "-H", fleet_lab.hosts[alias].socket, "inspect", "-f", "{{.Image}}", container],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def only_the_new_layer_crosses(fleet_lab: FleetLab, fleet: Path) -> None:
    """An image one small layer above the one h1 holds travels as that layer alone: the registry's
    log says what it sent through the tunnel, and h1's engine then has the image."""
    from ops.actions import ssh_options
    from ops.fleetfile import load
    from ops.registry import LocalRegistry, pull_through_tunnel, registry_binary

    parsed = load(fleet)
    base = next(h for h in parsed.hosts if h.device == "h1")
    image = f"{member_image_name(parsed, base)}-layer-test"
    build = subprocess.run(
        ["docker", "build", "-q", "-t", image, "-"],
        input=f"FROM {member_image_name(parsed, base)}\nRUN echo {secrets.token_hex(8)} > /tmp/layer-test\n",
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert build.returncode == 0, build.stderr
    binary = registry_binary()
    assert binary is not None
    try:
        with LocalRegistry(binary) as registry:
            registry.push(image)
            got = pull_through_tunnel(registry, parsed.ssh_config, base, image)
        print(f"one new layer to h1: {got}")
        assert got.layers == 1 and got.layer_bytes < 100_000, got  # one small layer, not the 1.5 GB image
        inspect = f"docker image inspect -f '{{{{.Id}}}}' {image}"
        there = subprocess.run(
            [*ssh_options(None, parsed.ssh_config), base.ssh, inspect],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert there.returncode == 0 and there.stdout.strip().startswith("sha256:"), there.stderr
    finally:
        subprocess.run(["docker", "rmi", image], capture_output=True, timeout=120)


def member_image_name(fleet: Any, host: Any) -> str:
    from ops import actions

    return str(actions.images_for(fleet, host))


def failure_paths(fleet_lab: FleetLab, fleet: Path, coordinates: str) -> None:
    """h3's sshd stopped (unreachable), h2's dockerd stopped, and on h1 a volume with the fleet's
    label held by a container that is not the fleet's (its removal fails): every verb exits non-zero
    naming the host, site and step; once all three are back, `down` finishes the job. A dockerd
    that stops sends its containers SIGTERM: where h2 coordinates the session (`coordinates`),
    that ends the session on purpose, and h1's member exits (0) with it."""
    from ops.fleetfile import load
    from ops.remote import Remote

    h1 = fleet_lab.hosts["lab-h1"]
    docker_h1 = ["docker", "-H", h1.socket]
    subprocess.run([*docker_h1, "volume", "create", "--label", "dev.kafila.fleet=lab", "kafila-lab-held"],
                   check=True, capture_output=True)  # fmt: skip
    subprocess.run([*docker_h1, "create", "--name", "not-the-fleets", "-v", "kafila-lab-held:/x",
                    "kafila/member:cpu"], check=True, capture_output=True)  # fmt: skip
    fleet_lab.stop_dockerd("lab-h2")
    fleet_lab.stop_sshd("lab-h3")
    Remote(load(fleet)).close()  # the shared ssh connections, which outlive a stopped sshd

    status = ops(fleet, "status", timeout=300)
    print(status.stdout, status.stderr)
    assert status.returncode == 1, status
    h1_state = "exited" if coordinates == "h2" else "running"
    for member, state in (("h1", h1_state), ("h2", "docker not running"), ("h3", "unreachable")):
        assert re.search(rf"^{member}\s+site\d\s+\w+\s+{state}\s", status.stdout, re.M), status.stdout
    assert "host h3 (lab-h3, site site3): service state: unreachable" in status.stderr
    assert "host h2 (lab-h2, site site2): container state: docker not running" in status.stderr

    logs = ops(fleet, "logs", timeout=300)
    assert logs.returncode == 1 and "host h3 (lab-h3, site site3): logs: unreachable" in logs.stderr

    down = ops(fleet, "down", timeout=300)
    print(down.stderr)
    assert down.returncode == 1, down
    assert "down could not finish on 3 host(s)" in down.stderr
    assert "host h3 (lab-h3, site site3): stop service kafila-lab-h3: unreachable" in down.stderr
    assert "host h2 (lab-h2, site site2): remove the fleet's containers and volumes: docker not running" in (
        down.stderr
    )
    assert "host h1 (lab-h1, site site1): remove the fleet's containers and volumes: exited 1" in down.stderr
    assert "volume is in use" in down.stderr
    assert "removed before it failed: removed container(s) kafila-lab-h1" in down.stderr

    subprocess.run([*docker_h1, "rm", "not-the-fleets"], check=True, capture_output=True)
    fleet_lab.restore()
    status = ops(fleet, "status", timeout=300)
    print(status.stdout, status.stderr)
    assert status.returncode == 3, status  # every host answers; members are not running
    assert re.search(r"^h1\s.*\babsent\b", status.stdout, re.M)
    assert re.search(r"^h2\s.*\bexited\b", status.stdout, re.M)  # stopped with its dockerd


def unauthenticated_status(ns: str, path: str) -> int:
    """The HTTP status a request without a key gets from the member's API in namespace `ns`."""
    code = (
        "import urllib.request, urllib.error\n"
        f"try: print(urllib.request.urlopen('http://127.0.0.1:11434{path}', timeout=10).status)\n"
        "except urllib.error.HTTPError as e: print(e.code)"
    )
    done = subprocess.run(
        ["nsenter", f"--net=/var/run/netns/{ns}", sys.executable, "-c", code],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    return int(done.stdout.strip())


def monitor_scrapes(fleet: Path, targets: Path) -> dict[str, Any]:
    """`kafila-ops monitor` writes file_sd targets whose tunnels answer /metrics; returns them by member."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops", "monitor", str(fleet), "--targets", str(targets)],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while not targets.exists() or len(json.loads(targets.read_text())) < 3:
            assert proc.poll() is None, proc.stderr.read().decode() if proc.stderr else ""
            assert time.monotonic() < deadline, "monitor wrote no targets within 90 s"
            time.sleep(0.5)
        groups = {g["labels"]["member"]: g for g in json.loads(targets.read_text())}
        for g in groups.values():
            metrics = httpx.get(f"http://{g['targets'][0]}/metrics", timeout=10)
            assert metrics.status_code == 200 and "kafila_" in metrics.text
        return groups
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        if proc.stderr:
            proc.stderr.close()
