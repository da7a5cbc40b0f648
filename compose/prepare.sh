#!/usr/bin/env bash
# Make `docker compose up rendezvous` (from the repository root) work where containers reach no
# registry and no package index: pick the base image, build the wheelhouse, and either write them to
# ./.env (which `docker compose` reads from the repository root; Debian's docker-compose v1 from
# compose/ too) or, with --build, build the rendezvous image itself.
#
#   step 1  base image: the registry's python:3.11-slim-bookworm when it can be pulled, else the
#           local kafila/python-base:bookworm (compose/build-base-image.sh: debootstrap, cached)
#   step 2  wheelhouse: ./wheelhouse built on the host (compose/build-wheelhouse.sh), since pip
#           inside containers here cannot reach (or does not trust) the package index; skipped when
#           the digest of the wheel's inputs (sources, not __pycache__ or numba caches) is unchanged
#           and it was built with the same extras (or none are asked for)
#   step 3  (--build) the rendezvous image, $KAFILA_RENDEZVOUS_IMAGE (default kafila/rendezvous:latest)
#
# `docker compose up rendezvous` (Compose v2) runs this with --build through compose/kafila-prepare,
# a Compose provider: nothing to run by hand there. By hand: `compose/prepare.sh` then
# `docker compose build`, or with Debian's docker-compose v1 from compose/.
#
#   KAFILA_EXTRAS=torch  also put the member image's wheels in the wheelhouse (Dockerfile.cuda)
#   OFFLINE=1            skip the registry check and build the local base image
#   KAFILA_COMPOSE_PROVIDER=1  (set by compose/kafila-prepare) progress as Compose provider JSON
#                        lines on stdout; the tools' own output goes to $KAFILA_PREPARE_LOG
set -euo pipefail
cd "$(dirname "$0")/.."
build=0
[[ "${1:-}" == --build ]] && build=1
steps=$((2 + build))
provider=${KAFILA_COMPOSE_PROVIDER:-0}
log=${KAFILA_PREPARE_LOG:-${TMPDIR:-/tmp}/kafila-compose-prepare.log}
if [[ "$provider" == 1 ]]; then
    exec 3>&1 >"$log" 2>&1  # fd 3: compose reads JSON lines there; everything else to the log
fi
json() { python3 -c 'import json, sys; print(json.dumps({"type": sys.argv[1], "message": sys.argv[2]}))' "$1" "$2"; }
say() {
    if [[ "$provider" == 1 ]]; then json info "$*" >&3; else printf 'kafila compose: %s\n' "$*" >&2; fi
}
fail() {
    if [[ "$provider" == 1 ]]; then
        json error "$* (compose/prepare.sh; its log, $log, ends:
$(tail -n 15 "$log"))" >&3
    else
        printf 'kafila compose: %s\n' "$*" >&2
    fi
    exit 1
}

registry_base=python:3.11-slim-bookworm
local_base=${KAFILA_BASE_IMAGE:-kafila/python-base:bookworm}
image=${KAFILA_RENDEZVOUS_IMAGE:-kafila/rendezvous:latest}
docker info >/dev/null 2>&1 || fail "no Docker engine answers (start dockerd, or check DOCKER_HOST)"

if [[ "${OFFLINE:-0}" != 1 ]] && docker image inspect "$registry_base" >/dev/null 2>&1; then
    base=$registry_base
    say "step 1/$steps base image: $base (present)"
elif [[ "${OFFLINE:-0}" != 1 ]] && timeout 60 docker pull -q "$registry_base" >/dev/null 2>&1; then
    base=$registry_base
    say "step 1/$steps base image: $base (pulled)"
elif docker image inspect "$local_base" >/dev/null 2>&1; then
    base=$local_base
    say "step 1/$steps base image: no registry reachable; $base (present, built before)"
else
    base=$local_base
    say "step 1/$steps base image: no registry reachable; building $base with debootstrap (once, about two minutes)"
    bash compose/build-base-image.sh || fail "step 1/$steps base image failed: compose/build-base-image.sh (debootstrap, as root, from a Debian mirror)"
fi

# The wheel's real inputs: what setuptools packs (the kafila and ops packages' sources and data,
# pyproject.toml, README.md), never the caches Python and numba write beside them; a digest of their
# contents, so that a touched but unchanged file rebuilds nothing and the image keeps its id.
inputs_digest() {
    find kafila ops -type d \( -name __pycache__ -o -name '.*' \) -prune -o -type f \
        ! -name '*.py[co]' ! -name '*.nbi' ! -name '*.nbc' -print0 \
        | LC_ALL=C sort -z | xargs -0 sha256sum
    sha256sum pyproject.toml README.md
}
digest=$(inputs_digest | sha256sum | cut -d' ' -f1)
# The stamp: the inputs' digest, then the extras the wheelhouse was built with. It is up to date when
# the digest matches and it was built with the extras asked for, or none are asked for (the
# rendezvous image installs the core wheels from a wheelhouse that also holds the member's).
extras="extras=${KAFILA_EXTRAS:-} wheels=${KAFILA_EXTRA_WHEELS:-}"
stamp=$(cat wheelhouse/kafila/inputs.sha256 2>/dev/null || true)
wheel=$(ls wheelhouse/kafila/kafila-*.whl 2>/dev/null | head -n1 || true)
if [[ -n "$wheel" && ( "$stamp" == "$digest"$'\n'"$extras" \
      || ( "$extras" == "extras= wheels=" && "${stamp%%$'\n'*}" == "$digest" ) ) ]]; then
    say "step 2/$steps wheelhouse: ./wheelhouse is up to date with the source (inputs ${digest:0:12})"
else
    say "step 2/$steps wheelhouse: building ./wheelhouse on the host (dependencies cached between runs)"
    bash compose/build-wheelhouse.sh || fail "step 2/$steps wheelhouse failed"
    printf '%s\n%s\n' "$digest" "$extras" > wheelhouse/kafila/inputs.sha256
fi

if [[ "$build" == 1 ]]; then
    say "step 3/$steps image: building $image from $base and ./wheelhouse"
    old=$(docker image inspect --format '{{.Id}}' "$image" 2>/dev/null || true)
    docker build -f Dockerfile.rendezvous --build-arg "BASE_IMAGE=$base" --build-arg WHEELHOUSE=wheelhouse \
        -t "$image" . || fail "step 3/$steps image $image failed to build"
    new=$(docker image inspect --format '{{.Id}}' "$image")
    if [[ -n "$old" && "$old" != "$new" ]]; then  # the replaced image, dangling now: not left behind
        docker image rm "$old" >/dev/null 2>&1 && say "removed the replaced image ${old:7:12}" || true
    fi
    say "ready: $image"
    exit 0
fi
{
    echo "# written by compose/prepare.sh: the base image and wheelhouse docker compose builds from"
    echo "KAFILA_BASE_IMAGE=$base"
    echo "KAFILA_WHEELHOUSE=wheelhouse"
} > .env
say "wrote .env (KAFILA_BASE_IMAGE=$base, KAFILA_WHEELHOUSE=wheelhouse); now: docker compose build (or docker-compose up -d rendezvous from compose/)"
