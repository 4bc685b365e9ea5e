"""``POST /v1/chat/completions`` and ``POST /v1/completions``."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from omnistage.engine.outputs import OmniImage, OmniRequestOutput
from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Usage,
    new_id,
    now,
)

router = APIRouter(tags=["openai"])


def image_part(image: OmniImage) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image.png).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


class _Collected:
    def __init__(self) -> None:
        self.text = ""
        self.images: list[OmniImage] = []
        self.finish_reason: str | None = None
        self.usage = Usage()

    def add(self, out: OmniRequestOutput) -> None:
        if out.modality == "text":
            self.text += out.text_delta
            if out.finished:
                self.usage = Usage(
                    prompt_tokens=out.num_prompt_tokens,
                    completion_tokens=out.num_output_tokens,
                    total_tokens=out.num_prompt_tokens + out.num_output_tokens,
                )
                self.finish_reason = out.finish_reason
        self.images.extend(out.images)
        if out.final:
            self.finish_reason = out.finish_reason


async def _primed(stream: AsyncIterator[OmniRequestOutput]) -> AsyncIterator[OmniRequestOutput]:
    """Start the stream now so admission errors (stage asleep, bad params) become a status
    code instead of a broken 200 stream."""
    first = await anext(stream)

    async def rest() -> AsyncIterator[OmniRequestOutput]:
        yield first
        async for out in stream:
            yield out

    return rest()


async def _collect(stream: AsyncIterator[OmniRequestOutput]) -> _Collected:
    collected = _Collected()
    async for out in stream:
        collected.add(out)
    return collected


def _client_gone(metrics: Any, route: str) -> Response:
    """The reply to a client that hung up: nobody reads it; 499 shows in the access log."""
    metrics.requests.labels(route, "disconnect").inc()
    return Response(status_code=499)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _error_event(exc: Exception) -> str:
    return _sse({"error": {"message": str(exc), "type": type(exc).__name__}})


def _model_name(request: Request, asked: str | None) -> str:
    return asked or request.app.state.served_model_name


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    engine = request.app.state.engine_client
    modalities = body.modalities or ["text"]
    prompt = {"messages": [{"role": m.role, "content": m.text()} for m in body.messages]}
    sampling = body.sampling_params(body.max_completion_tokens or body.max_tokens)
    request_id = new_id("chatcmpl")
    stream = engine.generate(
        prompt,
        sampling,
        modalities,
        image_params=body.image_params(body.seed),
        request_id=request_id,
    )
    model = _model_name(request, body.model)
    metrics = request.app.state.metrics
    if not body.stream:
        collected = await unless_disconnected(request, _collect(stream))
        if collected is None:
            return _client_gone(metrics, "chat")
        content: Any = collected.text
        if collected.images:
            content = [{"type": "text", "text": collected.text}] if "text" in modalities else []
            content += [image_part(img) for img in collected.images]
        metrics.requests.labels("chat", collected.finish_reason or "unknown").inc()
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": now(),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": content},
                        "finish_reason": collected.finish_reason,
                    }
                ],
                "usage": collected.usage.model_dump(),
            }
        )
    primed = await unless_disconnected(request, _primed(stream))
    if primed is None:
        return _client_gone(metrics, "chat")
    include_usage = bool(body.stream_options and body.stream_options.include_usage)

    async def events() -> AsyncIterator[str]:
        base = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": now(),
            "model": model,
        }
        yield _sse(
            {
                **base,
                "choices": [
                    {
                        "index": 0,
                        "delta": {"role": "assistant", "content": ""},
                        "finish_reason": None,
                    }
                ],
            }
        )
        collected = _Collected()
        try:
            async for out in primed:
                collected.add(out)
                delta: dict[str, Any] = {}
                if out.modality == "text" and out.text_delta:
                    delta["content"] = out.text_delta
                if out.images:
                    delta["content"] = [image_part(img) for img in out.images]
                if delta:
                    yield _sse(
                        {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}
                    )
                if out.final:
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {"index": 0, "delta": {}, "finish_reason": out.finish_reason}
                            ],
                        }
                    )
        except Exception as exc:  # mid-stream failure: tell the client in-band, then end
            metrics.requests.labels("chat", "error").inc()
            yield _error_event(exc)
            yield "data: [DONE]\n\n"
            return
        metrics.requests.labels("chat", collected.finish_reason or "unknown").inc()
        if include_usage:
            yield _sse({**base, "choices": [], "usage": collected.usage.model_dump()})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    engine = request.app.state.engine_client
    prompt: dict[str, Any] = (
        {"prompt": body.prompt}
        if isinstance(body.prompt, str)
        else {"prompt_token_ids": body.prompt}
    )
    request_id = new_id("cmpl")
    stream = engine.generate(
        prompt, body.sampling_params(body.max_tokens), ["text"], request_id=request_id
    )
    model = _model_name(request, body.model)
    metrics = request.app.state.metrics
    echo = body.prompt if body.echo and isinstance(body.prompt, str) else ""
    if not body.stream:
        collected = await unless_disconnected(request, _collect(stream))
        if collected is None:
            return _client_gone(metrics, "completions")
        metrics.requests.labels("completions", collected.finish_reason or "unknown").inc()
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": now(),
                "model": model,
                "choices": [
                    {
                        "index": 0,
                        "text": echo + collected.text,
                        "finish_reason": collected.finish_reason,
                        "logprobs": None,
                    }
                ],
                "usage": collected.usage.model_dump(),
            }
        )
    primed = await unless_disconnected(request, _primed(stream))
    if primed is None:
        return _client_gone(metrics, "completions")

    async def events() -> AsyncIterator[str]:
        base = {"id": request_id, "object": "text_completion", "created": now(), "model": model}
        if echo:
            yield _sse({**base, "choices": [{"index": 0, "text": echo, "finish_reason": None}]})
        try:
            async for out in primed:
                if out.text_delta or out.final:
                    reason = out.finish_reason if out.final else None
                    yield _sse(
                        {
                            **base,
                            "choices": [
                                {"index": 0, "text": out.text_delta, "finish_reason": reason}
                            ],
                        }
                    )
        except Exception as exc:
            metrics.requests.labels("completions", "error").inc()
            yield _error_event(exc)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
