"""Bound request bodies before any route reads them (HTTP 413).

ASGI middleware: a declared ``Content-Length`` above the limit is refused at once; a body
sent without one (chunked) is read up to the limit and refused as soon as it goes past it.
Accepted bodies are replayed to the app unchanged, so routes and the disconnect watcher
(``disconnect.py``) see the same messages they would without it.

A refused body is read and dropped before the 413 goes out (bounded in bytes and time):
closing a connection whose client is still sending makes the kernel reset it, and the
client would see a broken connection instead of the 413.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from omnistage.entrypoints.serve.errors import error_response


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, declared)
            return
        buffered: list[Message] = []
        size = 0
        more = scope.get("method", "GET") not in ("GET", "HEAD", "OPTIONS")
        while more:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, size)
                return
            more = bool(message.get("more_body", False))

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        await _discard_body(receive)
        response = error_response(
            413,
            f"body: request body of {size} bytes or more exceeds the limit of {self.max_bytes} "
            "bytes (--max-request-body-bytes)",
            type="invalid_request_error",
            code="request_too_large",
            param="body",
            headers={"Connection": "close"},
        )
        await response(scope, receive, send)


_DISCARD_BYTES = 1 << 30
_DISCARD_S = 5.0


async def _discard_body(receive: Receive) -> None:
    """Read what the client is still sending, up to ``_DISCARD_BYTES`` / ``_DISCARD_S``."""
    deadline = time.monotonic() + _DISCARD_S
    dropped = 0
    while dropped < _DISCARD_BYTES and time.monotonic() < deadline:
        try:
            message = await asyncio.wait_for(receive(), deadline - time.monotonic())
        except TimeoutError:
            return
        if message["type"] != "http.request":
            return
        dropped += len(message.get("body", b""))
        if not message.get("more_body", False):
            return


def _content_length(scope: Scope) -> int | None:
    headers: Any = scope.get("headers") or []
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
