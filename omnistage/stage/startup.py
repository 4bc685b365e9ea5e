"""How a stage process starts: the options its launcher passes it (imports no torch, so a
server can spawn its stages before it imports the heavy parts of itself)."""

from __future__ import annotations

import contextlib
import multiprocessing.process
import sys
import threading
from typing import Any

import msgspec


class StartupOptions(msgspec.Struct):
    """How a stage process starts. A restarted stage comes back as the old one was: asleep
    at ``sleep_level`` (``None``: awake; level 2: its weights are never loaded), paused, and
    with the weight updates it had taken (``weight_sources``, replayed over the checkpoint).
    ``handoff``: how it hands its output to the next stage (``shm`` on one host, ``socket``
    across hosts; ``omnistage.stage.handoff``)."""

    sleep_level: int | None = None
    paused: bool = False
    weight_sources: list[str] = []
    heartbeat_interval_s: float = 1.0
    handoff: str = "shm"


_startup = msgspec.json.Decoder(StartupOptions)


def encode_startup(options: StartupOptions) -> str:
    return msgspec.json.encode(options).decode()


def decode_startup(data: str) -> StartupOptions:
    return _startup.decode(data)


_SPAWN_LOCK = threading.Lock()


def stop_process(process: Any, wait_s: float) -> None:
    """Let ``process`` end by itself for ``wait_s`` seconds, then terminate it, then kill it
    (a ``multiprocessing`` process, or anything with the same methods)."""
    process.join(wait_s)
    for stop in (process.terminate, process.kill):
        if process.is_alive():
            with contextlib.suppress(OSError):
                stop()
            process.join(2.0)


def start_without_main(process: multiprocessing.process.BaseProcess) -> None:
    """Start a ``spawn`` process without running the parent's ``__main__`` again in it.

    ``spawn`` re-imports the parent's main module in the child, so that objects defined there
    unpickle. A stage needs none (it gets JSON and bytes): re-importing would cost it the
    imports of the CLI or of a user's script, and run the whole script again in every stage
    if it lacks the ``if __name__ == "__main__"`` guard. The main module's ``__spec__`` and
    ``__file__`` are hidden while the child's start-up data is taken.
    """
    main = sys.modules.get("__main__")
    # A stage process is a daemon, and multiprocessing refuses children to daemons; a
    # stage's own children (its other tensor-parallel ranks) die with it (PDEATHSIG).
    current = multiprocessing.process.current_process()
    was_daemon = current._config.get("daemon")  # type: ignore[attr-defined]
    with _SPAWN_LOCK:
        current._config["daemon"] = False  # type: ignore[attr-defined]
        saved = dict(vars(main)) if main is not None else {}
        if main is not None:
            main.__spec__ = None
            vars(main).pop("__file__", None)
        try:
            process.start()
        finally:
            if was_daemon is not None:
                current._config["daemon"] = was_daemon  # type: ignore[attr-defined]
            if main is not None:
                main.__spec__ = saved.get("__spec__")
                if "__file__" in saved:
                    main.__file__ = saved["__file__"]
