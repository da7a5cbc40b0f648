"""Running `actions.Step`s over the system ssh, and shipping images to hosts that lack them."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from ops.actions import Step, ssh_argv, ssh_options
from ops.fleetfile import FleetFile, Host


class OpsError(RuntimeError):
    """A step failed: the message names the host and the step."""


@dataclass(frozen=True)
class Done:
    """A remote command's exit status and output (rc 255: ssh's own failure)."""

    rc: int
    out: str
    err: str


def control_dir() -> Path:
    """Where ssh keeps its shared connections: short, as a socket path has at most 104 bytes."""
    base = Path(os.environ.get("XDG_RUNTIME_DIR") or f"/tmp/kafila-ops-{os.getuid()}")
    d = base / "kafila-ops-ssh"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    return d


@dataclass
class Remote:
    fleet: FleetFile
    verbose: bool = False
    out: IO[str] = sys.stderr

    def argv(self, host: Host, remote: str) -> list[str]:
        return ssh_argv(host.ssh, remote, control_dir(), self.fleet.ssh_config)

    def call(self, step: Step, timeout: float = 120.0, stdin: str | None = None) -> Done:
        """The step's remote command over ssh, whatever its exit status; `stdin` is written to it (a
        secret stays out of the command line), else it reads nothing. Exit status 255 is ssh's own
        (the host could not be reached or logged in to)."""
        if self.verbose:
            print(f"kafila-ops: {step.describe()}", file=self.out)
        try:
            done = subprocess.run(
                self.argv(step.host, step.remote),
                capture_output=True,
                text=True,
                timeout=timeout,
                **({"input": stdin} if stdin is not None else {"stdin": subprocess.DEVNULL}),
            )
        except subprocess.TimeoutExpired:
            raise OpsError(f"{self.where(step)}: no answer within {timeout:.0f} s") from None
        return Done(done.returncode, done.stdout, done.stderr)

    def run(self, step: Step, timeout: float = 120.0, check: bool = True, stdin: str | None = None) -> str:
        """The step's standard output; with `check`, an OpsError naming the host, site and step
        when it exited non-zero."""
        done = self.call(step, timeout, stdin)
        if check and done.rc != 0:
            raise OpsError(f"{self.where(step)}: {self.why(done.rc, done.err or done.out)}")
        return done.out

    def where(self, step: Step) -> str:
        """`host MEMBER (SSH, site SITE): STEP`, naming the fleet's other members on that machine too
        (a rendezvous and a member sharing one, say): a stopped Docker there is theirs as much."""
        h = step.host
        hosts = [*self.fleet.hosts, *([self.fleet.rendezvous.host] if self.fleet.rendezvous.host else [])]
        also = [f"{o.device} (site {o.site})" for o in hosts if o.ssh == h.ssh and o.device != h.device]
        shared = f"; also runs {', '.join(also)}" if also else ""
        return f"host {h.device} ({h.ssh}, site {h.site}{shared}): {step.what}"

    @staticmethod
    def why(rc: int, text: str) -> str:
        text = text.strip()
        if rc == 255:
            return (
                f"unreachable: ssh could not reach the host: {text.splitlines()[-1] if text else 'exit 255'}"
            )
        if "docker not running" in text or "Cannot connect to the Docker daemon" in text:
            reason = text.removeprefix("docker not running:").strip()
            return f"docker not running there: {reason[-400:]}"
        if "command not found" in text or ("not found" in text.lower() and rc == 127):
            return f"not installed there: {text}"
        return f"exited {rc}: {text[-800:] or '(no output)'}"

    def close(self) -> None:
        """End the shared connections this run opened (`ssh -O exit` on each host)."""
        seen: set[str] = set()
        hosts = list(self.fleet.hosts) + ([self.fleet.rendezvous.host] if self.fleet.rendezvous.host else [])
        for h in hosts:
            if h.ssh in seen:
                continue
            seen.add(h.ssh)
            argv = [*ssh_options(control_dir(), self.fleet.ssh_config, h.ssh), "-O", "exit", h.ssh]
            subprocess.run(argv, capture_output=True, timeout=10, stdin=subprocess.DEVNULL)


def local_image_id(image: str) -> str:
    done = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", image], capture_output=True, text=True
    )
    if done.returncode != 0:
        raise OpsError(
            f"this machine: image {image} is not in the local Docker engine (build it: {build_hint(image)}):"
            f" {done.stderr.strip()}"
        )
    return done.stdout.strip()


def build_hint(image: str) -> str:
    """The command that builds `image` from this repository: the rendezvous image from
    Dockerfile.rendezvous, a member image from Dockerfile.cuda (VARIANT=cpu for a :cpu tag)."""
    name, _, tag = image.rpartition(":") if ":" in image.rsplit("/", 1)[-1] else (image, "", "")
    if name.endswith("rendezvous"):
        return f"docker build -f Dockerfile.rendezvous -t {image} ."
    variant = " --build-arg VARIANT=cpu" if "cpu" in tag else ""
    return f"docker build -f Dockerfile.cuda{variant} -t {image} ."


def ship_image(remote: Remote, host: Host, image: str, image_id: str) -> float:
    """`docker save IMAGE | ssh HOST docker load`, with progress; returns the seconds it took."""
    size = int(
        subprocess.run(
            ["docker", "image", "inspect", "--format", "{{.Size}}", image], capture_output=True, text=True
        ).stdout.strip()
        or 0
    )
    where = f"host {host.device} ({host.ssh}, site {host.site}): ship image {image}"
    print(
        f"kafila-ops: {host.device}: sending {image} ({image_id[:19]}, about {size / 1e6:.0f} MB)",
        file=remote.out,
    )
    started = time.monotonic()
    save = subprocess.Popen(["docker", "save", image], stdout=subprocess.PIPE)
    load = subprocess.Popen(
        remote.argv(host, "docker load"),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    assert save.stdout is not None and load.stdin is not None
    sent, shown = 0, 0.0
    try:
        while chunk := save.stdout.read(1 << 20):
            load.stdin.write(chunk)
            sent += len(chunk)
            now = time.monotonic()
            if now - shown >= 2.0:
                shown = now
                pct = f" ({100 * sent / size:.0f}%)" if size else ""
                rate = sent / max(now - started, 1e-3) / 1e6
                print(
                    f"kafila-ops: {host.device}: {sent / 1e6:.0f} MB sent{pct}, {rate:.0f} MB/s",
                    file=remote.out,
                )
        load.stdin.close()
    except BrokenPipeError:
        pass
    assert load.stdout is not None
    said = load.stdout.read().decode(errors="replace")  # docker load's few lines, until it ends
    load.wait(timeout=600)
    save.wait(timeout=60)
    if save.returncode != 0:
        raise OpsError(f"{where}: docker save exited {save.returncode}")
    if load.returncode != 0:
        raise OpsError(f"{where}: image load failed: {Remote.why(load.returncode, said)}")
    took = time.monotonic() - started
    print(f"kafila-ops: {host.device}: image loaded, {sent / 1e6:.0f} MB in {took:.1f} s", file=remote.out)
    return took


def quote(argv: list[str]) -> str:
    return shlex.join(argv)


def free_port(address: str = "127.0.0.1") -> int:
    import socket

    with socket.socket() as s:
        s.bind((address, 0))
        return int(s.getsockname()[1])


def tunnel_argv(
    remote: Remote, host: Host, local_port: int, target: str, listen: str = "127.0.0.1"
) -> list[str]:
    """`ssh -N -L LISTEN:PORT:TARGET HOST`: a member's listener, reached from this machine at
    LISTEN:PORT (ssh's client binds an explicit address as given, loopback or not)."""
    argv = ssh_options(None, remote.fleet.ssh_config)
    forward = f"{listen}:{local_port}:{target}"
    return [*argv, "-o", "ExitOnForwardFailure=yes", "-N", "-L", forward, host.ssh]


class Tunnel:
    """A running `ssh -N -L` to one member, until closed."""

    def __init__(
        self,
        remote: Remote,
        host: Host,
        target: str,
        local_port: int | None = None,
        listen: str = "127.0.0.1",
    ) -> None:
        import socket

        self.host, self.port, self.listen = host, local_port or free_port(listen), listen
        self.proc = subprocess.Popen(
            tunnel_argv(remote, host, self.port, target, listen),
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode() if self.proc.stderr else ""
                raise OpsError(
                    f"host {host.device} ({host.ssh}): tunnel to {target}: ssh exited: {err.strip()}"
                )
            try:
                socket.create_connection((listen, self.port), timeout=1).close()
                return
            except OSError:
                time.sleep(0.2)
        self.close()
        raise OpsError(f"host {host.device} ({host.ssh}): tunnel to {target}: not up within 20 s")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)
