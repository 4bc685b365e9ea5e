"""Stop a request's work when its HTTP client hangs up (vLLM's ``with_cancellation``).

Starlette cancels a streaming response when the client goes away, but not a handler that is
still computing its reply: without this, a non-streaming request whose client left would run
in the stages to the end (or wait for a paused stage) for nobody.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import Request

T = TypeVar("T")


async def _wait_for_disconnect(request: Request) -> None:
    # The handler has read the body already; what comes next is the disconnect.
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T | None:
    """Await ``work``; ``None`` if the client disconnected first, after cancelling ``work``
    (which aborts its requests in the stages)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task.done() and not task.cancelled():
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task  # let the cancellation reach the stages before answering
    return None
