"""A small client of the Chrome DevTools Protocol over its WebSocket, driving Debian's headless
Chromium (`chromium-headless-shell`, or `chromium --headless`) for the member page's browser test."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from websockets.sync.client import ClientConnection, connect

BROWSER = shutil.which("chromium-headless-shell") or shutil.which("chromium")
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--remote-debugging-port=0", "--remote-debugging-address=127.0.0.1", "--window-size=1280,1600",
]  # fmt: skip
_LISTENING = re.compile(r"DevTools listening on (ws://\S+)")


class Browser:
    """A headless Chromium with a fresh profile and one page, driven over CDP."""

    def __init__(self, log: Path) -> None:
        assert BROWSER is not None
        self.profile = tempfile.TemporaryDirectory(prefix="kafila-chromium-")
        self.log = log
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [BROWSER, *FLAGS, f"--user-data-dir={self.profile.name}", "about:blank"],
                stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        browser_ws = self._wait_listening(30.0)
        with connect(browser_ws, max_size=None) as ws:
            self._next = 0
            targets = self._call(ws, "Target.getTargets")["targetInfos"]
        [page] = [t for t in targets if t["type"] == "page"]
        host = browser_ws.split("/devtools/")[0]
        self.ws: ClientConnection = connect(f"{host}/devtools/page/{page['targetId']}", max_size=None)

    def _wait_listening(self, within: float) -> str:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            found = _LISTENING.search(self.log.read_text(errors="replace"))
            if found:
                return found.group(1)
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"{BROWSER} did not start: {self.log.read_text(errors='replace')[-2000:]}")

    def _call(self, ws: ClientConnection, method: str, **params: Any) -> dict[str, Any]:
        self._next += 1
        ws.send(json.dumps({"id": self._next, "method": method, "params": params}))
        while True:
            msg = json.loads(ws.recv(timeout=60))
            if msg.get("id") == self._next:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return dict(msg.get("result", {}))

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        return self._call(self.ws, method, **params)

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited if a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def navigate(self, url: str) -> None:
        self.call("Page.enable")
        self.call("Page.navigate", url=url)
        self.wait_for("document.readyState === 'complete'", 30.0)

    def wait_for(self, expression: str, within: float) -> Any:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            value = self.evaluate(expression)
            if value:
                return value
            time.sleep(0.2)
        raise AssertionError(f"the page did not make `{expression}` true within {within:.0f} s")

    def screenshot(self, path: Path) -> Path:
        data = self.call("Page.captureScreenshot", format="png", captureBeyondViewport=True)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.profile.cleanup()
