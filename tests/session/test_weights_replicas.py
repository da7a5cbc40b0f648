"""Which tensors a member keeps for the next one in the ring (kafila.session.weights.replicas)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kafila.planner.plan import Plan
from kafila.planner.plan import Stage as PlanStage
from kafila.session.weights.manifest import describe
from kafila.session.weights.replicas import replica_names, replica_stage

SPLITS = {"m0": (0, 2), "m1": (2, 4), "m2": (4, 5)}


def plan_of(splits: dict[str, tuple[int, int]]) -> Plan:
    stages = tuple(PlanStage(n, a, b, n == "m0", None, 0, 0) for n, (a, b) in splits.items())
    return Plan("kafila", True, None, "working_set", "test", tuple(splits), "m0", stages, (), 5, 64, 1)


@pytest.fixture(scope="module")
def manifest(tiny_checkpoint, tmp_path_factory):
    return describe(Path(tiny_checkpoint("llama-mha-untied")), cache=tmp_path_factory.mktemp("hashes"))


def test_each_member_keeps_the_next_ones_shard_so_every_tensor_is_on_two_members(manifest) -> None:
    plan = plan_of(SPLITS)
    assert replica_stage(plan, "m2") == ("m0", range(0, 2), True)  # the last keeps the head's
    kept = {n: set(replica_names(manifest, plan, n, 1 << 40)) for n in SPLITS}
    for name in manifest.tensors:
        owners = [n for n, (a, b) in SPLITS.items() if name in _stage(manifest, plan, n)]
        keepers = [n for n in SPLITS if name in kept[n]]
        assert len(set(owners) | set(keepers)) >= 2, name
    assert kept["m0"].isdisjoint(_stage(manifest, plan, "m0"))  # its own shard is not counted twice


def test_the_bound_keeps_what_fits_and_a_member_alone_keeps_nothing(manifest) -> None:
    plan = plan_of(SPLITS)
    everything = replica_names(manifest, plan, "m2", 1 << 40)
    sizes = [manifest.tensors[n].nbytes for n in everything]
    bound = sum(sizes) // 2
    some = replica_names(manifest, plan, "m2", bound)
    assert 0 < len(some) < len(everything) and sum(manifest.tensors[n].nbytes for n in some) <= bound
    assert replica_names(manifest, plan, "m2", 0) == []
    assert replica_names(manifest, plan_of({"m0": (0, 5)}), "m0", 1 << 40) == []


def _stage(manifest, plan: Plan, name: str) -> set[str]:
    from kafila.models.manifest import stage_tensors

    s = plan.stage(name)
    return set(stage_tensors(manifest.tensors, range(s.start, s.stop), s.head))
