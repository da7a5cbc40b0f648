"""The fleet lab: sites as network namespaces behind the NAT lab's real netfilter NATs
(tests/natlab/lab.py), each host with its own sshd and, for docker hosts, its own dockerd; native
hosts run members under a SIMULATED service manager (tests/ops/simulated_service_manager.py).

    operator (this namespace) --ssh, ProxyCommand nsenter into the host's namespace--> sshd (127.0.0.1:22)
    h1: docker, behind a permissive NAT   h2: docker, behind an ordinary NAT
    h3: native, behind an ordinary NAT    rdv: the public rendezvous namespace (native)

The ProxyCommand stands for the operator's own path to each machine (a VPN or a jump host): it
carries only ssh; members reach each other and the rendezvous through the NATs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from tests.natlab.lab import Lab, Site
from tests.ops.simulated_service_manager import running

ROOT = Path(__file__).resolve().parents[2]
SHIM = Path(__file__).resolve().parent / "simulated_service_manager.py"
RELAY = """import os, socket, sys, threading
s = socket.create_connection(("127.0.0.1", 22))
def up():
    while b := os.read(0, 65536):
        s.sendall(b)
    s.shutdown(socket.SHUT_WR)
threading.Thread(target=up, daemon=True).start()
while b := s.recv(65536):
    os.write(1, b)
