"""Headless Chromium driven over the DevTools protocol, for the tests that check a page in a real browser.

The protocol's websocket is spoken with tornado's client (tornado comes with Jupyter, which the test set-up
installs), so no browser-automation package is needed. `find_chromium` returns None where no Chromium is installed
(Debian's package is ``chromium``; CI installs it): the tests that need it skip, saying so.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import queue
import re
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

NAMES = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
# Headless, and nothing that reaches for the network: on a closed network Chromium's background connections are
# refused and slow its start.
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--remote-debugging-port=0", "--remote-allow-origins=*")
START_TIMEOUT_S = 60
CALL_TIMEOUT_S = 60


def find_chromium() -> str | None:
    """The Chromium (or Chrome) binary: $KVSCOPE_CHROMIUM, else the first of `NAMES` on the PATH."""
    return os.environ.get("KVSCOPE_CHROMIUM") or next(filter(None, map(shutil.which, NAMES)), None)


class Chromium:
    """One headless browser with one page; use as a context manager."""

    def __init__(self, binary: str, width: int = 1280, height: int = 900):
        self.profile = tempfile.mkdtemp(prefix="kvscope-chromium-")
        self.process = subprocess.Popen([binary, *FLAGS, f"--user-data-dir={self.profile}",
                                         f"--window-size={width},{height}", "about:blank"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        port = self._port()
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:  # the page target appears shortly after the endpoint
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as response:
                pages = [t for t in json.load(response) if t.get("type") == "page"]
            if pages or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        if not pages:
            raise RuntimeError("Chromium opened no page")
        from tornado.websocket import websocket_connect

        async def connect():
            return await websocket_connect(pages[0]["webSocketDebuggerUrl"], max_message_size=1 << 28)

        self.loop = asyncio.new_event_loop()
        self.socket = self.loop.run_until_complete(connect())
        self.events: list[dict[str, Any]] = []
        self.calls = 0

    def _port(self) -> int:
        """The DevTools port, from the line Chromium prints on start."""
        lines: queue.Queue[str] = queue.Queue()
        stderr = self.process.stderr
        assert stderr is not None

        def read() -> None:
            for line in stderr:
                lines.put(line)

        threading.Thread(target=read, daemon=True).start()
        deadline, seen = time.monotonic() + START_TIMEOUT_S, []
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=0.5)
            except queue.Empty:
                if self.process.poll() is not None:
                    break
                continue
            seen.append(line)
            if found := re.search(r"DevTools listening on ws://[^:]+:(\d+)/", line):
                return int(found.group(1))
        self.close()
        raise RuntimeError("Chromium did not start: " + "".join(seen[-5:]))

    def _receive(self) -> dict[str, Any]:
        async def read():
            return await asyncio.wait_for(self.socket.read_message(), CALL_TIMEOUT_S)

        message = self.loop.run_until_complete(read())
        if message is None:
            raise RuntimeError("Chromium closed the DevTools connection")
        return json.loads(message)

    def call(self, method: str, **params: Any) -> dict[str, Any]:
        """Send one DevTools command and return its result (events that arrive meanwhile are kept)."""
        self.calls += 1
        number = self.calls
        async def write():
            await self.socket.write_message(json.dumps({"id": number, "method": method, "params": params}))

        self.loop.run_until_complete(write())
        while True:
            message = self._receive()
            if message.get("id") == number:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self.events.append(message)

    def wait_for(self, event: str) -> dict[str, Any]:
        while True:
            found = next((e for e in self.events if e.get("method") == event), None)
            if found is not None:
                self.events.remove(found)
                return found
            self.events.append(self._receive())

    def open(self, url: str) -> None:
        """Load `url` and wait for its load event."""
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.events.clear()
        self.call("Page.navigate", url=url)
        self.wait_for("Page.loadEventFired")

    def errors(self) -> list[str]:
        """The uncaught script errors of the page so far (the page's own handlers included)."""
        self.evaluate("0")  # lets the events that came before it arrive
        return [e["params"]["exceptionDetails"].get("exception", {}).get("description", "error")
                for e in self.events if e.get("method") == "Runtime.exceptionThrown"]

    def select(self, element: str, value: str) -> str:
        """Choose `value` in the <select> with id `element` as a user would (a change event follows); the value it
        then holds."""
        return self.evaluate(f"(() => {{ const s = document.getElementById({json.dumps(element)}); "
                             f"s.value = {json.dumps(value)}; s.dispatchEvent(new Event('change')); "
                             "return s.value; })()")

    def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (awaited when it is a promise)."""
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            details = result["exceptionDetails"]
            raise RuntimeError(details.get("exception", {}).get("description") or details.get("text"))
        return result["result"].get("value")

    def screenshot(self, path: str | os.PathLike, full_page: bool = False) -> Path:
        params: dict[str, Any] = {"format": "png"}
        if full_page:
            params["captureBeyondViewport"] = True
        data = self.call("Page.captureScreenshot", **params)["data"]
        path = Path(path)
        path.write_bytes(base64.b64decode(data))
        return path

    def close(self) -> None:
        if getattr(self, "socket", None) is not None:
            self.socket.close()
            self.loop.close()
            self.socket = None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        shutil.rmtree(self.profile, ignore_errors=True)

    def __enter__(self) -> Chromium:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":  # a screenshot of a page: python tests/chromium.py PAGE.html OUT.png [SELECT_ID=VALUE ...]
    import sys

    page, out, *choices = sys.argv[1:]
    with Chromium(find_chromium() or "chromium") as browser:
        browser.open(Path(page).resolve().as_uri())
        for choice in choices:
            browser.select(*choice.split("=", 1))
        browser.screenshot(out)
