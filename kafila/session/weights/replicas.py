"""On-disk replicas: each member also keeps, in its blob cache, the shard of the member after it in
the ring, so every block lives on at least two members' disks (its own member's and the one
before it) and a member that is lost leaves its blocks on a survivor, which serves them by range.

Pure: which tensors a member keeps for a plan, within its bound (`--replica-bytes`). The fetch
itself (kafila.session.weights.sharing) runs after the member's own shard, two requests at a time,
from the same sources as any fetch: members that hold them, a mirror, the host.
"""

from __future__ import annotations

from kafila.models.manifest import stage_tensors
from kafila.planner.plan import Plan
from kafila.session.weights.manifest import WeightManifest

DEFAULT_REPLICA_BYTES = 16_000_000_000  # --replica-bytes: what a member keeps for others at most


def replica_stage(plan: Plan, me: str) -> tuple[str, range, bool] | None:
    """Whose shard `me` keeps (the next member in the ring): (name, blocks, head); None alone."""
    nxt = plan.successor(me)
    if nxt == me:
        return None
    stage = plan.stage(nxt)
    return nxt, range(stage.start, stage.stop), stage.head


def replica_names(m: WeightManifest, plan: Plan, me: str, bound: int) -> list[str]:
    """The tensors `me` keeps for the next member, in block order, minus its own shard's, as many
    as fit in `bound` bytes (a tensor that does not fit is left out, smaller later ones still go)."""
    theirs = replica_stage(plan, me)
    if theirs is None or bound <= 0:
        return []
    _, blocks, head = theirs
    own = plan.stage(me)
    mine = set(stage_tensors(m.tensors, range(own.start, own.stop), own.head))
    out, used = [], 0
    for name in stage_tensors(m.tensors, blocks, head):
        n = m.tensors[name].nbytes
        if name not in mine and used + n <= bound:
            out.append(name)
            used += n
    return out