"""


def missing_requirements() -> str | None:
    from tests.natlab.lab import missing_requirements as natlab_missing

    why = natlab_missing()
    if why:
        return why
    for tool, package in (("sshd", "openssh-server"), ("dockerd", "docker.io"), ("nsenter", "util-linux"),
                          ("promtool", "prometheus"), ("docker-registry", "docker-registry")):  # fmt: skip
        if shutil.which(tool) is None and not Path(f"/usr/sbin/{tool}").exists():
            return f"the fleet lab needs {tool} (apt-get install {package})"
    return None


def sh(*args: str, timeout: float = 60) -> str:
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({done.returncode}): {done.stderr.strip()}")
    return done.stdout


@dataclass
class LabHost:
    alias: str  # the ssh config Host
    ns: str
    dir: Path
    docker: bool
    dockerd: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> str:
        return f"unix://{self.dir}/docker.sock"


@dataclass
class FleetLab:
    lab: Lab
    dir: Path  # short: unix socket paths have at most 108 bytes
    hosts: dict[str, LabHost] = field(default_factory=dict)
    sites: list[Site] = field(default_factory=list)
    stopped: list[str] = field(default_factory=list)  # hosts whose dockerd or sshd a test stopped

    def start(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        self.sites = [self.lab.add_site(k) for k in ("permissive", "ordinary", "ordinary")]
        spec = [("lab-h1", self.sites[0].host, True), ("lab-h2", self.sites[1].host, True),
                ("lab-h3", self.sites[2].host, False), ("lab-rdv", self.lab.rdv, False)]  # fmt: skip
        for alias, ns, docker in spec:
            d = self.dir / alias
            (d / "shim").mkdir(parents=True, exist_ok=True)
            self.hosts[alias] = LabHost(alias, ns, d, docker)
        self._keys()
        (self.dir / "relay.py").write_text(RELAY)
        Path("/run/sshd").mkdir(exist_ok=True)
        for h in self.hosts.values():
            self._sshd(h)
            if h.docker:
                self._dockerd(h)
        for h in self.hosts.values():
            if h.docker:
                self._wait_dockerd(h)

    def _keys(self) -> None:
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "hostkey"))
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.dir / "id"))
        shutil.copy(self.dir / "id.pub", self.dir / "authorized_keys")
        host_pub = (self.dir / "hostkey.pub").read_text().split()[:2]
        (self.dir / "known_hosts").write_text(f"{','.join(self.hosts)} {' '.join(host_pub)}\n")

    def ssh_config(self) -> str:
        blocks = []
        for h in self.hosts.values():
            blocks.append(
                f"Host {h.alias}\n  HostName 127.0.0.1\n  User root\n  HostKeyAlias {h.alias}\n"
                f"  IdentityFile {self.dir}/id\n  IdentitiesOnly yes\n"
                f"  UserKnownHostsFile {self.dir}/known_hosts\n"
                f"  StrictHostKeyChecking yes\n  LogLevel ERROR\n"
                f"  ProxyCommand nsenter --net=/var/run/netns/{h.ns} python3 {self.dir}/relay.py\n"
            )
        return "\n".join(blocks)

    def _sshd(self, h: LabHost) -> None:
        shim_path = ""
        if not h.docker:  # the simulated service manager comes first on a native host's PATH
            bin_dir = h.dir / "bin"
            bin_dir.mkdir(exist_ok=True)
            for tool in ("systemd-run", "systemctl", "journalctl"):
                (bin_dir / tool).unlink(missing_ok=True)
                (bin_dir / tool).symlink_to(SHIM)
            shim_path = f"{bin_dir}:"
        env = (
            f"PATH={shim_path}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "
            f"KAFILA_SHIM_DIR={h.dir}/shim KAFILA_LOG=json"
        )  # no PYTHONPATH: native members run kafila from the fleet file's venv (tests/ops/labvenv.py)
        if h.docker:
            env += f" DOCKER_HOST={h.socket}"
        conf = h.dir / "sshd_config"
        conf.write_text(
            f"ListenAddress 127.0.0.1\nPort 22\nHostKey {self.dir}/hostkey\nPidFile {h.dir}/sshd.pid\n"
            f"AuthorizedKeysFile {self.dir}/authorized_keys\nPermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
            f"SetEnv {env}\n"
        )
        sh(
            "nsenter",
            f"--net=/var/run/netns/{h.ns}",
            "/usr/sbin/sshd",
            "-f",
            str(conf),
            "-E",
            str(h.dir / "sshd.log"),
        )

    def _dockerd(self, h: LabHost) -> None:
        log = (h.dir / "dockerd.log").open("wb")
        # nsenter, not `ip netns exec`: that remounts /sys, and dockerd then finds no devices cgroup
        h.dockerd = subprocess.Popen(
            ["nsenter", f"--net=/var/run/netns/{h.ns}", "dockerd", "--data-root", str(h.dir / "data"),
             "--exec-root", str(h.dir / "exec"), "-H", h.socket, "--pidfile", str(h.dir / "docker.pid"),
             "--bridge=none", "--iptables=false"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
        log.close()  # dockerd has its own descriptor

    def _wait_dockerd(self, h: LabHost) -> None:
        deadline = time.monotonic() + 60
        while subprocess.run(["docker", "-H", h.socket, "info"], capture_output=True).returncode != 0:
            if time.monotonic() > deadline or (h.dockerd and h.dockerd.poll() is not None):
                raise RuntimeError(
                    f"dockerd in {h.ns} did not start: {(h.dir / 'dockerd.log').read_text()[-2000:]}"
                )
            time.sleep(0.5)

    def stop_dockerd(self, alias: str) -> None:
        """Docker stopped on a host (its containers stop with it; its data stays)."""
        h = self.hosts[alias]
        assert h.dockerd is not None
        h.dockerd.send_signal(signal.SIGTERM)
        h.dockerd.wait(timeout=120)
        self.stopped.append(alias)

    def stop_sshd(self, alias: str) -> None:
        """A host that ssh can no longer reach: its sshd gone (members it started keep running)."""
        h = self.hosts[alias]
        pid = int((h.dir / "sshd.pid").read_text())
        os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        self.stopped.append(alias)

    def restore(self) -> None:
        """Start again what stop_dockerd and stop_sshd stopped."""
        for alias in self.stopped:
            h = self.hosts[alias]
            if h.docker and (h.dockerd is None or h.dockerd.poll() is not None):
                self._dockerd(h)
                self._wait_dockerd(h)
            if not self._sshd_alive(h):
                self._sshd(h)
        self.stopped.clear()

    @staticmethod
    def _sshd_alive(h: LabHost) -> bool:
        try:
            return Path(f"/proc/{int((h.dir / 'sshd.pid').read_text())}").exists()
        except (OSError, ValueError):
            return False

    def mounts(self) -> list[str]:
        with open("/proc/mounts") as f:
            points = [line.split()[1] for line in f]
        return sorted((p for p in points if p.startswith(f"{self.dir}/")), reverse=True)

    def leftovers(self) -> list[str]:
        """Containers of any lab dockerd and processes started under the simulated service manager."""
        left = []
        for h in self.hosts.values():
            if h.docker:
                ids = sh("docker", "-H", h.socket, "ps", "-aq").split()
                left += [f"{h.alias}: container {i}" for i in ids]
            for pid_file in (h.dir / "shim").glob("*.pid"):  # a unit whose process exited is collected
                if running(int(pid_file.read_text())):
                    left.append(f"{h.alias}: service {pid_file.stem} (pid {pid_file.read_text()})")
        deadline = time.monotonic() + 10  # ssh connections (and their ProxyCommand) close in a moment
        while (relays := self.ssh_connections()) and time.monotonic() < deadline:
            time.sleep(0.5)
        return left + [f"ssh connection through {pid}" for pid in relays]

    def ssh_connections(self) -> list[int]:
        """Processes carrying an ssh connection into the lab (the ProxyCommand of each one)."""
        relay = f"{self.dir}/relay.py".encode()
        pids = []
        for proc in Path("/proc").iterdir():
            try:
                if proc.name.isdigit() and relay in (proc / "cmdline").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                continue
        return pids

    def close(self) -> None:
        for h in self.hosts.values():
            if h.docker and h.dockerd is not None and h.dockerd.poll() is None:
                ids = sh("docker", "-H", h.socket, "ps", "-aq").split()
                if ids:
                    subprocess.run(
                        ["docker", "-H", h.socket, "rm", "-f", *ids], capture_output=True, timeout=120
                    )
                h.dockerd.send_signal(signal.SIGTERM)
                try:
                    h.dockerd.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    h.dockerd.kill()
            for pid_file in (h.dir / "shim").glob("*.pid"):  # a service the test left running
                with contextlib.suppress(OSError, ValueError):
                    os.killpg(int(pid_file.read_text()), signal.SIGKILL)
            pid = h.dir / "sshd.pid"
            if pid.exists():
                with contextlib.suppress(OSError, ValueError):
                    os.kill(int(pid.read_text()), signal.SIGTERM)
        for mount in self.mounts():  # dockerd leaves its namespace bound at exec-root/netns/default
            subprocess.run(["umount", "-l", mount], capture_output=True, timeout=60)
        for h in self.hosts.values():
            if (h.dir / "data").exists():
                subprocess.run(["rm", "-rf", str(h.dir / "data")], capture_output=True, timeout=300)
        shutil.rmtree(self.dir, ignore_errors=True)
