"""What the chat and completion routes do with a request's stream of outputs: start it (so
that admission errors become a status code), collect it into choices, merge a batch's streams,
name a refused field as the HTTP body has it, and frame server-sent events."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi.responses import Response

from omnistage.engine.outputs import OmniRequestOutput
from omnistage.entrypoints.openai.choices import Collected
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.serve.errors import error_body
from omnistage.errors import InvalidRequestError

Stream = AsyncIterator[OmniRequestOutput]
SSE_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "With stream: true."}
}


async def close(stream: Stream) -> None:
    """End ``stream``: its request is aborted in the stages unless it finished."""
    aclose = getattr(stream, "aclose", None)
    if aclose is not None:
        await aclose()


@asynccontextmanager
async def closing(stream: Stream) -> AsyncIterator[Stream]:
    try:
        yield stream
    finally:
        await close(stream)


async def renamed(stream: Stream, rename: Callable[[str], str | None]) -> Stream:
    """``stream``, with a refused field named as the HTTP body has it (``rename`` gives the
    body's name, or None to keep the field's)."""
    async with closing(stream):
        try:
            async for out in stream:
                yield out
        except InvalidRequestError as exc:
            raise named(exc, rename) from None


def named(exc: InvalidRequestError, rename: Callable[[str], str | None]) -> InvalidRequestError:
    """``exc`` with its field as ``rename`` gives it (itself where ``rename`` gives None)."""
    name = rename(exc.field)
    return exc if name is None else type(exc)(name, getattr(exc, "reason", str(exc)))


async def primed(stream: Stream) -> Stream:
    """Start the stream now so admission errors (stage asleep, bad params) become a status
    code instead of a broken 200 stream."""
    try:
        first = await anext(stream)
    except BaseException:
        await close(stream)
        raise

    async def rest() -> Stream:
        async with closing(stream):
            yield first
            async for out in stream:
                yield out

    return rest()


async def primed_all(streams: list[Stream]) -> list[Stream]:
    """Every stream of a batch started; if one fails, the others are closed (their work
    aborted) and its error raised."""
    if len(streams) == 1:
        return [await primed(streams[0])]
    tasks = [asyncio.ensure_future(primed(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:  # each is finished, or waits at its first output
            await close(stream)
        raise


async def collect(stream: Stream) -> Collected:
    collected = Collected()
    async with closing(stream):
        async for out in stream:
            collected.add(out)
    return collected


async def collect_all(streams: list[Stream]) -> list[Collected]:
    """A batch's streams collected side by side; one failing cancels the others."""
    tasks = [asyncio.ensure_future(collect(s)) for s in streams]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:  # one failed: the others' answers would go to nobody
            task.cancel()


async def merged(streams: list[Stream]) -> AsyncIterator[tuple[int, OmniRequestOutput]]:
    """The outputs of a batch's streams as they come, each with its stream's position."""
    if len(streams) == 1:
        async with closing(streams[0]):
            async for out in streams[0]:
                yield 0, out
        return
    queue: asyncio.Queue[tuple[int, OmniRequestOutput | None, BaseException | None]]
    queue = asyncio.Queue()

    async def pump(position: int, stream: Stream) -> None:
        try:
            async with closing(stream):
                async for out in stream:
                    await queue.put((position, out, None))
        except Exception as exc:
            await queue.put((position, None, exc))
            return
        await queue.put((position, None, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            position, item, error = await queue.get()
            if error is not None:
                raise error
            if item is None:
                running -= 1
            else:
                yield position, item
    finally:
        for task in tasks:
            task.cancel()


def client_gone(log: RequestLog) -> Response:
    """The reply to a client that hung up: nobody reads it; 499 shows in the access log."""
    log.finished("disconnect")
    return Response(status_code=499)


def sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def error_event(exc: Exception) -> str:
    """A failure after the stream began, in-band, in the shape of the HTTP error reply (its
    ``code`` says whether to retry: ``stage_restarting``)."""
    return sse(error_body(exc))


def fingerprint(engine: Any) -> str | None:
    """The weights that answered: ``weights-<version>`` after a trainer's weight sync."""
    version = engine.weight_version(0) if hasattr(engine, "weight_version") else None
    return f"weights-{version}" if version else None
