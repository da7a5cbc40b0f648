#!/usr/bin/env bash
# Make `docker compose up rendezvous` (from the repository root) work where containers reach no
# registry and no package index: pick the base image and the wheelhouse and write them to ./.env,
# which `docker compose` reads from the repository root.
#
#   step 1/2  base image: the registry's python:3.11-slim-bookworm when it can be pulled, else the
#             local kafila/python-base:bookworm (compose/build-base-image.sh: debootstrap, cached)
#   step 2/2  wheelhouse: ./wheelhouse built on the host (compose/build-wheelhouse.sh), since pip
#             inside containers here cannot reach (or does not trust) the package index
#
#   KAFILA_EXTRAS=torch  also put the member image's wheels in the wheelhouse (Dockerfile.cuda)
#   OFFLINE=1            skip the registry check and build the local base image
set -euo pipefail
cd "$(dirname "$0")/.."
say() { printf 'kafila compose: %s\n' "$*" >&2; }

registry_base=python:3.11-slim-bookworm
local_base=${KAFILA_BASE_IMAGE:-kafila/python-base:bookworm}
docker info >/dev/null 2>&1 || { say "no Docker engine answers (start dockerd, or check DOCKER_HOST)"; exit 1; }

if [[ "${OFFLINE:-0}" != 1 ]] && docker image inspect "$registry_base" >/dev/null 2>&1; then
    base=$registry_base
    say "step 1/2 base image: $base (present)"
elif [[ "${OFFLINE:-0}" != 1 ]] && timeout 60 docker pull -q "$registry_base" >/dev/null 2>&1; then
    base=$registry_base
    say "step 1/2 base image: $base (pulled)"
else
    base=$local_base
    say "step 1/2 base image: no registry reachable; building $base with debootstrap (once, about two minutes)"
    bash compose/build-base-image.sh || { say "step 1/2 base image failed: see the lines above"; exit 1; }
fi

say "step 2/2 wheelhouse: building ./wheelhouse on the host (dependencies cached between runs)"
bash compose/build-wheelhouse.sh || { say "step 2/2 wheelhouse failed: see the lines above"; exit 1; }

{
    echo "# written by compose/prepare.sh: the base image and wheelhouse docker compose builds from"
    echo "KAFILA_BASE_IMAGE=$base"
    echo "KAFILA_WHEELHOUSE=wheelhouse"
} > .env
say "wrote .env (KAFILA_BASE_IMAGE=$base, KAFILA_WHEELHOUSE=wheelhouse); now: docker compose up -d rendezvous"
