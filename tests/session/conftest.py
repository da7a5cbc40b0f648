"""Fixtures the session tests borrow: the NAT lab (root) from tests/natlab."""

from tests.natlab.conftest import natlab

__all__ = ["natlab"]
