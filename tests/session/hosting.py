"""A host started in-process (`kafila.session.forming.host.host`) and the code it prints."""

from __future__ import annotations

import asyncio
from typing import Any


async def code_of(code: asyncio.Future[Any], hosting: asyncio.Future[Any], within: float = 60.0) -> str:
    """The session code the host hands its `on_code` (`code`), or the host's own error when it ends
    without one: awaiting the code alone waited for good then. Fails after `within` s."""
    await asyncio.wait([code, hosting], timeout=within, return_when=asyncio.FIRST_COMPLETED)
    if code.done():
        return str(code.result())
    if hosting.done():
        hosting.result()  # raises why the host ended
        raise AssertionError("the host ended without opening a session")
    raise AssertionError(f"the host opened no session within {within:g} s")
