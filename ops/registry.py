"""Images shipped layer by layer: a registry on the operator's machine, reached by each host through
an ssh reverse tunnel, so a host pulls only the layers it lacks (as Kamal 2 does).

The registry is Debian's `docker-registry` (the distribution project's 2.x), listening on 127.0.0.1
with its storage under the operator's cache (`~/.cache/kafila-ops/registry`, kept between runs, so a
push sends the registry only the layers it lacks too). A host's Docker engine pulls from
127.0.0.1:PORT on its own side of `ssh -R`, which Docker takes without TLS as a loopback registry;
nothing listens beyond loopback on either machine. What crossed the wire is read from the registry's
own log: the bytes each blob request wrote, and which layers were fetched.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ops.actions import ssh_options
from ops.fleetfile import Host
from ops.remote import OpsError, Remote, free_port, quote

BINARIES = ("docker-registry", "registry")  # Debian's name, the upstream binary's
READY_WITHIN_S = 20.0
REMOTE_PORTS = range(20000, 40000)  # where a host's end of the reverse tunnel listens (loopback)


def registry_binary() -> str | None:
    """The registry program on this machine, or None (then images travel whole: docker save | load)."""
    return next((p for p in map(shutil.which, BINARIES) if p), None)


def registry_root() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "kafila-ops" / "registry"


@dataclass(frozen=True)
class Pulled:
    """What one host's pull took from the registry."""

    layers: int  # layer blobs the host fetched
    layer_bytes: int  # their bytes, as the registry wrote them (compressed)
    total_bytes: int  # every response to the host: manifests and configs too
    seconds: float


def served(log_lines: list[str], config_digest: str = "") -> Pulled:
    """The blob and manifest responses in registry log lines (its JSON `response completed` events);
    the image's config blob (`config_digest`) is counted in the total, not as a layer."""
    layers = layer_bytes = total = 0
    for line in log_lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if not isinstance(event, dict) or event.get("msg") != "response completed":
            continue
        if event.get("http.request.method") != "GET":
            continue
        written = int(event.get("http.response.written") or 0)
        total += written
        uri = str(event.get("http.request.uri", ""))
        config = bool(config_digest) and uri.endswith(f"/blobs/{config_digest}")
        if (
            "/blobs/sha256:" in uri
            and not config
            and written > 0
            and event.get("http.response.status") == 200
        ):
            layers += 1
            layer_bytes += written
    return Pulled(layers, layer_bytes, total, 0.0)


class LocalRegistry:
    """A registry on 127.0.0.1 of this machine for one `kafila-ops` run; `with` stops it."""

    def __init__(self, binary: str, root: Path | None = None, out: IO[str] | None = None) -> None:
        self.binary, self.root, self.out = binary, root or registry_root(), out
        self.port = free_port()
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_path = self.root / "registry.log"
        config = self.root / "config.yml"
        config.write_text(
            "version: 0.1\n"
            "log: {level: info, formatter: json, accesslog: {disabled: true}}\n"
            f"storage: {{filesystem: {{rootdirectory: {json.dumps(str(self.root / 'data'))}}}, "
            "delete: {enabled: true}}\n"
            f"http: {{addr: '127.0.0.1:{self.port}'}}\n"
        )
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [binary, "serve", str(config)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        self._wait_ready()

    def _wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + READY_WITHIN_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise OpsError(f"this machine: the registry exited at start: {self._tail()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/v2/", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise OpsError(
            f"this machine: the registry did not answer within {READY_WITHIN_S:.0f} s: {self._tail()}"
        )

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-600:]

    def ref(self, image: str, port: int | None = None) -> str:
        """`image` as named in the registry, at 127.0.0.1:`port` (this machine's port by default)."""
        return f"127.0.0.1:{port or self.port}/{image}"

    def push(self, image: str) -> None:
        """Push `image` (the registry takes only the layers it lacks); the local tag goes after."""
        ref = self.ref(image)
        for argv in (["docker", "tag", image, ref], ["docker", "push", "-q", ref], ["docker", "rmi", ref]):
            done = subprocess.run(argv, capture_output=True, text=True, timeout=1800)
            if done.returncode != 0:
                raise OpsError(f"this machine: {quote(argv)} exited {done.returncode}: {done.stderr.strip()}")

    def config_digest(self, image: str) -> str:
        """The digest of `image`'s config blob, from its manifest in the registry ("" if unreadable)."""
        import urllib.request

        name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "latest")
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v2/{name}/manifests/{tag}",
            headers={"Accept": "application/vnd.docker.distribution.manifest.v2+json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as r:
                return str(json.load(r).get("config", {}).get("digest", ""))
        except (OSError, ValueError):
            return ""

    def pull_argv(self, config: str | None, host: Host, image: str, remote_port: int) -> list[str]:
        """ssh to `host` with its end of a reverse tunnel at 127.0.0.1:`remote_port`: pull the image
        from there, tag it with its own name, drop the registry's name."""
        ref = self.ref(image, remote_port)
        script = (
            f"docker pull -q {quote([ref])} && docker tag {quote([ref, image])} && docker rmi {quote([ref])}"
        )
        tunnel = ["-o", "ExitOnForwardFailure=yes", "-R", f"127.0.0.1:{remote_port}:127.0.0.1:{self.port}"]
        return [*ssh_options(None, config), *tunnel, "--", host.ssh, script]

    def log_mark(self) -> int:
        self._log.flush()
        return self.log_path.stat().st_size

    def since(self, mark: int) -> list[str]:
        with self.log_path.open("rb") as f:
            f.seek(mark)
            return f.read().decode(errors="replace").splitlines()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()

    def __enter__(self) -> LocalRegistry:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def pull_through_tunnel(
    registry: LocalRegistry, config: str | None, host: Host, image: str, tries: int = 3
) -> Pulled:
    """The host pulls `image` from the registry through `ssh -R`; another loopback port is tried
    when the one picked is taken there. What it fetched, from the registry's log."""
    where = f"host {host.device} ({host.ssh}, site {host.site}): pull image {image}"
    why = ""
    for _ in range(tries):
        mark, started = registry.log_mark(), time.monotonic()
        port = random.choice(REMOTE_PORTS)
        argv = registry.pull_argv(config, host, image, port)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=3600, stdin=subprocess.DEVNULL)
        if done.returncode == 0:
            took = time.monotonic() - started
            got = served(registry.since(mark), registry.config_digest(image))
            return Pulled(got.layers, got.layer_bytes, got.total_bytes, took)
        why = (done.stderr or done.stdout).strip()
        if "remote port forwarding failed" not in why:
            break
    raise OpsError(f"{where}: {Remote.why(done.returncode, why)}")
