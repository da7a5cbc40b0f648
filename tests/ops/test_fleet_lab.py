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
def fleet_lab(member_image: str) -> Iterator[FleetLab]:
    why = missing_requirements()
    if why:
        pytest.skip(why)
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
    fleet_lab: FleetLab, tmp_path: Path
) -> None:
    fleet = tmp_path / "lab.toml"
    # the members' APIs ask for a key, which `up` ships and every kafila-ops request sends
    text = (ROOT / "fleets" / "lab.toml").read_text()
    fleet.write_text(text.replace('session_host = "h1"', 'session_host = "h1"\napi_key_file = "lab-api.key"'))
    (tmp_path / "lab-api.key").write_text(f"{secrets.token_urlsafe(24)}\n")
    (tmp_path / "lab-ssh_config").write_text(fleet_lab.ssh_config())
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
        assert re.search(r"h3 \(lab-h3, site site3\): python 3\.\d+\.\d+ \(.*\), kafila \d", up.stderr)

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
        failure_paths(fleet_lab, fleet)
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


def failure_paths(fleet_lab: FleetLab, fleet: Path) -> None:
    """h3's sshd stopped (unreachable), h2's dockerd stopped, and on h1 a volume with the fleet's
    label held by a container that is not the fleet's (its removal fails): every verb exits non-zero
    naming the host, site and step; once all three are back, `down` finishes the job."""
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
    for member, state in (("h1", "running"), ("h2", "docker not running"), ("h3", "unreachable")):
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
