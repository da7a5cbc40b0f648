#!/usr/bin/env bash
# Build the local base image the rendezvous container starts from, when it is missing.
#
# There is no Docker Hub here (and many air-gapped hosts have none), so the base image is made
# with debootstrap: Debian bookworm minbase + python3, venv, pip, ca-certificates, piped into
# `docker import`. Once built it is cached by the Docker engine under $KAFILA_BASE_IMAGE.
#
#   KAFILA_BASE_IMAGE  image name to build (default kafila/python-base:bookworm)
#   DEBIAN_MIRROR      Debian mirror (default: the first URI in /etc/apt, else deb.debian.org)
#   FORCE=1            rebuild even if the image exists
set -euo pipefail

image="${KAFILA_BASE_IMAGE:-kafila/python-base:bookworm}"
if [[ "${FORCE:-0}" != 1 ]] && docker image inspect "$image" >/dev/null 2>&1; then
    echo "base image $image already present" >&2
    exit 0
fi
command -v debootstrap >/dev/null || { echo "debootstrap is not installed (apt-get install debootstrap)" >&2; exit 1; }
[[ $(id -u) == 0 ]] || { echo "debootstrap needs root" >&2; exit 1; }

mirror="${DEBIAN_MIRROR:-}"
if [[ -z "$mirror" ]]; then
    mirror=$(grep -rhoE '^(URIs:|deb) +https?://[^ ]+/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d 2>/dev/null \
        | head -n1 | awk '{print $2}' || true)
    mirror="${mirror:-http://deb.debian.org/debian}"
fi

root=$(mktemp -d /tmp/kafila-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "debootstrap bookworm from $mirror into $root" >&2
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
    bookworm "$root" "$mirror" >&2
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'CMD ["/bin/bash"]' \
    - "$image" >/dev/null
echo "built $image" >&2
