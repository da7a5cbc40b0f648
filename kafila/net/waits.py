"""Waiting with a time limit, without losing a cancellation."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_at_most(aw: Awaitable[T], timeout: float | None) -> T:
    """`await aw`, raising TimeoutError after `timeout` s (None: no limit), as `asyncio.wait_for`.

    Python 3.11's `wait_for` loses a cancellation that arrives as `aw` completes: it returns the
    result, and the cancelled task goes on (a join cancelled while its NAT probe's answer arrived
    went on forming, and whoever awaited it hung). `asyncio.timeout` keeps it."""
    async with asyncio.timeout(timeout):
        return await aw
