"""NAT behaviour classes and the rule that predicts whether two members can reach each other directly.

Classes follow RFC 4787 as the paper uses them: permissive (endpoint-independent mapping and
filtering), restrictive (endpoint-dependent mapping: symmetric), ordinary in between (endpoint-
independent mapping, filtering that depends on the remote address or address and port).

A pair rule is any `predict(a, b) -> bool` (True: predicted direct). The planner takes it as a
parameter. Two rules ship:
- `PAPER_RULE`: direct iff at least one endpoint is permissive (the paper's Section V-B rule).
- `LINUX_RULE`: what coordinated punching achieved between real Linux netfilter NATs (tests/natlab):
  permissive with anything direct; ordinary with ordinary direct; ordinary with address-dependent
  filtering with restrictive direct; ordinary with port-dependent (or unknown) filtering with
  restrictive relayed; restrictive with restrictive relayed.
A member whose NAT is unknown is predicted as restrictive: the rule then errs towards a relay,
which costs nothing if the edge connects anyway.

A router whose own stack takes unsolicited packets on its WAN address (`Nat.open_input`, no input
firewall) keeps every unsolicited packet to a member's mapped port as a flow of its own, which
moves the member's later flows to another port (measured in the NAT lab, docs/links.md). Such a
member publishes that port too and probes before its peer can (kafila.net.edge), which punches
with a peer that takes any port of its address (permissive, address-restricted) and with a
port-restricted one; two such routers, or one with a restrictive peer, relay. The address-
restricted variant with open input is not built in the lab: it is predicted as measured for the
port-restricted one where that is safe (direct with permissive and address-restricted peers) and
relayed otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any


class NatClass(StrEnum):
    PERMISSIVE = "permissive"
    ORDINARY = "ordinary"
    RESTRICTIVE = "restrictive"


class Behaviour(StrEnum):
    """RFC 4787 mapping or filtering behaviour."""

    ENDPOINT_INDEPENDENT = "endpoint-independent"
    ADDRESS_DEPENDENT = "address-dependent"
    ADDRESS_AND_PORT_DEPENDENT = "address-and-port-dependent"


@dataclass(frozen=True)
class Nat:
    """A member's classified NAT: the class plus, when measured, the fine-grained behaviour."""

    cls: NatClass
    mapping: Behaviour | None = None
    filtering: Behaviour | None = None
    # the router's own stack took an unsolicited packet on the mapped port, which then moved the
    # mapping to that sender (classify.decide: (A',P') mapped elsewhere than (A,P) and (A',P'))
    open_input: bool = False

    def to_dict(self) -> dict[str, str | bool | None]:
        return {
            "cls": self.cls.value,
            "mapping": self.mapping.value if self.mapping else None,
            "filtering": self.filtering.value if self.filtering else None,
            "open_input": self.open_input,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Nat:
        mapping, filtering = d.get("mapping"), d.get("filtering")
        return cls(
            NatClass(str(d["cls"])),
            Behaviour(mapping) if mapping else None,
            Behaviour(filtering) if filtering else None,
            bool(d.get("open_input", False)),
        )

    @classmethod
    def of(cls, value: str | NatClass | Nat | None) -> Nat:
        if isinstance(value, Nat):
            return value
        return UNKNOWN if value is None else cls(NatClass(value))


UNKNOWN = Nat(NatClass.RESTRICTIVE)

PairRule = Callable[[Nat, Nat], bool]


def paper_rule(a: Nat, b: Nat) -> bool:
    """The paper's rule: an edge can be direct only if at least one endpoint is permissive."""
    return NatClass.PERMISSIVE in (a.cls, b.cls)


def _linux_kind(n: Nat) -> str:
    """Collapse a NAT into the rows of the measured table."""
    if n.cls is not NatClass.ORDINARY:
        return n.cls.value
    open_input = "-open" if n.open_input else ""
    if n.filtering in (Behaviour.ADDRESS_DEPENDENT, Behaviour.ENDPOINT_INDEPENDENT):
        return "ordinary-address" + open_input
    return "ordinary-port" + open_input  # plain MASQUERADE filters on address and port; unknown too


# unordered pairs predicted direct; every other pair is predicted relayed
_LINUX_TABLE: frozenset[frozenset[str]] = frozenset(
    frozenset(pair)
    for pair in [
        ("permissive", "permissive"),
        ("permissive", "ordinary-address"),
        ("permissive", "ordinary-port"),
        ("permissive", "restrictive"),
        ("ordinary-address", "ordinary-address"),
        ("ordinary-address", "ordinary-port"),
        ("ordinary-port", "ordinary-port"),
        ("ordinary-address", "restrictive"),
        # a router with open input (see the module docstring)
        ("permissive", "ordinary-port-open"),
        ("ordinary-port", "ordinary-port-open"),
        ("permissive", "ordinary-address-open"),
        ("ordinary-address", "ordinary-port-open"),
        ("ordinary-address", "ordinary-address-open"),
    ]
)


def linux_rule(a: Nat, b: Nat) -> bool:
    """Coordinated punching as measured between Linux netfilter NATs (the NAT lab, tests/natlab)."""
    return frozenset((_linux_kind(a), _linux_kind(b))) in _LINUX_TABLE


PAPER_RULE: PairRule = paper_rule
LINUX_RULE: PairRule = linux_rule
DEFAULT_RULE: PairRule = LINUX_RULE
RULES: dict[str, PairRule] = {"paper": PAPER_RULE, "linux": LINUX_RULE}
