"""A number beyond a float in a client's frame (1e400 reads as inf) is refused with an error the
sender hears; before, the server took it, could not send it on, and dropped every joiner silently."""

from __future__ import annotations

import asyncio
import json

import pytest
from websockets.asyncio.client import connect

from kafila.net.signaling import SignalingClient
from tests.rendezvous.conftest import Factory, open_protected

pytestmark = pytest.mark.network


async def test_an_infinite_number_is_refused_by_name(start_rendezvous: Factory) -> None:
    server = await start_rendezvous()
    async with connect(server.url) as raw:
        frame = '{"v":2,"type":"open","model":"m","members_expected":2,"name":"h","capability":{"mem":1e400}}'
        await raw.send(frame)
        reply = json.loads(await asyncio.wait_for(raw.recv(), 5))
    assert reply["type"] == "error" and reply["code"] == "bad_message"
    assert "number 1e400 is beyond what a message may hold" in reply["message"]
    host = await SignalingClient.connect(server.url)  # the same open, written as a client can
    _opened, code = await open_protected(host, "m", 2, "h", {"mem": 1e300})
    member = await SignalingClient.connect(server.url)
    joined = await member.join(code, "j", {})  # the host's capability reaches the joiner
    assert next(m for m in joined.members if m.host).capability == {"mem": 1e300}
    await member.close()
    await host.close()
