"""The names members that arrive at a serving session keep (kafila.session.forming.arrivals)."""

from __future__ import annotations

from kafila.planner.devices import DeviceReport
from kafila.session.forming.arrivals import arrival_name

GB = 10**9


def test_a_member_coming_back_keeps_its_name_and_a_name_taken_gets_the_member_id() -> None:
    present = frozenset({"alpha", "gamma", "delta"})  # beta was lost
    beta = DeviceReport("beta", 8 * GB, 10e9)
    assert arrival_name(beta, 7, present) is beta  # back under its own name
    epsilon = DeviceReport("epsilon", 8 * GB, 10e9)
    assert arrival_name(epsilon, 8, present) is epsilon  # new
    twin = arrival_name(DeviceReport("gamma", 8 * GB, 10e9), 9, present)
    assert twin.name == "gamma-9" and twin.memory_bytes == 8 * GB  # gamma serves: told apart by id
