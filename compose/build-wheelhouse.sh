#!/usr/bin/env bash
# Build ./wheelhouse: the kafila wheel plus every core dependency, on the host, so the rendezvous
# image can be built with no package index (containers here do not trust the host's CA and there
# is no Docker Hub). Dependency wheels are kept between runs; the kafila wheel is always rebuilt.
#
#   WHEELHOUSE  output folder inside the repository (default: wheelhouse)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${WHEELHOUSE:-wheelhouse}"
mkdir -p "$out"
rm -f "$out"/kafila-*.whl
python3 -m pip wheel --quiet --wheel-dir "$out" --find-links "$out" .
ls "$out" >&2
