"""A real headless Chromium driven over the DevTools protocol (a WebSocket, no extra package): open a page,
run JavaScript in it, wait for a condition, click, take screenshots."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-port=0", "--window-size=1400,1000"]


class Browser:
    """One headless Chromium with one page; ``with Browser() as b: b.open(url); b.eval("document.title")``."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        assert CHROMIUM is not None, "chromium is not installed"
        self._profile = tempfile.TemporaryDirectory()
        self.proc = subprocess.Popen([CHROMIUM, *FLAGS, f"--user-data-dir={self._profile.name}", "about:blank"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = self._devtools_url(timeout_s)
        self.ws = connect(url, max_size=None, open_timeout=timeout_s)
        self._id = 0
        self.session: str | None = None
        self.timeout_s = timeout_s

    def _devtools_url(self, timeout_s: float) -> str:
        # with --remote-debugging-port=0 Chromium writes the port it chose, and the browser's path, here
        active = Path(self._profile.name) / "DevToolsActivePort"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            lines = active.read_text().split() if active.exists() else []
            if len(lines) == 2:
                return f"ws://127.0.0.1:{lines[0]}{lines[1]}"
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"chromium did not start (exit code {self.proc.poll()})")

    def send(self, method: str, params: dict[str, Any] | None = None, *, session: bool = True) -> dict[str, Any]:
        """Send one command and return its result (events that arrive meanwhile are dropped)."""
        self._id += 1
        message: dict[str, Any] = {"id": self._id, "method": method, "params": params or {}}
        if session and self.session:
            message["sessionId"] = self.session
        self.ws.send(json.dumps(message))
        while True:
            reply = json.loads(self.ws.recv(timeout=self.timeout_s))
            if reply.get("id") == self._id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return dict(reply.get("result", {}))

    def open(self, url: str) -> None:
        target = self.send("Target.createTarget", {"url": url}, session=False)["targetId"]
        self.session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True}, session=False)["sessionId"]
        self.send("Emulation.setDeviceMetricsOverride", {"width": 1400, "height": 1000, "deviceScaleFactor": 1,
                                                         "mobile": False})

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (promises awaited)."""
        result = self.send("Runtime.evaluate", {"expression": expression, "awaitPromise": True, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def wait_for(self, expression: str, what: str, timeout_s: float = 30.0) -> Any:
        """Poll ``expression`` until it is truthy; return its value."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.eval(expression)
            if value:
                return value
            time.sleep(0.1)
        raise AssertionError(f"timed out waiting for {what}; page status: {self.eval('document.body.innerText')[:600]}")

    def screenshot(self, path: Path) -> Path:
        """A PNG of the whole page."""
        height = self.eval("Math.max(document.body.scrollHeight, 1000)")
        shot = self.send("Page.captureScreenshot", {"format": "png", "captureBeyondViewport": True,
                                                    "clip": {"x": 0, "y": 0, "width": 1400, "height": height, "scale": 1}})
        path.write_bytes(base64.b64decode(shot["data"]))
        return path

    def close(self) -> None:
        try:
            self.send("Browser.close", session=False)
        except (OSError, RuntimeError, TimeoutError, ConnectionClosed):  # the browser may already be gone; wait/kill below either way
            pass
        self.ws.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._profile.cleanup()

    def __enter__(self) -> Browser:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
