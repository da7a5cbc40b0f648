"""wait_at_most: a time limit that keeps a cancellation arriving as the awaited result does."""

import asyncio

import pytest

from kafila.net.waits import wait_at_most


async def test_a_cancellation_arriving_with_the_result_still_cancels():
    answer = asyncio.get_running_loop().create_future()
    waiting = asyncio.ensure_future(wait_at_most(asyncio.shield(answer), 5))
    await asyncio.sleep(0)  # waiting now awaits the answer
    answer.set_result("binding")  # the answer arrives (as a NAT probe's did) ...
    waiting.cancel()  # ... in the same turn as the cancellation
    with pytest.raises(asyncio.CancelledError):
        await waiting


async def test_the_result_comes_back_in_time_and_a_late_one_raises_timeout():
    assert await wait_at_most(asyncio.sleep(0.01, "ok"), 5) == "ok"
    with pytest.raises(TimeoutError):
        await wait_at_most(asyncio.sleep(5), 0.05)
    assert await wait_at_most(asyncio.sleep(0, "no limit"), None) == "no limit"
