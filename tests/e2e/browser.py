"""A real headless Chromium for the UI tests, driven through the DevTools protocol (CDP) over a
pipe: ``--remote-debugging-pipe`` makes Chromium read commands from file descriptor 3 and
write answers and events to descriptor 4, as NUL-terminated JSON.

Why a pipe and not chromedriver or a websocket: it needs nothing beyond the distribution's
``chromium`` package — no ``chromium-driver`` (another 8 MB package and a second process with
a port), no websocket library in the dev extra — and there is no port to pick, race for or
leak: the protocol lives and dies with the process. Clicks and typing go through CDP's
``Input`` domain (real mouse and keyboard events, hit-tested as a user's), screenshots through
``Page.captureScreenshot``.

``ensure_chromium()`` installs Debian's ``chromium`` (``apt-get install
--no-install-recommends``, about 115 MB, ~35 s once) when it is missing, and skips when it
cannot (not root, no apt-get); ``$OMNISTAGE_CHROMIUM`` names another binary.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pytest

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-extensions",
    "--mute-audio",
    "--autoplay-policy=no-user-gesture-required",
    # A microphone that plays a tone, granted without asking: the playground's recorder.
    "--use-fake-device-for-media-stream",
    "--use-fake-ui-for-media-stream",
    "--remote-debugging-pipe",
]
APT_GET = [
    "apt-get",
    "-q",
    "-y",
    "-o",
    "DPkg::Lock::Timeout=300",  # another apt run (a second test process) holds the lock
    "--no-install-recommends",
]


def chromium_executable() -> str | None:
    given = os.environ.get("OMNISTAGE_CHROMIUM")
    if given:
        return shutil.which(given)
    return shutil.which("chromium") or shutil.which("chromium-browser")


def ensure_chromium() -> str:
    """The Chromium binary, installed from the distribution's packages if missing."""
    found = chromium_executable()
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip(
            "chromium is not installed and cannot be installed here (needs root and apt-get)"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    started = time.monotonic()
    install = [*APT_GET, "install", "chromium"]
    out = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    if out.returncode != 0:  # no package lists yet (a fresh image): fetch them once
        subprocess.run([*APT_GET, "update"], capture_output=True, text=True, env=env, timeout=300)
        out = subprocess.run(install, capture_output=True, text=True, env=env, timeout=900)
    found = chromium_executable()
    if out.returncode != 0 or found is None:
        raise RuntimeError(f"apt-get install chromium failed:\n{out.stdout[-2000:]}{out.stderr}")
    print(f"installed chromium in {time.monotonic() - started:.0f} s")
    return found


class CdpError(RuntimeError):
    pass


def _high(fd: int) -> int:
    """``fd`` moved above 9 (close-on-exec): the spawn's dup2 onto 3 and 4 cannot hit it."""
    moved = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return moved


class Browser:
    """One headless Chromium process; ``page()`` opens a tab (its own sessionStorage)."""

    def __init__(self, executable: str, profile: Path, size: tuple[int, int] = (1440, 1100)):
        to_chrome, self._send_fd = os.pipe()
        self._recv_fd, from_chrome = os.pipe()
        log = os.open(profile / "chromium.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        to_chrome, from_chrome, log = _high(to_chrome), _high(from_chrome), _high(log)
        argv = [
            executable,
            *FLAGS,
            f"--user-data-dir={profile / 'data'}",
            f"--window-size={size[0]},{size[1]}",
            "about:blank",
        ]
        actions = [
            (os.POSIX_SPAWN_DUP2, to_chrome, 3),
            (os.POSIX_SPAWN_DUP2, from_chrome, 4),
            (os.POSIX_SPAWN_DUP2, log, 1),
            (os.POSIX_SPAWN_DUP2, log, 2),
        ]
        # Its own process group, so that close() can end the renderers with it.
        self.pid = os.posix_spawn(executable, argv, os.environ, file_actions=actions, setsid=True)
        for fd in (to_chrome, from_chrome, log):
            os.close(fd)
        self.log = profile / "chromium.log"
        self._next_id = 0
        self._answers: dict[int, dict[str, Any]] = {}
        self.events: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        self._closed = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.version = self.call("Browser.getVersion")["product"]

    def _read(self) -> None:
        buffer = b""
        try:
            while chunk := os.read(self._recv_fd, 1 << 20):
                buffer += chunk
                *messages, buffer = buffer.split(b"\0")
                with self._cond:
                    for raw in messages:
                        message = json.loads(raw)
                        if "id" in message:
                            self._answers[message["id"]] = message
                        else:
                            self.events.append(message)
                    self._cond.notify_all()
        finally:  # the end of the pipe, or a message that is not JSON: calls fail at once
            with self._cond:
                self._closed = True
                self._cond.notify_all()

    def call(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        with self._cond:
            self._next_id += 1
            call_id = self._next_id
        message: dict[str, Any] = {"id": call_id, "method": method, "params": params or {}}
        if session is not None:
            message["sessionId"] = session
        os.write(self._send_fd, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + 60
        with self._cond:
            while call_id not in self._answers:
                if self._closed:
                    raise CdpError(f"{method}: the protocol pipe closed (see {self.log})")
                if not self._cond.wait(timeout=max(0.0, deadline - time.monotonic())):
                    raise CdpError(f"{method}: no answer in 60 s")
            answer = self._answers.pop(call_id)
        if "error" in answer:
            raise CdpError(f"{method}: {answer['error']}")
        result: dict[str, Any] = answer.get("result", {})
        return result

    def page(self) -> Page:
        target = self.call("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True})
        return Page(self, target, session["sessionId"])

    def close(self) -> None:
        with contextlib.suppress(CdpError, OSError):  # gone already
            self.call("Browser.close")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if os.waitpid(self.pid, os.WNOHANG) != (0, 0):
                break
            time.sleep(0.05)
        else:
            os.killpg(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        os.close(self._send_fd)
        self._reader.join(timeout=5)
        os.close(self._recv_fd)


_OVERFLOWS = """(() => {
  const found = [];
  const doc = document.documentElement;
  if (doc.scrollWidth > window.innerWidth) found.push(`the page: ${doc.scrollWidth} px wide in ${window.innerWidth}`);
  for (const box of document.querySelectorAll(".stage, .panel, .pipeline")) {
    const name = `${box.tagName.toLowerCase()}.${box.className}${box.dataset.stageId ? `[${box.dataset.stageId}]` : ""}`;
    if (box.scrollWidth > box.clientWidth + 1) found.push(`${name} scrolls: ${box.scrollWidth} px in ${box.clientWidth}`);
    const edge = box.getBoundingClientRect();
    for (const el of box.querySelectorAll("*")) {
      const r = el.getBoundingClientRect();
      if (r.width && (r.right > edge.right + 1 || r.left < edge.left - 1)) {
        found.push(`${el.tagName.toLowerCase()}.${el.className} reaches out of ${name}`);
        break;
      }
    }
  }
  return found;
})()"""


class Page:
    """A tab: navigate, evaluate, wait for a condition, click and type as a user, screenshot."""

    def __init__(self, browser: Browser, target: str, session: str) -> None:
        self.browser = browser
        self.target = target
        self.session = session
        self.call("Page.enable")
        self.call("Runtime.enable")

    def call(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.browser.call(method, params, self.session)

    def goto(self, url: str) -> None:
        self.call("Page.navigate", {"url": url})
        self.wait_for("document.readyState === 'complete' && location.href !== 'about:blank'")

    def eval(self, expression: str) -> Any:
        """The value of a JavaScript expression (promises awaited)."""
        answer = self.call(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": True},
        )
        if "exceptionDetails" in answer:
            details = answer["exceptionDetails"]
            text = details.get("exception", {}).get("description") or details.get("text")
            raise CdpError(f"{expression[:80]!r} threw: {text}")
        return answer["result"].get("value")

    def wait_for(self, expression: str, timeout: float = 15.0) -> Any:
        """Poll ``expression`` until it is truthy; its value. AssertionError after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            value = self.eval(expression)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not true after {timeout} s: {expression}")
            time.sleep(0.05)

    def click(self, selector: str) -> None:
        """A mouse click at the element's centre, as a user's: it must be visible there."""
        point = self.eval(
            f"""(() => {{
              const el = document.querySelector({json.dumps(selector)});
              if (!el) return null;
              el.scrollIntoView({{block: "center"}});
              const r = el.getBoundingClientRect();
              const x = r.left + r.width / 2, y = r.top + r.height / 2;
              const hit = document.elementFromPoint(x, y);
              return {{x, y, hit: Boolean(hit && (hit === el || el.contains(hit)))}};
            }})()"""
        )
        if point is None or not point["hit"]:
            raise AssertionError(f"{selector} is not there to click ({point})")
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            self.call(
                "Input.dispatchMouseEvent",
                {"type": kind, "x": point["x"], "y": point["y"], "button": "left", "clickCount": 1},
            )

    def type(self, selector: str, text: str) -> None:
        """Replace a field's text as a user would: click into it, select all, type."""
        self.click(selector)
        self.eval(f"document.querySelector({json.dumps(selector)}).select()")
        self.call("Input.insertText", {"text": text})

    def choose_files(self, selector: str, paths: list[Path]) -> None:
        """Pick files in a file input, as the file dialog would."""
        root = self.call("DOM.getDocument")["root"]["nodeId"]
        node = self.call("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
        self.call("DOM.setFileInputFiles", {"nodeId": node, "files": [str(p) for p in paths]})

    def resize(self, width: int, height: int) -> None:
        """Lay the page out as in a window of ``width`` x ``height`` CSS pixels."""
        metrics = {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False}
        self.call("Emulation.setDeviceMetricsOverride", metrics)

    def overflows(self) -> list[str]:
        """What does not fit: the page wider than the window, a card or panel (``.stage``,
        ``.panel``, ``.pipeline``) that scrolls sideways, or an element that reaches out of
        its card. Empty when everything fits."""
        return list(self.eval(_OVERFLOWS))

    def screenshot(self, path: Path) -> Path:
        """The whole page (beyond the window too), as PNG."""
        size = self.call("Page.getLayoutMetrics")["cssContentSize"]
        clip = {"x": 0, "y": 0, "width": size["width"], "height": size["height"], "scale": 1}
        params = {"format": "png", "captureBeyondViewport": True, "clip": clip}
        data = self.call("Page.captureScreenshot", params)["data"]
        path.write_bytes(base64.b64decode(data))
        return path

    def errors(self) -> list[str]:
        """Uncaught exceptions and console.error lines of this tab so far."""
        found = []
        for event in list(self.browser.events):
            if event.get("sessionId") != self.session:
                continue
            if event["method"] == "Runtime.exceptionThrown":
                details = event["params"]["exceptionDetails"]
                found.append(details.get("exception", {}).get("description") or details["text"])
            elif (
                event["method"] == "Runtime.consoleAPICalled" and event["params"]["type"] == "error"
            ):
                found.append(" ".join(str(a.get("value", a)) for a in event["params"]["args"]))
        return found

    def close(self) -> None:
        self.browser.call("Target.closeTarget", {"targetId": self.target})
