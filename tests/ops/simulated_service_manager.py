#!/usr/bin/env python3
"""A SIMULATED service manager for the fleet lab's native hosts: `systemd-run`, `systemctl` and
`journalctl` (installed as links to this file, first on the sshd's PATH) record every call as a JSON
line in $KAFILA_SHIM_DIR/calls.jsonl and do what `kafila-ops` asks of the real ones, for user units:
start a command detached in its own session (its output in UNIT.log, its pid in UNIT.pid), stop it
(SIGTERM, then SIGKILL), say whether it is active, and print its log. There is no systemd in the
lab's namespaces; everything around it (ssh, the member, the session) is real.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("KAFILA_SHIM_DIR", "/tmp/kafila-shim"))


def record(tool: str, args: list[str]) -> None:
    STATE.mkdir(parents=True, exist_ok=True)
    with (STATE / "calls.jsonl").open("a") as f:
        f.write(json.dumps({"tool": tool, "args": args, "at": time.time()}) + "\n")


def unit_name(name: str) -> str:
    return name.removesuffix(".service")


def alive(unit: str) -> int | None:
    try:
        pid = int((STATE / f"{unit}.pid").read_text())
    except (OSError, ValueError):
        return None
    return pid if running(pid) else None


def running(pid: int) -> bool:
    """Whether process `pid` exists and has not exited (a zombie nobody reaped yet has)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def systemd_run(args: list[str]) -> int:
    unit, env, i = None, dict(os.environ), 0
    while i < len(args) and args[i].startswith("-"):
        flag = args[i]
        if flag in ("--user", "--collect"):
            i += 1
            continue
        value = args[i + 1]
        if flag == "--unit":
            unit = value
        elif flag == "--setenv":
            key, _, val = value.partition("=")
            env[key] = val
        i += 2  # --property, --description: recorded only
    if unit is None or i >= len(args):
        print("simulated systemd-run: needs --unit NAME and a command", file=sys.stderr)
        return 1
    if alive(unit):
        print(f"Failed to start transient service unit: Unit {unit}.service already exists.", file=sys.stderr)
        return 1
    log = (STATE / f"{unit}.log").open("ab")
    proc = subprocess.Popen(args[i:], stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True, cwd="/")  # fmt: skip
    (STATE / f"{unit}.pid").write_text(str(proc.pid))
    print(f"Running as unit: {unit}.service", file=sys.stderr)
    return 0


def systemctl(args: list[str]) -> int:
    words = [a for a in args if a != "--user"]
    verb, units = words[0], [unit_name(u) for u in words[1:]]
    if verb == "stop":
        for unit in units:
            pid = alive(unit)
            if pid is None:  # exited already: --collect leaves nothing of it behind
                (STATE / f"{unit}.pid").unlink(missing_ok=True)
                continue
            os.killpg(pid, signal.SIGTERM)
            deadline = time.monotonic() + 20
            while alive(unit) and time.monotonic() < deadline:
                time.sleep(0.2)
            if alive(unit):
                os.killpg(pid, signal.SIGKILL)
            (STATE / f"{unit}.pid").unlink(missing_ok=True)
        return 0
    if verb == "reset-failed":  # a unit whose process exited goes (with --collect it never stays)
        for unit in units:
            if alive(unit) is None:
                (STATE / f"{unit}.pid").unlink(missing_ok=True)
        return 0
    if verb == "is-active":
        active = all(alive(u) for u in units)
        print("active" if active else "inactive")
        return 0 if active else 3
    print(f"simulated systemctl: {verb} is not simulated", file=sys.stderr)
    return 1


def journalctl(args: list[str]) -> int:
    unit = unit_name(args[args.index("-u") + 1])
    n = int(args[args.index("-n") + 1]) if "-n" in args else 10
    path = STATE / f"{unit}.log"
    if path.exists():
        sys.stdout.write("".join(path.read_text(errors="replace").splitlines(keepends=True)[-n:]))
    return 0


if __name__ == "__main__":
    tool = Path(sys.argv[0]).name
    record(tool, sys.argv[1:])
    sys.exit(
        {"systemd-run": systemd_run, "systemctl": systemctl, "journalctl": journalctl}[tool](sys.argv[1:])
    )
