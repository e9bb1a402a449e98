#!/usr/bin/env python
"""Open an HTML file in headless Chromium and check what a reader would see.

    python scripts/check_report_in_browser.py report.html [--screenshot shot.png]

Checks: the page loads; no console error, no uncaught exception, no error in the browser log
(a missing resource shows there); no network request other than the file itself (file:, data:,
about:); every ``.drawing`` holds an SVG with a visible size. Prints a JSON summary; exits 1 when a
check fails, 2 when no browser is found.

The browser is driven through the DevTools protocol over a pipe (``--remote-debugging-pipe``:
fd 3 in, fd 4 out, NUL-terminated JSON), so only the standard library is needed. Debian's
package is ``chromium`` (``apt-get install -y chromium``).
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import fcntl
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable", "chrome")
LOCAL_SCHEMES = ("file:", "data:", "about:", "chrome:", "devtools:")

PAGE_FACTS_JS = r"""
(() => {
  const drawings = [...document.querySelectorAll('.drawing')].map(d => {
    const svg = d.querySelector('svg');
    const r = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
    return {name: d.getAttribute('data-drawing'), svg: !!svg, width: r.width, height: r.height,
            text: svg ? svg.textContent.replace(/\s+/g, ' ').slice(0, 200) : ''};
  });
  const external = [...document.querySelectorAll('[src],[href]')]
    .map(e => e.getAttribute('src') || e.getAttribute('href'))
    .filter(u => /^(https?:)?\/\//i.test(u));
  return {title: document.title, drawings, svgs: document.querySelectorAll('svg').length,
          scripts: document.scripts.length, external,
          height: document.documentElement.scrollHeight,
          headings: [...document.querySelectorAll('h2')].map(h => h.textContent)};
})()
"""


def find_browser() -> str | None:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    return None


class Browser:
    """Headless Chromium with a DevTools session on one page."""

    def __init__(self, exe: str, timeout: float = 60.0):
        self.timeout = timeout
        self._profile = tempfile.TemporaryDirectory(prefix="ccfx-chromium-")
        to_child_r, self._to_child = os.pipe()
        self._from_child, from_child_w = os.pipe()

        def wire_fds():  # runs in the child: the protocol wants fd 3 (in) and fd 4 (out)
            a = fcntl.fcntl(to_child_r, fcntl.F_DUPFD, 10)
            b = fcntl.fcntl(from_child_w, fcntl.F_DUPFD, 10)
            os.dup2(a, 3)
            os.dup2(b, 4)
            os.set_inheritable(3, True)
            os.set_inheritable(4, True)

        self.proc = subprocess.Popen(
            [exe, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--no-first-run", "--no-default-browser-check", "--disable-extensions",
             "--disable-dev-shm-usage",
             "--disable-component-update", "--disable-sync", "--mute-audio", "--hide-scrollbars",
             f"--user-data-dir={self._profile.name}", "--remote-debugging-pipe", "about:blank"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
            preexec_fn=wire_fds, close_fds=False)  # noqa: PLW1509  (no threads here)
        os.close(to_child_r)
        os.close(from_child_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []
        self.session: str | None = None

    # -- protocol ----------------------------------------------------------------------------

    def _read_message(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from the browser")
            ready, _, _ = select.select([self._from_child], [], [], left)
            if ready:
                chunk = os.read(self._from_child, 1 << 20)
                if not chunk:
                    raise RuntimeError("the browser closed the DevTools pipe: "
                                       + self._stderr_tail())
                self._buffer += chunk
        raw, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(raw)

    def call(self, method: str, params: dict | None = None, *, session: bool = True) -> dict:
        self._next_id += 1
        msg = {"id": self._next_id, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_child, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + self.timeout
        while True:
            reply = self._read_message(deadline)
            if reply.get("id") == self._next_id:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})
            self.events.append(reply)

    def wait_for(self, method: str, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        if any(e.get("method") == method for e in self.events):
            return True
        while time.monotonic() < deadline:
            try:
                event = self._read_message(deadline)
            except TimeoutError:
                return False
            self.events.append(event)
            if event.get("method") == method:
                return True
        return False

    def drain(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while True:
            try:
                self.events.append(self._read_message(deadline))
            except TimeoutError:
                return

    def _stderr_tail(self) -> str:
        try:
            self.proc.wait(timeout=2)
            return (self.proc.stderr.read() or b"").decode(errors="replace")[-2000:]
        except subprocess.TimeoutExpired:
            return ""

    # -- page --------------------------------------------------------------------------------

    def open(self, url: str, width: int = 1280, height: int = 1600) -> None:
        target = self.call("Target.createTarget", {"url": "about:blank"}, session=False)
        attached = self.call("Target.attachToTarget",
                             {"targetId": target["targetId"], "flatten": True}, session=False)
        self.session = attached["sessionId"]
        for domain in ("Runtime", "Log", "Network", "Page"):
            self.call(f"{domain}.enable")
        self.call("Emulation.setDeviceMetricsOverride",
                  {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False})
        self.call("Page.navigate", {"url": url})
        if not self.wait_for("Page.loadEventFired", self.timeout):
            raise TimeoutError(f"{url} did not finish loading in {self.timeout} s")
        self.drain(0.5)

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", {"expression": expression,
                                                "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        shot = self.call("Page.captureScreenshot", {"format": "png"})
        path.write_bytes(base64.b64decode(shot["data"]))

    def close(self) -> None:
        with contextlib.suppress(Exception):  # closing anyway
            self.call("Browser.close", session=False)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for fd in (self._to_child, self._from_child):
            with contextlib.suppress(OSError):
                os.close(fd)
        if self.proc.stderr:
            self.proc.stderr.close()
        self._profile.cleanup()


def problems_in(events: list[dict]) -> tuple[list[str], list[str], list[str]]:
    """(errors, warnings, external requests) from the protocol events."""
    errors, warnings, external = [], [], []
    for e in events:
        method, p = e.get("method"), e.get("params", {})
        if method == "Runtime.consoleAPICalled":
            text = " ".join(str(a.get("value", a.get("description", ""))) for a in p.get("args", []))
            if p.get("type") in ("error", "assert"):
                errors.append(f"console.{p.get('type')}: {text}")
            elif p.get("type") == "warning":
                warnings.append(f"console.warn: {text}")
        elif method == "Runtime.exceptionThrown":
            d = p.get("exceptionDetails", {})
            errors.append("exception: " + str(d.get("exception", {}).get("description")
                                             or d.get("text")))
        elif method == "Log.entryAdded":
            entry = p.get("entry", {})
            line = f"{entry.get('source')}: {entry.get('text')} {entry.get('url', '')}".strip()
            (errors if entry.get("level") == "error" else warnings).append(line)
        elif method == "Network.requestWillBeSent":
            url = p.get("request", {}).get("url", "")
            if not url.startswith(LOCAL_SCHEMES):
                external.append(url)
    return errors, warnings, external


def check_html(path: str | os.PathLike, screenshot: str | os.PathLike | None = None,
               browser: str | None = None, timeout: float = 60.0) -> dict:
    """Load ``path`` in headless Chromium; a summary dict with ``ok`` and what was found."""
    exe = browser or find_browser()
    if exe is None:
        raise FileNotFoundError("no Chromium found: apt-get install -y chromium")
    url = Path(path).resolve().as_uri()
    b = Browser(exe, timeout)
    try:
        b.open(url)
        facts = b.evaluate(PAGE_FACTS_JS)
        if screenshot:
            b.screenshot(Path(screenshot))
        b.drain(0.2)
    finally:
        b.close()
    errors, warnings, external = problems_in(b.events)
    external += facts.get("external", [])
    drawings_ok = bool(facts["drawings"]) and all(
        d["svg"] and d["width"] > 50 and d["height"] > 50 for d in facts["drawings"])
    return {"ok": not errors and not external and drawings_ok, "url": url, "errors": errors,
            "warnings": warnings, "external_requests": external, "drawings_ok": drawings_ok,
            **facts}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("html", type=Path)
    p.add_argument("--screenshot", type=Path, default=None, help="save a PNG of the first screen")
    p.add_argument("--browser", default=None, help="browser executable (default: find chromium)")
    args = p.parse_args(argv)
    try:
        result = check_html(args.html, args.screenshot, args.browser)
    except FileNotFoundError as e:
        print(e, file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
