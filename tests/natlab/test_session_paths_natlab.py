"""A session across the NAT lab's router with open WAN input, and a direct path the NAT classes
cannot see (root; real `kafila` processes, the offline default model).

The host sits behind a port-restricted router whose own stack takes unsolicited input (the lab's
`ordinary-open`): its edge with a port-restricted member relayed in 6 of 6 links before the
classifier knew such routers; now it is predicted, and punched, direct. A third member behind a
full cone would punch to the host too, but both routers drop that path (simulated with nft rules
before it joins: a path the classes cannot see): the host's link with it relays, the plan is
corrected before it is sent, and /session, the plan's edges and its predicted costs say so.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from tests.natlab.lab import OPEN_KIND, Lab
from tests.session.test_session_natlab import API, asks_paris, rdv, spawn, stop, wait_for

pytestmark = [pytest.mark.root, pytest.mark.slow, pytest.mark.network]
__all__ = ["rdv"]

SESSION = f"""
import httpx, json
print(json.dumps(httpx.get("http://{API}/session", timeout=30).json()))
"""


async def session_document(ns: str) -> dict:  # type: ignore[type-arg]
    got = await asyncio.to_thread(
        subprocess.run,
        ["ip", "netns", "exec", ns, sys.executable, "-c", SESSION],
        capture_output=True,
        timeout=60,
    )
    return json.loads(got.stdout)  # type: ignore[no-any-return]


async def test_a_session_across_the_open_router_punches_and_a_path_the_classes_miss_is_planned_relayed(
    natlab: Lab, rdv, smollm2_path, tmp_path
) -> None:
    host_site, port_site, cone_site = (natlab.add_site(k) for k in (OPEN_KIND, "ordinary", "permissive"))
    natlab.block_direct(host_site, cone_site)
    names = ["alpha", "beta", "gamma"]
    logs = [tmp_path / f"{n}.log" for n in names]
    code_file = tmp_path / "code"
    common = ["--rendezvous", rdv.url, "--api", API]
    procs = [spawn(host_site.host, ["host", "--members", "3", "--name", "alpha", "--context", "512",
                                    "--code-file", str(code_file), *common], logs[0])]  # fmt: skip
    try:
        await wait_for(code_file.exists, 120, "session code", procs)
        code = code_file.read_text().strip()
        for site, name, log in zip((port_site, cone_site), names[1:], logs[1:], strict=True):
            procs.append(spawn(site.host, ["join", code, "--name", name, *common], log))
        await wait_for(lambda: "session ready" in logs[0].read_text(), 300, "session ready", procs)
        host_log = logs[0].read_text()
        assert "plan corrected with the measured paths: alpha->gamma" in host_log or (
            "plan corrected with the measured paths: gamma->alpha" in host_log
        ), host_log
        doc = await session_document(host_site.host)
        planned = {frozenset(e["edge"].split("->")): e for e in doc["links"] if "->" in e["edge"]}
        for pair, path in (({"alpha", "beta"}, "direct"), ({"alpha", "gamma"}, "relay")):
            link = planned[frozenset(pair)]
            assert link["path"] == path and link["planned_path"] == path, link
        assert planned[frozenset({"beta", "gamma"})]["planned_path"] == "direct"
        chosen = doc["plan"]["chosen"]
        assert sum(not e["direct"] for e in chosen["edges"]) == 1
        assert doc["plan"]["divisions"]["kafila"] == chosen
        await asks_paris(port_site.host)
    finally:
        natlab.unblock_all()
        stop(procs)
