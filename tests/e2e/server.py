"""Start a real ``omnistage serve`` process for end-to-end tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    url: str
    process: subprocess.Popen[str]
    log: list[str] = field(default_factory=list)
    api_key: str | None = None
    control_key: str | None = None

    def control_headers(self) -> dict[str, str]:
        key = self.control_key or self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def data_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stage_pids(self) -> list[int]:
        import psutil

        return [c.pid for c in psutil.Process(self.process.pid).children(recursive=True)]


@contextmanager
def running_server(
    *args: str,
    timeout_s: float = 240.0,
    env: dict[str, str] | None = None,
    python: str = sys.executable,
    entry: tuple[str, ...] = ("omnistage.cli", "serve"),
) -> Iterator[Server]:
    """``python -m <entry> --port P <args>``: by default ``omnistage serve``."""
    port = free_port()
    cmd = [python, "-m", *entry, "--port", str(port), *args]
    process = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )
    server = Server(url=f"http://127.0.0.1:{port}", process=process)
    if "--api-key" in args:
        server.api_key = args[args.index("--api-key") + 1]
    if "--control-api-key" in args:
        server.control_key = args[args.index("--control-api-key") + 1]
    import threading

    threading.Thread(
        target=lambda: server.log.extend(iter(process.stdout.readline, "")), daemon=True
    ).start()  # type: ignore[union-attr]
    try:
        deadline = time.monotonic() + timeout_s
        while not any("is ready at" in line for line in server.log):
            if process.poll() is not None:
                raise RuntimeError(
                    f"server exited with {process.returncode}:\n{''.join(server.log)}"
                )
            if time.monotonic() > deadline:
                raise RuntimeError(f"server not ready after {timeout_s}s:\n{''.join(server.log)}")
            time.sleep(0.1)
        httpx.get(server.url + "/health", timeout=10).raise_for_status()
        yield server
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
