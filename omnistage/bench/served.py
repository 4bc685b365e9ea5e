"""``omnistage serve`` as the benchmarks meet it: a server process of its own on a free port,
ready once ``/health`` answers 200, stopped (SIGINT, then SIGKILL) on leaving the block."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from typing import Self

import httpx


class Served:
    """``omnistage serve ARGS --port <free>``; ``url`` is where it answers."""

    def __init__(self, *args: str) -> None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "omnistage.cli", "serve", "--port", str(port), *args]
        self.process = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
        )

    def __enter__(self) -> Self:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}")
            time.sleep(0.05)
        raise RuntimeError("server not ready after 300 s")

    def __exit__(self, *exc: object) -> None:
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
