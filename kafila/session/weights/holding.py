"""What this member's weight cache holds of a checkpoint, for the report it joins with.

A member keeps the manifest of each checkpoint it fetched from (`<cache>/weights/<ckpt16>/
manifest.json`, written when it came). Joining a session, it reads the manifest of the checkpoint
the host names (its id, the digest of its safetensors headers, is in the host's capability) and
reports the blocks whose tensors its blob store holds in full, and whether it holds the head's
(`kafila.planner.held.Held`): the planner then prefers, among plans about as fast, the one that
fetches least from the host. Blocking (a blob changed since it was stored is hashed): run it on a
thread.

A report is a claim: the fetch that follows checks every tensor against the host's manifest
whatever it says, and a member asked for a range it turns out not to hold refuses it, so a wrong
report costs bytes from the host, never a wrong weight.
"""

from __future__ import annotations

import json
from pathlib import Path

from kafila.models.manifest import stage_tensors
from kafila.obs.log import get_logger
from kafila.planner.held import Held
from kafila.session.weights.cache import BlobStore, cache_root, write_atomic
from kafila.session.weights.manifest import WeightManifest, WeightsError

log = get_logger("kafila.session.weights")


def manifest_path(root: Path, checkpoint: str) -> Path:
    return root / "weights" / checkpoint[:16] / "manifest.json"


def remember(cache: Path | None, m: WeightManifest) -> None:
    """Keep `m` beside the checkpoint's cached headers (what a later join reports from)."""
    path = manifest_path(cache_root(cache), m.checkpoint)
    try:
        write_atomic(path, [json.dumps(m.to_json()).encode()], durable=False)
    except OSError as exc:  # the fetch itself says what is wrong with the cache
        log.warning("weights_manifest_not_kept", path=str(path), error=str(exc))


def held_in_cache(cache: Path | None, checkpoint: str | None) -> Held:
    """The blocks (and head) of `checkpoint` this member's blob store holds in full; nothing when
    it never fetched from that checkpoint or its manifest there does not read."""
    if not checkpoint:
        return Held()
    root = cache_root(cache)
    try:
        m = WeightManifest.from_json(json.loads(manifest_path(root, checkpoint).read_text()))
    except FileNotFoundError:
        return Held()
    except (OSError, ValueError, WeightsError) as exc:
        log.warning("weights_manifest_unreadable", checkpoint=checkpoint[:16], error=str(exc))
        return Held()
    if m.checkpoint != checkpoint:
        return Held()
    blobs = BlobStore(root / "blobs")
    have = {
        e.name for e in m.tensors.values() if blobs.has(e.key, e.name, e.dtype, e.shape, e.nbytes, e.sha256)
    }

    def whole(names: list[str]) -> bool:
        return bool(names) and all(n in have for n in names)

    blocks = frozenset(
        b for b in range(m.n_blocks) if whole(stage_tensors(m.tensors, range(b, b + 1), False))
    )
    head = whole(stage_tensors(m.tensors, range(0), True))
    return Held(blocks, head)
