"""``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each route starts the request and hands its stream to a builder: a JSON reply (collected)
or server-sent events (streamed). A request whose client hangs up is aborted in the stages.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omnistage.engine.outputs import OmniImage, OmniRequestOutput
from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.metrics import ServerMetrics
from omnistage.entrypoints.openai.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
    new_id,
    now,
)
from omnistage.entrypoints.serve.deps import EngineClientDep, MetricsDep

router = APIRouter(tags=["openai"])

Stream = AsyncIterator[OmniRequestOutput]
_SSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "With stream: true."}
}


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


async def _primed(stream: Stream) -> Stream:
    """Start the stream now so admission errors (stage asleep, bad params) become a status
    code instead of a broken 200 stream."""
    first = await anext(stream)

    async def rest() -> Stream:
        yield first
        async for out in stream:
            yield out

    return rest()


async def _collect(stream: Stream) -> _Collected:
    collected = _Collected()
    async for out in stream:
        collected.add(out)
    return collected


def _client_gone(metrics: ServerMetrics, route: str) -> Response:
    """The reply to a client that hung up: nobody reads it; 499 shows in the access log."""
    metrics.requests.labels(route, "disconnect").inc()
    return Response(status_code=499)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _error_event(exc: Exception) -> str:
    return _sse({"error": {"message": str(exc), "type": type(exc).__name__}})


def _model_name(request: Request, asked: str | None) -> str:
    return asked or request.app.state.served_model_name


# -- chat ------------------------------------------------------------------------------------


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_SSE)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: EngineClientDep, metrics: MetricsDep
) -> Any:
    request_id = new_id("chatcmpl")
    modalities: list[str] = list(body.modalities or ["text"])
    stream = engine.generate(
        {"messages": [{"role": m.role, "content": m.text()} for m in body.messages]},
        body.sampling_params(body.max_completion_tokens or body.max_tokens),
        modalities,
        image_params=body.image_params(body.seed),
        request_id=request_id,
    )
    model = _model_name(request, body.model)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _chat_events(request, stream, metrics, request_id, model, include_usage)
    return await _chat_reply(request, stream, metrics, request_id, model, modalities)


async def _chat_reply(
    request: Request,
    stream: Stream,
    metrics: ServerMetrics,
    request_id: str,
    model: str,
    modalities: list[str],
) -> ChatCompletionResponse | Response:
    collected = await unless_disconnected(request, _collect(stream))
    if collected is None:
        return _client_gone(metrics, "chat")
    content: str | list[dict[str, Any]] = collected.text
    if collected.images:
        parts = [{"type": "text", "text": collected.text}] if "text" in modalities else []
        content = parts + [image_part(img) for img in collected.images]
    metrics.requests.labels("chat", collected.finish_reason or "unknown").inc()
    return ChatCompletionResponse(
        id=request_id,
        created=now(),
        model=model,
        choices=[
            ChatChoice(
                message=AssistantMessage(content=content), finish_reason=collected.finish_reason
            )
        ],
        usage=collected.usage,
    )


async def _chat_events(
    request: Request,
    stream: Stream,
    metrics: ServerMetrics,
    request_id: str,
    model: str,
    include_usage: bool,
) -> Response:
    primed = await unless_disconnected(request, _primed(stream))
    if primed is None:
        return _client_gone(metrics, "chat")
    base = {"id": request_id, "object": "chat.completion.chunk", "created": now(), "model": model}

    def chunk(delta: dict[str, Any], finish_reason: str | None = None) -> str:
        return _sse(
            {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]}
        )

    async def events() -> AsyncIterator[str]:
        yield chunk({"role": "assistant", "content": ""})
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
                    yield chunk(delta)
                if out.final:
                    yield chunk({}, out.finish_reason)
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


# -- completions -------------------------------------------------------------------------------


@router.post("/v1/completions", response_model=CompletionResponse, responses=_SSE)
async def create_completion(
    body: CompletionRequest, request: Request, engine: EngineClientDep, metrics: MetricsDep
) -> Any:
    request_id = new_id("cmpl")
    prompt: dict[str, Any] = (
        {"prompt": body.prompt}
        if isinstance(body.prompt, str)
        else {"prompt_token_ids": body.prompt}
    )
    stream = engine.generate(
        prompt, body.sampling_params(body.max_tokens), ["text"], request_id=request_id
    )
    model = _model_name(request, body.model)
    echo = body.prompt if body.echo and isinstance(body.prompt, str) else ""
    if body.stream:
        return await _completion_events(request, stream, metrics, request_id, model, echo)
    collected = await unless_disconnected(request, _collect(stream))
    if collected is None:
        return _client_gone(metrics, "completions")
    metrics.requests.labels("completions", collected.finish_reason or "unknown").inc()
    return CompletionResponse(
        id=request_id,
        created=now(),
        model=model,
        choices=[
            CompletionChoice(text=echo + collected.text, finish_reason=collected.finish_reason)
        ],
        usage=collected.usage,
    )


async def _completion_events(
    request: Request, stream: Stream, metrics: ServerMetrics, request_id: str, model: str, echo: str
) -> Response:
    primed = await unless_disconnected(request, _primed(stream))
    if primed is None:
        return _client_gone(metrics, "completions")
    base = {"id": request_id, "object": "text_completion", "created": now(), "model": model}

    def chunk(text: str, finish_reason: str | None = None) -> str:
        return _sse(
            {**base, "choices": [{"index": 0, "text": text, "finish_reason": finish_reason}]}
        )

    async def events() -> AsyncIterator[str]:
        if echo:
            yield chunk(echo)
        try:
            async for out in primed:
                if out.text_delta or out.final:
                    yield chunk(out.text_delta, out.finish_reason if out.final else None)
        except Exception as exc:
            metrics.requests.labels("completions", "error").inc()
            yield _error_event(exc)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
