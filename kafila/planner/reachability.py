"""NAT behaviour classes and the rule that predicts whether two members can reach each other directly.

Classes follow RFC 4787 as the paper uses them: permissive (endpoint-independent mapping and
filtering), restrictive (endpoint-dependent mapping: symmetric), ordinary in between (endpoint-
independent mapping, filtering that depends on the remote address or address and port).

A pair rule is any `predict(a, b) -> bool` (True: predicted direct). The planner takes it as a
parameter. Two rules ship:
- `PAPER_RULE`: direct iff at least one endpoint is permissive (the paper's Section V-B rule).
- `LINUX_RULE`: what coordinated punching achieved between real Linux netfilter NATs (facts.md):
  permissive with anything direct; ordinary with ordinary direct; ordinary with address-dependent
  filtering with restrictive direct; ordinary with port-dependent (or unknown) filtering with
  restrictive relayed; restrictive with restrictive relayed.
A member whose NAT is unknown is predicted as restrictive: the rule then errs towards a relay,
which costs nothing if the edge connects anyway.

E5 (links) may edit `_LINUX_TABLE` and `DEFAULT_RULE` after measuring in its NAT lab.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


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

    def to_dict(self) -> dict[str, str | None]:
        return {
            "cls": self.cls.value,
            "mapping": self.mapping.value if self.mapping else None,
            "filtering": self.filtering.value if self.filtering else None,
        }

    @classmethod
    def from_dict(cls, d: dict[str, str | None]) -> Nat:
        mapping, filtering = d.get("mapping"), d.get("filtering")
        return cls(
            NatClass(str(d["cls"])),
            Behaviour(mapping) if mapping else None,
            Behaviour(filtering) if filtering else None,
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
    if n.filtering in (Behaviour.ADDRESS_DEPENDENT, Behaviour.ENDPOINT_INDEPENDENT):
        return "ordinary-address"
    return "ordinary-port"  # plain MASQUERADE filters on address and port; unknown counts as that


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
    ]
)


def linux_rule(a: Nat, b: Nat) -> bool:
    """Coordinated punching as measured between Linux netfilter NATs (facts.md)."""
    return frozenset((_linux_kind(a), _linux_kind(b))) in _LINUX_TABLE


PAPER_RULE: PairRule = paper_rule
LINUX_RULE: PairRule = linux_rule
DEFAULT_RULE: PairRule = LINUX_RULE
RULES: dict[str, PairRule] = {"paper": PAPER_RULE, "linux": LINUX_RULE}
