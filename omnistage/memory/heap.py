"""The process heap: memory that large, short-lived work freed (decoded media, their
features) given back to the OS. glibc keeps freed arenas for reuse otherwise, so a process's
RSS stays at its peak after one large request."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from collections.abc import Callable


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None  # type: ignore[no-any-return]
    except (OSError, AttributeError):  # not glibc
        return None


def give_back_memory() -> None:
    """Return the heap's free memory to the OS (glibc's ``malloc_trim``; elsewhere nothing)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)
