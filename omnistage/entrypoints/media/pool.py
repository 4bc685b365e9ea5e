"""Where media are decoded: a bounded pool of worker threads, and the memory a decode took given
back to the OS afterwards.

Decoding is CPU work and holds the GIL in parts (numpy, Pillow, PyAV's Python side): eight
large decodes at once on eight threads held other chats for seconds and, each with its peak,
took the API process to gigabytes. ``--media-decode-workers`` threads decode at a time, the
others wait their turn off the event loop; what a large decode freed is returned to the OS
(glibc keeps freed arenas otherwise, so the process's RSS stays at its peak).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from omnistage.memory.heap import give_back_memory

__all__ = ["give_back_memory", "run_decode"]

_T = TypeVar("_T")
_POOLS: dict[int, ThreadPoolExecutor] = {}
_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    with _LOCK:
        if workers not in _POOLS:
            _POOLS[workers] = ThreadPoolExecutor(workers, thread_name_prefix="omnistage-media")
        return _POOLS[workers]


async def run_decode(workers: int, fn: Callable[..., _T], *args: Any) -> _T:
    """``fn(*args)`` on the media pool of ``workers`` threads, its memory given back after."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(_pool(workers), functools.partial(_trimmed, fn, *args))


def _trimmed(fn: Callable[..., _T], *args: Any) -> _T:
    try:
        return fn(*args)
    finally:
        give_back_memory()
